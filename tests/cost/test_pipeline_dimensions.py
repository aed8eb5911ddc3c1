"""The interleaved pipeline and context parallelism, term by term against hand-computed values,
and end to end on the workloads they exist for."""

from __future__ import annotations

import pytest

from dsauto.api import find_plans, make_problem
from dsauto.cost.collectives import Group
from dsauto.cost.layer import CostModel
from dsauto.cost.pipeline import pipeline_seconds
from dsauto.cost.step import chunk_kept_flight, chunk_passes, first_chunk_share, in_flight, interleaved_makespan
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import context_parallel_seconds
from dsauto.engines.megatron import pipeline_layout
from dsauto.engines.rules import context_parallel_refusal, virtual_stage_refusal
from dsauto.parallel import ParallelDims
from dsauto.plan import chunk_layers, rank_layers
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.model import layer_groups
from dsauto.spec.training import TrainSpec


def test_interleaved_warm_up_holds_more_than_1f1b():
    # Megatron's interleaved schedule: rank r runs (pp - r - 1) * 2 + (v - 1) * pp warm-up chunk
    # forwards; pp = 4, v = 2, m = 8: rank 0 holds 11 chunk passes = 5.5 stage passes, rank 3 holds 2.5.
    assert in_flight(0, 4, 8, 2) == 5.5 and in_flight(3, 4, 8, 2) == 2.5
    assert in_flight(0, 4, 8) == 4 and in_flight(3, 4, 8) == 1  # plain 1F1B: pp - stage
    assert in_flight(0, 4, 2, 2) == 2  # never more than all m * v chunk passes
    assert in_flight(0, 16, 32, 4) == 16 + 15 / 4  # pp + (pp - 1) / v on the first rank


def test_interleaving_divides_the_bubble_by_the_chunks_per_rank():
    # Uniform stages of 1 s, pp = 4, m = 8: 1F1B takes m + pp - 1 = 11 s, 2 chunks 8 + 3 / 2 = 9.5 s.
    assert interleaved_makespan([1.0] * 4, 8, 1) == pytest.approx(11.0)
    assert interleaved_makespan([1.0] * 4, 8, 1) == pytest.approx(pipeline_seconds([1 / 3] * 4, [2 / 3] * 4, 8))
    assert interleaved_makespan([1.0] * 4, 8, 2) == pytest.approx(9.5)
    assert interleaved_makespan([1.0] * 4, 8, 4) == pytest.approx(8.75)


def test_the_fill_crosses_each_rank_in_its_first_chunk():
    # Layers that do not divide over the chunks leave the first chunk the largest (the earlier
    # chunks take the remainder), and more chunks than layers leave one layer a chunk: the fill and
    # drain then shrink by the layers, not the chunks.
    assert first_chunk_share(8, 4) == 1 / 4 and first_chunk_share(5, 4) == 2 / 5
    assert first_chunk_share(4, 32) == 1 / 4 and first_chunk_share(0, 3) == 0.0 and first_chunk_share(7, 1) == 1.0
    assert interleaved_makespan([1.0] * 4, 8, 4) == pytest.approx(8.75)
    assert interleaved_makespan([1.0] * 4, 8, 32, first_chunk_seconds=[1 / 4] * 4) == pytest.approx(8 + 3 / 4)
    assert interleaved_makespan([1.0, 2.0, 1.0], 8, 4, first_chunk_seconds=[2 / 5, 1, 1 / 2]) == pytest.approx(16.9)


def test_the_first_chunks_hold_more_passes_when_the_warm_up_does_not_fill_a_round():
    """Megatron's interleaved warm-up runs micro-batches in groups of pp a chunk: pp 2, v 2, rank 0
    runs 2 + 2 + 1 = 5 forwards before its first backward, 3 in chunk 0 and 2 in chunk 1; with
    (3, 5) layers its chunks hold 2 and 1, so it keeps 3 x 2 + 2 x 1 = 8 layer passes, not 5/2 x 3."""
    assert chunk_passes(0, 2, 4, 2) == [3, 2] and chunk_passes(1, 2, 4, 2) == [2, 1]
    assert chunk_passes(0, 2, 2, 2) == [2, 2]  # never more than all m x v chunk passes
    assert sum(chunk_passes(0, 8, 64, 4)) == 4 * in_flight(0, 8, 64, 4)
    # rank 0 of (3, 5): the embedding and two layers in chunk 0, one layer in chunk 1
    assert chunk_kept_flight(0, 2, 4, 2, [0, 0, 0, 1], [1.0, 1.0, 1.0, 1.0]) == pytest.approx((3 * 3 + 2) / 4)
    assert chunk_kept_flight(0, 2, 4, 2, [0, 0, 1, 1], [1.0, 1.0, 1.0, 1.0]) == in_flight(0, 2, 4, 2)
    # a padded rank: one layer in 4 chunks keeps it for chunk 0's passes alone
    assert chunk_kept_flight(0, 8, 16, 4, [0, 0], [1.0, 2.0]) == chunk_passes(0, 8, 16, 4)[0] > in_flight(0, 8, 16, 4)


def test_chunks_in_megatrons_order():
    # Chunk s * pp + r is rank r's s-th: (7, 8, 8, 7) layers over 2 chunks per rank.
    assert chunk_layers((7, 8, 8, 7), 2) == [4, 4, 4, 4, 3, 4, 4, 3]
    ranks = rank_layers((2, 2), 2)  # 4 layers: chunks 0..3 hold one layer each
    assert ranks == [[0, 1, 3], [2, 4, 5]]  # rank 0: embedding, chunk 0, chunk 2; rank 1: chunks 1, 3, head
    assert rank_layers((2, 2), 1) == [[0, 1, 2], [3, 4, 5]]
    assert pipeline_layout((2, 2), 2).layout == "Et|t|t|tL"
    assert sorted(layer for rank in rank_layers((7, 8, 8, 7), 2) for layer in rank) == list(range(32))


def test_interleaving_and_context_parallel_rules():
    assert virtual_stage_refusal("deepspeed", 4, 2, 8) is not None  # Megatron only
    assert virtual_stage_refusal("megatron", 4, 2, 6) is not None  # micro-batches not a multiple of pp
    assert virtual_stage_refusal("megatron", 4, 2, 8) is None
    assert context_parallel_refusal("megatron", 4, 131072, flash_attention=False) is not None
    assert context_parallel_refusal("megatron", 3, 8192 + 2, flash_attention=True) is not None
    # DeepSpeed-Ulysses: heads and key/value heads split over cp, no pipeline engine.
    assert context_parallel_refusal("deepspeed", 2, 8192, flash_attention=False, heads=32, kv_heads=8) is None
    assert "8 key/value heads" in context_parallel_refusal("deepspeed", 16, 8192, flash_attention=False,
                                                             heads=32, kv_heads=8)
    assert "12 attention heads" in context_parallel_refusal("deepspeed", 8, 8192, flash_attention=True,
                                                              heads=12, kv_heads=12)
    assert "pipeline" in context_parallel_refusal("deepspeed", 2, 8192, flash_attention=True, heads=32,
                                                  kv_heads=8, pp=2)
    assert context_parallel_refusal("megatron", 16, 131072, flash_attention=True) is None


PLAIN = LayerOption(checkpoint=False, shard_params=False, split=1)


def test_ring_attention_passes_keys_and_values_cp_minus_one_times():
    cluster = load_cluster("h100-80gb", nodes=2, gpus_per_node=8)
    model, train = load_model("llama3-8b"), TrainSpec(global_batch=16, seq_len=32768, dtype="bf16")
    strategy = Strategy(dims=ParallelDims(dp=2, tp=2, cp=4), zero_stage=1, micro_batch=1, grad_accum=8,
                        sequence_parallel=True, engine="megatron")
    cost = CostModel(cluster, train, strategy, model.hidden_size)
    block = layer_groups(model, train.seq_len, train.dtype_bytes, strategy.tp)[1]
    ctx = cost.context
    assert ctx.tokens == 32768 // 4 and ctx.dp == 2 * 4  # ZeRO shards over dp x cp
    # Keys and values: 2 x 8 heads x 128 x 2 bytes = 4 KiB per token, split over tp = 2.
    assert block.kv_bytes_per_token == 2 * 8 * 128 * 2
    share = 8192 * 4096 / 2
    slow = Group(4, bandwidth_bytes_per_second=1e9, latency_seconds=0.0)  # a ring too slow to hide
    exposed = context_parallel_seconds(block, PLAIN, ctx.__class__(**{**ctx.__dict__, "cp_group": slow}))
    comm = 3 * share / 1e9
    assert exposed.forward_seconds > 0.5 * comm and exposed.backward_seconds > exposed.forward_seconds
    fast = Group(4, bandwidth_bytes_per_second=1e15, latency_seconds=0.0)  # hidden behind attention
    hidden = context_parallel_seconds(block, PLAIN, ctx.__class__(**{**ctx.__dict__, "cp_group": fast}))
    assert hidden.forward_seconds < 1e-4 * exposed.forward_seconds + 1e-12


def test_llama3_405b_on_16384_h100_interleaves_and_reports_the_bubble_saved():
    problem = make_problem("llama3-405b", "h100-80gb", nodes=2048, gpus_per_node=8, global_batch=2048,
                           seq_len=8192)
    plan = find_plans(problem)[0]
    assert plan.engine == "megatron" and plan.pp > 1 and plan.virtual_stages > 1
    assert plan.prediction.plain_bubble_seconds > 1.5 * plan.prediction.bubble_seconds


def test_a_128k_workload_is_split_over_context_parallel_ranks():
    with pytest.warns(UserWarning, match="extends its context"):
        problem = make_problem("llama3-8b", "h100-80gb", nodes=8, gpus_per_node=8, global_batch=64,
                               seq_len=131072)
    plan = find_plans(problem)[0]
    assert plan.cp > 1 and plan.prediction.peak_memory_bytes <= plan.memory_budget_bytes
    assert plan.dp * plan.tp * plan.pp * plan.cp == 64
