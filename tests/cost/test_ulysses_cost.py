"""DeepSpeed-Ulysses (a DeepSpeed plan's cp): its all-to-all term against a hand-computed volume,
its activation memory, its engine rules, the emitted config as DeepSpeed parses it, and the search."""

from __future__ import annotations

import pytest

from dsauto.cost.layer import CostModel
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import ulysses_seconds
from dsauto.emit.ds_config import ds_config, validate_ds_config
from dsauto.engines.deepspeed import config_contradictions
from dsauto.errors import DsautoError
from dsauto.parallel import ParallelDims
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints, strategies
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.loaders import load_hardware, load_model
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import TrainSpec

PLAIN = LayerOption(checkpoint=False, shard_params=False, split=1)


def h100(nodes: int = 1) -> ClusterSpec:
    return ClusterSpec(load_hardware("h100-80gb"), nodes=nodes, gpus_per_node=8)


def strategy(cp: int, dp: int, engine: str = "deepspeed", zero: int = 0) -> Strategy:
    return Strategy(dims=ParallelDims(dp=dp, tp=1, pp=1, cp=cp), zero_stage=zero, micro_batch=1, grad_accum=1,
                    sequence_parallel=False, engine=engine)


def test_all_to_all_volume_matches_the_paper():
    """Jacobs et al. 2023, Sec. 3.2: four all-to-alls of N·h/P elements per rank and layer in forward
    (q, k, v, output), the same four in backward; a pairwise exchange inside a node moves (P-1)/P of
    each rank's bytes over its link, one latency per partner."""
    model = ModelSpec(name="mha", architecture="decoder", num_layers=2, hidden_size=4096, num_attention_heads=32,
                      ffn_hidden_size=16384, vocab_size=32000, max_position_embeddings=32768)
    train = TrainSpec(global_batch=8, seq_len=32768)
    cluster = h100()
    s = strategy(cp=4, dp=2)
    ctx = CostModel(cluster, train, s, model.hidden_size).context
    block = layer_groups(model, train.seq_len, train.dtype_bytes, 1)[1]
    passes = ulysses_seconds(block, PLAIN, ctx)
    link = cluster.hardware.intra_node
    message = 32768 * 4096 * 2 / 4  # N·h/P elements of 2 bytes: one rank's share of q (or k, v, out)
    one = 3 / 4 * message / (link.bandwidth_gbps * 1e9 * link.efficiency) + 3 * link.latency_seconds
    assert passes.forward_seconds == pytest.approx(4 * one, rel=1e-12)
    assert passes.backward_seconds == pytest.approx(4 * one, rel=1e-12)
    # A checkpointed layer runs its forward's four again in backward.
    again = ulysses_seconds(block, LayerOption(checkpoint=True, shard_params=False, split=1), ctx)
    assert again.backward_seconds == pytest.approx(8 * one, rel=1e-12)
    # Megatron-core's cp is ring attention: no all-to-all there, and no ring under DeepSpeed.
    megatron = CostModel(cluster, train, strategy(cp=4, dp=2, engine="megatron"), model.hidden_size).context
    assert ulysses_seconds(block, PLAIN, megatron).forward_seconds == 0.0


def test_grouped_query_attention_moves_narrower_keys_and_values():
    model = load_model("llama3-8b")  # 32 query heads, 8 key/value heads of 128
    train = TrainSpec(global_batch=8, seq_len=65536)
    cluster = h100()
    ctx = CostModel(cluster, train, strategy(cp=8, dp=1), model.hidden_size).context
    block = layer_groups(model, train.seq_len, train.dtype_bytes, 1)[1]
    link = cluster.hardware.intra_node
    bandwidth = link.bandwidth_gbps * 1e9 * link.efficiency

    def exchange(width: int) -> float:
        return 7 / 8 * (65536 / 8 * width * 2) / bandwidth + 7 * link.latency_seconds

    expected = 2 * exchange(4096) + 2 * exchange(1024)  # q and out 4096 wide, k and v 8 x 128
    assert ulysses_seconds(block, PLAIN, ctx).forward_seconds == pytest.approx(expected, rel=1e-12)


def test_activations_divide_by_cp():
    model = load_model("llama3-8b")
    train = TrainSpec(global_batch=8, seq_len=65536)
    block = layer_groups(model, train.seq_len, train.dtype_bytes, 1)[1]
    whole = CostModel(h100(), train, strategy(cp=1, dp=8), model.hidden_size).layer(block, PLAIN)
    shard = CostModel(h100(), train, strategy(cp=8, dp=1), model.hidden_size).layer(block, PLAIN)
    assert shard.activation_bytes == pytest.approx(whole.activation_bytes / 8, rel=1e-9)


def test_the_config_carries_sequence_parallel_size_and_deepspeed_accepts_it():
    model = load_model("llama3-8b")
    train = TrainSpec(global_batch=16, seq_len=65536)
    planner = Planner(model, h100(), train, Constraints(engine="deepspeed", cp=4, zero_stage=1))
    plan = planner.search()[0]
    assert (plan.cp, plan.dp, plan.engine) == (4, 2, "deepspeed")
    config = ds_config(plan)
    assert config["sequence_parallel_size"] == 4
    validate_ds_config(config, dp=plan.dp)  # batch 16 = micro x accumulation x dp 2 (not dp x cp)
    assert config_contradictions(config, plan) == []
    edited = {**config, "sequence_parallel_size": 2}
    assert any("sequence_parallel_size is 2" in p for p in config_contradictions(edited, plan))
    # A Megatron-core plan's cp is ring attention, not a DeepSpeed key.
    ring = Planner(model, h100(), train, Constraints(engine="megatron", cp=4)).search()[0]
    assert "sequence_parallel_size" not in ds_config(ring)


def test_search_splits_long_sequences_only_and_heads_must_divide():
    model = load_model("llama3-8b")
    cluster = ClusterSpec(load_hardware("h100-80gb"), nodes=8, gpus_per_node=8)
    long = TrainSpec(global_batch=64, seq_len=131072)
    space = strategies(model, cluster, long, Constraints(engine="deepspeed"))
    assert {s.dims.cp for s in space} == {1, 2, 4, 8}  # 8 key/value heads: cp 16 and up cannot split them
    assert all(s.pp == 1 for s in space if s.dims.cp > 1)
    plan = Planner(model, cluster, long, Constraints(engine="deepspeed")).search()[0]
    assert plan.cp > 1
    short = TrainSpec(global_batch=64, seq_len=4096)
    assert {s.dims.cp for s in strategies(model, cluster, short, Constraints(engine="deepspeed"))} == {1}
    with pytest.raises(DsautoError, match="8 key/value heads over cp 16"):
        Planner(model, cluster, long, Constraints(engine="deepspeed", cp=16)).search()
