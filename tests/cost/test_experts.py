"""Mixture-of-experts cost terms: expert state split over ep x etp and sharded over the expert
data-parallel group, the all-to-all dispatch (intra vs inter node), the grouped GEMM's size
efficiency, and dense layers priced as before."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from dsauto.cost.collectives import AllToAll, expert_all_to_all
from dsauto.cost.layer import CostModel
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import EXPERT_LOAD_IMBALANCE
from dsauto.parallel import ParallelDims
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.hf import model_from_hf_config
from dsauto.spec.loaders import load_hardware
from dsauto.spec.model import layer_groups
from dsauto.spec.training import TrainSpec

CONFIGS = Path(__file__).parents[1] / "spec" / "configs"
PLAIN = LayerOption(checkpoint=False, shard_params=False, split=1)


def mixtral():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_from_hf_config(json.loads((CONFIGS / "mixtral-8x7b.json").read_text()), "mixtral")


def price(dims, nodes=8, zero=1, tokens=4096):
    cluster = ClusterSpec(load_hardware("h100-80gb"), nodes=nodes, gpus_per_node=8)
    train = TrainSpec(global_batch=dims.dp, seq_len=tokens, dtype="bf16")
    strategy = Strategy(dims=dims, zero_stage=zero, micro_batch=1, grad_accum=1,
                        sequence_parallel=dims.tp > 1, engine="megatron")
    model = mixtral()
    block = layer_groups(model, train.seq_len, train.dtype_bytes, dims.tp)[1]
    return CostModel(cluster, train, strategy, model.hidden_size), block


def test_expert_state_splits_over_ep_and_shards_over_expert_dp():
    one, block = price(ParallelDims(dp=64))
    eight, _ = price(ParallelDims(dp=64, ep=8))
    a, b = one.layer(block, PLAIN), eight.layer(block, PLAIN)
    experts = block.expert_params
    # 16-bit parameters: the experts' 2 bytes split 8 ways, the rest unchanged
    assert a.params_bytes - b.params_bytes == pytest.approx(2 * experts * (1 - 1 / 8))
    # distributed optimizer: 12 bytes over dp 64 without ep; over expert dp 8 with ep 8 (64/8)
    dense = block.params - experts
    assert a.optimizer_bytes == pytest.approx(12 * (dense + experts) / 64)
    assert b.optimizer_bytes == pytest.approx(12 * dense / 64 + 12 * experts / 8 / 8)


def test_all_to_all_inside_a_node_is_faster_than_across():
    cost_in, block = price(ParallelDims(dp=64, ep=8))  # 8 consecutive ranks: one node
    cost_out, _ = price(ParallelDims(dp=64, ep=16))  # two nodes
    inside, across = cost_in.expert_dispatch_seconds(block), cost_out.expert_dispatch_seconds(block)
    assert 0 < inside < across
    assert price(ParallelDims(dp=64))[0].expert_dispatch_seconds(block) == 0.0  # no ep, no exchange


def test_all_to_all_is_pairwise_exchange():
    group = AllToAll(size=16, members_per_node=8, intra_bytes_per_second=400e9, inter_bytes_per_second=50e9,
                     intra_latency_seconds=0.0, inter_latency_seconds=0.0)
    # 8 of 16 destinations off the node through one NIC, 7 on it over NVLink: the NIC bounds it
    assert group.all_to_all(1e9) == pytest.approx(8 / 16 * 1e9 / 50e9)
    cluster = ClusterSpec(load_hardware("h100-80gb"), nodes=2, gpus_per_node=8)
    assert expert_all_to_all(cluster, ParallelDims(dp=16, ep=16)).members_per_node == 8
    assert expert_all_to_all(cluster, ParallelDims(dp=16, ep=4)).members_per_node == 4


def test_dispatch_moves_top_k_copies_of_each_token():
    cost, block = price(ParallelDims(dp=64, ep=8))
    group = cost.context.ep_group
    size = 4096 * 2 * 4096 * 2 * EXPERT_LOAD_IMBALANCE  # tokens x top-2 x hidden x bf16
    assert cost.expert_dispatch_seconds(block) == pytest.approx(4 * group.all_to_all(size))


def test_grouped_gemm_runs_slower_with_fewer_tokens_per_expert():
    long_seq, block = price(ParallelDims(dp=64, ep=8), tokens=4096)
    short_seq, short_block = price(ParallelDims(dp=64, ep=8), tokens=64)
    per_token_long = long_seq.layer(block, PLAIN).forward_seconds / 4096
    per_token_short = short_seq.layer(short_block, PLAIN).forward_seconds / 64
    assert per_token_short > per_token_long


def test_active_flops_not_total():
    block = layer_groups(mixtral(), 4096, 2)[1]
    assert block.expert_matmul_flops_per_token == pytest.approx(2 * 2 * 3 * 4096 * 14336)  # top-2 of 8
    assert block.matmul_flops_per_token < 2 * block.params / 3


def test_recomputing_the_experts_activation_frees_its_output_and_costs_a_pass_over_it():
    cost, block = price(ParallelDims(dp=64, ep=8))
    plain = cost.layer(block, PLAIN)
    moe_act = cost.layer(block, LayerOption(checkpoint=False, shard_params=False, split=1,
                                            recompute_modules=("moe_act",)))
    # Megatron-core's grouped experts drop the activation's output, the second matrix's input: top-2
    # copies of each token, 14336 wide, in bf16, at the busiest rank's load
    freed = 4096 * 2 * 14336 * 2 * EXPERT_LOAD_IMBALANCE
    assert plain.activation_bytes - moe_act.activation_bytes == pytest.approx(freed)
    # and run the activation again in backward: read the first matrix's gate and up outputs, write one
    rerun = cost.context.device.memory_seconds(4096 * 2 * 3 * 14336 * 2 * EXPERT_LOAD_IMBALANCE)
    assert moe_act.backward_seconds - plain.backward_seconds == pytest.approx(rerun)
    assert moe_act.forward_seconds == pytest.approx(plain.forward_seconds)


def test_moe_act_is_megatron_cores_and_needs_experts():
    from dsauto.engines.rules import recompute_module_refusal

    assert recompute_module_refusal("moe_act", engine="megatron", experts=True) is None
    assert recompute_module_refusal("moe_act", experts=True) is None  # either engine: Megatron-core can
    assert "megatron" in recompute_module_refusal("moe_act", engine="deepspeed", experts=True)
    assert "no experts" in recompute_module_refusal("moe_act", engine="megatron", experts=False)


def test_forced_balance_removes_the_busiest_ranks_excess():
    cluster = ClusterSpec(load_hardware("h100-80gb"), nodes=8, gpus_per_node=8)
    train = TrainSpec(global_batch=64, seq_len=4096, dtype="bf16")
    block = layer_groups(mixtral(), train.seq_len, train.dtype_bytes, 1)[1]
    costs = [CostModel(cluster, train, Strategy(dims=ParallelDims(dp=64, ep=8), zero_stage=1, micro_batch=1,
                                                grad_accum=1, sequence_parallel=False, engine="megatron",
                                                expert_load_balanced=balanced), 4096)
             for balanced in (False, True)]
    routed, balanced = (cost.expert_dispatch_seconds(block) for cost in costs)
    assert routed == pytest.approx(balanced * EXPERT_LOAD_IMBALANCE, rel=0.02)  # latency apart
    assert costs[1].layer(block, PLAIN).forward_seconds < costs[0].layer(block, PLAIN).forward_seconds


def test_deepep_sends_a_token_once_per_other_node_holding_its_experts():
    from math import comb

    from dsauto.cost.terms import remote_node_share

    # 256 experts over 64 ranks on 8 nodes (32 a node), top-8: a node holds none of a token's experts
    # with probability C(224, 8) / C(256, 8); the 7 other nodes get one copy each where they do
    expected = 7 * (1 - comb(224, 8) / comb(256, 8)) / 8
    assert remote_node_share(256, 8, 64, 8) == pytest.approx(expected)
    assert remote_node_share(256, 8, 64, 8) < 56 / 64  # the all-to-all's share of every copy
    assert remote_node_share(8, 2, 8, 8) == 0.0  # one node: nothing crosses the network
    group = AllToAll(size=64, members_per_node=8, intra_bytes_per_second=400e9, inter_bytes_per_second=50e9,
                     intra_latency_seconds=0.0, inter_latency_seconds=0.0)
    assert group.node_deduplicated(1e9, expected) == pytest.approx(expected * 1e9 / 50e9)
    cluster = ClusterSpec(load_hardware("h100-80gb"), nodes=8, gpus_per_node=8)
    train = TrainSpec(global_batch=64, seq_len=4096, dtype="bf16")
    block = layer_groups(mixtral(), train.seq_len, train.dtype_bytes, 1)[1]
    alltoall, deepep = (CostModel(cluster, train, Strategy(
        dims=ParallelDims(dp=64, ep=8), zero_stage=1, micro_batch=1, grad_accum=1,
        sequence_parallel=False, engine="megatron", expert_dispatcher=dispatcher), 4096).expert_dispatch_seconds(block)
        for dispatcher in ("alltoall", "deepep"))
    assert deepep == pytest.approx(alltoall)  # ep 8 inside a node: DeepEP's intranode path is an all-to-all too


def test_megatron_fsdp_gathers_a_whole_layer_with_its_local_experts():
    from dsauto.cost.terms import sharded_gather_bytes

    sharded = LayerOption(checkpoint=False, shard_params=True, split=1)
    for ep in (1, 8):
        cost, block = price(ParallelDims(dp=64, ep=ep), zero=3)
        # the unit (a TransformerLayer) in use and the next one prefetched, bf16, 1/ep of the experts
        layer = block.params - block.expert_params + block.expert_params / ep
        assert sharded_gather_bytes(block, sharded, cost.context) == pytest.approx(2 * layer * 2)
    # and the experts' states are sharded over the expert data-parallel group (64 / 8)
    state = price(ParallelDims(dp=64, ep=8), zero=3)[0].layer(block, sharded)
    assert state.params_bytes == pytest.approx(2 * (block.params - block.expert_params) / 64
                                               + 2 * block.expert_params / 8 / 8)


def test_short_expert_groups_pay_the_devices_measured_knee():
    from dataclasses import replace

    from dsauto.cost.terms import expert_gemm_seconds

    # Mixtral at ep 1: 4096 tokens x top-2 over 8 experts = 1024 tokens each; 64 tokens: 16 each
    for tokens, per_expert in ((4096, 1024), (64, 16)):
        cost, block = price(ParallelDims(dp=64), tokens=tokens)
        ctx = cost.context
        knee = ctx.device.grouped_gemm_knee_tokens
        assert knee == 222  # the H100 preset's, from benchmarks/results/device_experts_h100-80gb.md
        flat = expert_gemm_seconds(block, replace(ctx, device=replace(ctx.device, grouped_gemm_knee_tokens=0.0)))
        assert expert_gemm_seconds(block, ctx) == pytest.approx(flat * (1 + (knee / per_expert) ** 2))


def test_a_pipeline_stage_holds_its_own_layers_kind_not_the_stacks_average():
    """DeepSeek-V2-Lite's first layer is dense and its 26 others MoE layers. The block group averages
    them (the whole stack exact); a pipeline stage is priced with each of its layers' own kind, so
    the stage holding the dense layer holds one dense MLP and its others whole MoE layers, exactly
    (before, every stage held 26/27 of an MoE layer per layer: its MoE stages' expert state came out
    1/27 short)."""
    from dsauto.api import make_plan
    from dsauto.spec.model import block_parameters, layer_group_per_layer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_from_hf_config(json.loads((CONFIGS / "deepseek-v2-lite.json").read_text()), "deepseek_v2")
    assert model.moe_layers() == tuple(range(1, model.num_layers))
    groups = layer_groups(model, 4096, 2)
    per_layer = layer_group_per_layer(model, groups, 4096, 2)
    assert per_layer[1].expert_params == 0 and per_layer[2].moe_layer_fraction == 1.0
    assert sum(g.params for g in per_layer[1:-1]) == pytest.approx(groups[1].params * model.num_layers, abs=model.num_layers)
    plan = make_plan(model, "h100-80gb", nodes=2, gpus_per_node=8, global_batch=64, seq_len=4096, engine="megatron",
                     pp=2, tp=1, ep=8, stage_layers="13,14", offload="none")
    parts = block_parameters(model)
    moe_layer = parts.attention + parts.shared_expert + parts.router + parts.num_experts * parts.expert / 8
    first, last = plan.stages
    assert first.params_bytes == pytest.approx(2 * (groups[0].params + parts.attention + parts.dense_mlp
                                                    + 12 * moe_layer), rel=1e-6)
    assert last.params_bytes == pytest.approx(2 * (groups[2].params + 14 * moe_layer), rel=1e-6)
