"""The interleaved pipeline and context parallelism, term by term against hand-computed values,
and end to end on the workloads they exist for."""

from __future__ import annotations

import itertools

import pytest

from dsauto.api import find_plans, make_problem
from dsauto.search.planner import Planner
from dsauto.cost.collectives import Group
from dsauto.cost.layer import CostModel
from dsauto.cost.pipeline import interleaved_order, pipeline_seconds, simulate_interleaved
from dsauto.cost.step import first_chunk_share, in_flight, interleaved_makespan, interleaved_peak
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


def test_the_first_chunks_gain_passes_while_the_last_ones_drain():
    """Megatron's interleaved schedule runs forwards chunk after chunk in groups of pp micro-batches
    and backwards from the last chunk: pp 2, v 2, 4 micro-batches. Rank 0 runs 4 warm-up forwards
    (chunk 0 twice, chunk 1 twice), then a forward of chunk 0 and a backward of chunk 1 in each
    step, so chunk 0 comes to hold all 4 micro-batches; the last rank keeps its loss only while its
    head's chunk holds a pass (measured: benchmarks/megatron_memory.py, pp2 vpp2 layers-1+3)."""
    # alike chunks: in_flight passes of each, and the largest backward transient
    assert interleaved_peak(0, 2, 4, 2, [(1.0, 0.0, 0.5), (1.0, 0.0, 0.5)]) == (5.0, 0.5) and in_flight(0, 2, 4, 2) == 2.5
    # rank 0 of (1, 3) layers: the embedding and a layer in chunk 0, chunk 1 empty
    assert interleaved_peak(0, 2, 4, 2, [(3.0, 0.0, 0.5), (0.0, 0.0, 0.0)]) == (12.0, 0.5)
    # the last rank: chunk 0 two layers, chunk 1 a layer and the head whose loss outweighs a pass
    kept, transient = interleaved_peak(1, 2, 4, 2, [(2.0, 0.0, 0.5), (1.0, 4.0, 4.0)])
    assert (kept, transient) == (5.0, 4.0)  # two passes of chunk 0 and the head's, at its loss
    assert interleaved_peak(1, 2, 4, 2, [(2.0, 0.0, 0.5), (1.0, 0.0, 0.5)]) == (6.0, 0.5)  # three of chunk 0
    # a long step repeats its rounds: 64 micro-batches peak as 8 do
    assert interleaved_peak(0, 4, 64, 2, [(3.0, 0.0, 1.0), (1.0, 0.0, 1.0)]) == interleaved_peak(
        0, 4, 8, 2, [(3.0, 0.0, 1.0), (1.0, 0.0, 1.0)])


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
    exposed = context_parallel_seconds(block, PLAIN, ctx.__class__(**{**ctx.__dict__, "cp_ring": slow}))
    comm = 3 * share / 1e9
    assert exposed.forward_seconds > 0.5 * comm and exposed.backward_seconds > exposed.forward_seconds
    fast = Group(4, bandwidth_bytes_per_second=1e15, latency_seconds=0.0)  # hidden behind attention
    hidden = context_parallel_seconds(block, PLAIN, ctx.__class__(**{**ctx.__dict__, "cp_ring": fast}))
    assert hidden.forward_seconds < 1e-4 * exposed.forward_seconds + 1e-12


def test_a_ring_across_nodes_steps_at_one_nics_pace():
    """Ring attention's sends run at once, one per rank, and a step waits for the one crossing the
    network through its own NIC; a ring collective over the same ranks moves over the node's eight NICs
    together. cp 16 over two H100 nodes: 40 GB/s a step, not 320."""
    from dsauto.cost.collectives import group_of, ring_link

    cluster = load_cluster("h100-80gb", nodes=2, gpus_per_node=8)
    dims = ParallelDims(dp=1, cp=16)
    nic = cluster.hardware.inter_node.bandwidth_gbps * 1e9 * cluster.hardware.inter_node.efficiency
    assert ring_link(cluster, dims, "cp").bandwidth_bytes_per_second == pytest.approx(nic)
    assert group_of(cluster, dims, "cp").bandwidth_bytes_per_second == pytest.approx(8 * nic)
    inside = ParallelDims(dp=2, cp=8)  # a ring inside each node keeps NVLink
    assert (ring_link(cluster, inside, "cp").bandwidth_bytes_per_second
            == group_of(cluster, inside, "cp").bandwidth_bytes_per_second)
    model, train = load_model("llama3-8b"), TrainSpec(global_batch=64, seq_len=16384, dtype="bf16")
    strategy = Strategy(dims=dims, zero_stage=1, micro_batch=2, grad_accum=32, sequence_parallel=False,
                        engine="megatron")
    ctx = CostModel(cluster, train, strategy, model.hidden_size).context
    block = layer_groups(model, train.seq_len, train.dtype_bytes, 1)[1]
    share = 2 * 16384 // 16 * block.kv_bytes_per_token
    forward = context_parallel_seconds(block, PLAIN, ctx).forward_seconds
    assert forward > 0.5 * 15 * share / nic  # most of the 15 sends' 3.1 ms a layer is exposed


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


def _every_step_of_the_interleaved_schedule(stage, pp, micro_batches, v, chunks):
    """interleaved_peak's reference: every forward and backward of the step, in Megatron's order."""
    keeps, passes = [keep for keep, _, _ in chunks], micro_batches * v
    warm_up = min((pp - stage - 1) * 2 + (v - 1) * pp, passes)

    def chunk(k, forward):
        c = (k % (pp * v)) // pp
        return c if forward else v - 1 - c

    held, best = [0] * v, (-1.0, 0.0, 0.0)

    def moment(transient):
        nonlocal best
        kept = sum(h * keep for h, keep in zip(held, keeps))
        best = max(best, (kept + transient, kept, transient), key=lambda b: b[0])

    order = ([(k, True) for k in range(warm_up)]
             + [step for i in range(passes - warm_up) for step in ((warm_up + i, True), (i, False))]
             + [(k, False) for k in range(passes - warm_up, passes)])
    for k, forward in order:
        c = chunk(k, forward)
        if forward:
            held[c] += 1
            moment(chunks[c][1])
        else:
            moment(chunks[c][2])
            held[c] -= 1
    assert held == [0] * v
    return best[1], best[2]


def test_the_simulated_round_peaks_as_every_step_does():
    import random

    rng = random.Random(7)
    for _ in range(300):
        pp, v = rng.choice([2, 3, 4, 8]), rng.choice([2, 3, 4])
        micro_batches, stage = pp * rng.randint(1, 12), rng.randrange(pp)
        chunks = [(float(rng.choice([0, 1, 2, 3, 5])), float(rng.choice([0, 0, 4])), rng.random()) for _ in range(v)]
        if rng.random() < 0.3:  # alike chunks, which interleaved_peak answers without simulating
            chunks = [chunks[0]] * v
        got, want = (interleaved_peak(stage, pp, micro_batches, v, chunks),
                     _every_step_of_the_interleaved_schedule(stage, pp, micro_batches, v, chunks))
        assert sum(got) == pytest.approx(sum(want))


def test_the_interleaved_order_is_megatrons():
    """Each rank's operations follow Megatron-core's own schedule table (forwards in groups of pp
    micro-batches chunk after chunk, backwards with the chunks reversed) and its warm-up count."""
    import warnings

    from types import SimpleNamespace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Transformer Engine and Apex absent on CPU
        from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
    for (pp, v, m), overlap in itertools.product([(2, 2, 4), (4, 3, 8), (4, 2, 4), (3, 4, 12), (2, 2, 2)], (False, True)):
        table = get_schedule_table(m, v, pp)
        for rank in range(pp):
            order = interleaved_order(rank, pp, m, v, int(overlap))
            forwards = [(j, c) for kind, j, c in order if kind == "F"]
            backwards = [(j, v - 1 - c) for kind, j, c in order if kind == "B"]
            assert forwards == list(table) and backwards == list(table)
            group = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
            _, _, warmup, steady = get_pp_rank_microbatches(
                m, v, pp, overlap_moe_expert_parallel_comm=overlap,
                p2p_communicator=SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=v))
            # warm-up forwards, then a forward and a backward in turn, then the rest backwards
            assert "".join(kind for kind, _, _ in order) == "F" * warmup + "FB" * steady + "B" * warmup


def _brute_force_interleaved(forward, backward, m):
    """The ends of every operation as the least fixed point of start = max(rank free, input ready),
    by sweeping until nothing changes."""
    pp, v = len(forward), len(forward[0])
    orders = [interleaved_order(i, pp, m, v) for i in range(pp)]

    def waits_on(kind, i, j, c):
        if kind == "F":
            return ("F", i - 1, j, c) if i > 0 else ("F", pp - 1, j, c - 1) if c > 0 else None
        return ("B", i + 1, j, c) if i < pp - 1 else ("B", 0, j, c + 1) if c < v - 1 else ("F", i, j, c)

    ends = {(kind, i, j, c): 0.0 for i, order in enumerate(orders) for kind, j, c in order}
    changed = True
    while changed:
        changed = False
        for i, order in enumerate(orders):
            free = 0.0
            for kind, j, c in order:
                dep = waits_on(kind, i, j, c)
                end = max(free, ends[dep] if dep else 0.0) + (forward if kind == "F" else backward)[i][c]
                if end != ends[(kind, i, j, c)]:
                    ends[(kind, i, j, c)], changed = end, True
                free = end
    return ends


def test_the_interleaved_simulation_against_brute_force_and_the_closed_form():
    import random

    rng = random.Random(3)
    for _ in range(40):
        pp, v = rng.choice([2, 3, 4]), rng.choice([2, 3])
        m = pp * rng.randint(1, 3)
        forward = [[rng.uniform(0.1, 1.0) for _ in range(v)] for _ in range(pp)]
        backward = [[2 * t * rng.uniform(0.8, 1.2) for t in row] for row in forward]
        ops = simulate_interleaved(forward, backward, m)
        ends = _brute_force_interleaved(forward, backward, m)
        assert {(kind, i, j, c): end for i, rank in enumerate(ops) for kind, j, c, _, end in rank} == pytest.approx(ends)
    # equal chunks: (m + (pp - 1) / v) passes through a stage (Narayanan et al. 2021, Sec. 2.2.2)
    for pp, v, m in [(4, 2, 8), (16, 4, 16), (8, 3, 24)]:
        ops = simulate_interleaved([[0.1] * v] * pp, [[0.2] * v] * pp, m)
        assert max(rank[-1][4] for rank in ops) == pytest.approx(interleaved_makespan([0.3 * v] * pp, m, v))


@pytest.mark.parametrize("workload", [
    dict(model="llama3-405b", hardware="h100-80gb", nodes=2048, gpus_per_node=8, global_batch=2048, seq_len=8192),
    dict(model="llama2-70b", hardware="a100-80gb", nodes=4, gpus_per_node=8, global_batch=64, seq_len=4096, pp=4, vpp=2),
    dict(model="llama3-8b", hardware="h100-80gb", nodes=1, gpus_per_node=8, global_batch=8, seq_len=4096, pp=8, vpp=2,
         micro_batch=1),
], ids=["llama3-405b", "llama2-70b-uneven", "llama3-8b-head-chunk"])
def test_the_prediction_simulates_the_interleaved_schedule_of_the_plans_chunks(workload):
    """An interleaved plan's pipeline is Megatron-core's schedule simulated over its chunks' passes (and
    the fill's transfers), not the closed form m x slowest + the other ranks' first chunks, which misses
    what uneven chunks cost: on 8 ranks of 4-5 layers, 8 micro-batches, the head's chunk made the
    closed form 24% short. It is at least what any rank's own passes and the first chunks before it
    take (the first micro-batch's forward reaches rank i through them, and the last one's backward
    leaves through them)."""
    problem = make_problem(**workload)
    plan = Planner(problem.model, problem.cluster, problem.train, problem.pins).search()[0]
    assert plan.virtual_stages > 1
    forward = [list(st.chunk_forward_seconds) for st in plan.stages]
    backward = [list(st.chunk_backward_seconds) for st in plan.stages]
    ops = simulate_interleaved(forward, backward, plan.grad_accum)
    for st in plan.stages:
        assert sum(st.chunk_forward_seconds) == pytest.approx(st.forward_seconds)
        assert sum(st.chunk_backward_seconds) == pytest.approx(st.backward_seconds)
    pipeline = plan.prediction.compute_seconds + plan.prediction.bubble_seconds
    assert pipeline == pytest.approx(max(rank[-1][4] for rank in ops), rel=0.005)  # and the fill's transfers
    for i, st in enumerate(plan.stages):
        first_chunks = sum(forward[r][0] + backward[r][0] for r in range(i))
        assert pipeline >= plan.grad_accum * (st.forward_seconds + st.backward_seconds) + first_chunks
