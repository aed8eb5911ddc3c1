"""A plan knows its engine: memory and overlap priced as DeepSpeed or Megatron-core run it, the
search offers only what each engine runs, and near-ties go to the plan with memory to spare."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dsauto.api import find_plans, make_problem
from dsauto.cost.layer import CostModel
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import state_bytes_per_param
from dsauto.engines.rules import refusal
from dsauto.errors import DsautoError
from dsauto.parallel import ParallelDims
from dsauto.search.planner import Planner
from dsauto.search.ranking import SAFE_HEADROOM, TIE_TOLERANCE, rank_by_headroom
from dsauto.search.space import Constraints, strategies
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.model import layer_groups
from dsauto.spec.training import TrainSpec

PLAIN = LayerOption(checkpoint=False, shard_params=False, split=1)


@pytest.mark.parametrize("dtype, bf16, megatron, deepspeed", [
    # Megatron's docs/source/api-guide/dist_optimizer.md: bytes per parameter, non-distributed and
    # distributed optimizer: bf16 params with fp32 grads 18 / 6 + 12/d; fp16 20 / 4 + 16/d; fp32 16 / 8 + 8/d.
    (2, True, (4, 12), (2, 12)),
    (2, False, (2, 16), (2, 12)),
    (4, False, (4, 8), (4, 8)),
])
def test_state_bytes_per_parameter(dtype, bf16, megatron, deepspeed):
    assert state_bytes_per_param("megatron", dtype, bf16, zero_stage=1) == megatron
    assert state_bytes_per_param("deepspeed", dtype, bf16, zero_stage=0) == deepspeed
    grads, optimizer = megatron
    assert dtype + grads + optimizer == {(2, True): 18, (2, False): 20, (4, False): 16}[(dtype, bf16)]


@pytest.mark.parametrize("moments, fp8_current_scaling, optimizer", [
    # Transformer Engine's FusedAdam under --use-precision-aware-optimizer: the fp32 main weights as
    # 2 bytes of remainders beside the bf16 weights, and two moments of 4, 2 or 1 bytes; under FP8
    # current scaling Megatron-core keeps whole fp32 main weights itself.
    ("fp32", False, 10), ("bf16", False, 6), ("fp16", False, 6), ("fp8", False, 4), ("bf16", True, 8),
])
def test_precision_aware_optimizer_state_bytes(moments, fp8_current_scaling, optimizer):
    assert state_bytes_per_param("megatron", 2, True, 1, moments, fp8_current_scaling) == (4, optimizer)


def test_precision_aware_optimizer_shrinks_the_distributed_optimizer_shard_and_its_update():
    standard, local = _layer("megatron", zero=1)
    bf16, _ = _layer("megatron", zero=1, precision_aware_optimizer="bf16")
    assert bf16.optimizer_bytes == pytest.approx(6 * local / 8)  # 2 + 2 x 2 bytes, over dp 8
    assert (bf16.params_bytes, bf16.grads_bytes) == (standard.params_bytes, standard.grads_bytes)
    # Adam's traffic: 2 x 6 state bytes + the fp32 gradient + the weight read and written = 20 of 30.
    assert bf16.optimizer_seconds == pytest.approx(standard.optimizer_seconds * 20 / 30)


def _layer(engine: str, zero: int, dp: int = 8, precision_aware_optimizer: str | None = None):
    cluster = load_cluster("a100-80gb", nodes=1, gpus_per_node=8)
    model = load_model("llama3-8b")
    train = TrainSpec(global_batch=64, seq_len=2048, dtype="bf16")
    strategy = Strategy(dims=ParallelDims(dp=dp, tp=8 // dp), zero_stage=zero, micro_batch=1,
                        grad_accum=64 // dp, sequence_parallel=False, engine=engine,
                        precision_aware_optimizer=precision_aware_optimizer)
    block = layer_groups(model, train.seq_len, train.dtype_bytes, strategy.tp)[1]
    local = block.tp_params / strategy.tp + block.params - block.tp_params
    return CostModel(cluster, train, strategy, model.hidden_size).layer(block, PLAIN), local


def test_megatron_distributed_optimizer_holds_6_plus_12_over_d_bytes_per_parameter():
    cost, local = _layer("megatron", zero=1)
    assert cost.params_bytes == pytest.approx(2 * local)
    assert cost.grads_bytes == pytest.approx(4 * local)  # the fp32 main-gradient buffer
    assert cost.optimizer_bytes == pytest.approx(12 * local / 8)
    ds, _ = _layer("deepspeed", zero=1)
    assert ds.grads_bytes == pytest.approx(2 * local)  # DeepSpeed keeps bf16 gradients
    assert ds.optimizer_bytes == pytest.approx(cost.optimizer_bytes)


def test_megatron_reduces_gradients_in_fp32():
    megatron, _ = _layer("megatron", zero=0)
    deepspeed, _ = _layer("deepspeed", zero=0)
    assert megatron.grad_sync_bytes == pytest.approx(2 * deepspeed.grad_sync_bytes)


def test_gpt3_175b_megatron_plan_fits_with_fp32_main_gradients():
    """128 x 8 A100-80GB, global batch 1536, sequence 2048, --engine megatron: the written plan's
    peak, with Megatron's fp32 main gradients priced, is within the budget."""
    problem = make_problem("gpt3-175b", "a100-80gb", nodes=128, gpus_per_node=8, global_batch=1536,
                           seq_len=2048, engine="megatron")
    plan = find_plans(problem)[0]
    assert plan.engine == "megatron"
    assert plan.prediction.peak_memory_bytes <= plan.memory_budget_bytes
    params_per_stage = plan.model.num_parameters() / plan.pp / plan.tp
    busiest = max(plan.stages, key=lambda s: s.grads_bytes)
    assert busiest.grads_bytes >= 0.9 * 4 * params_per_stage  # 4 bytes per parameter, not 2
    assert plan.ranking is not None and plan.ranking.headroom_bytes >= 0


def test_each_engine_is_offered_only_what_it_runs():
    cluster = load_cluster("h100-80gb", nodes=2, gpus_per_node=8)
    model, train = load_model("llama3-8b"), TrainSpec(global_batch=64, seq_len=2048, dtype="bf16")
    space = strategies(model, cluster, train, Constraints())
    assert {s.engine for s in space} == {"deepspeed", "megatron"}
    assert all(s.tp == 1 for s in space if s.engine == "deepspeed")
    assert all(s.pp == 1 for s in space if s.zero_stage >= 2)
    assert any(s.tp > 1 for s in space if s.engine == "megatron")
    assert refusal("deepspeed", ParallelDims(dp=4, tp=2), 1) is not None
    assert refusal("megatron", ParallelDims(dp=2, pp=2), 3) is not None
    assert refusal("megatron", ParallelDims(dp=2, tp=2, pp=2), 1) is None


def test_a_pinned_engine_that_cannot_run_the_pins_is_one_sentence():
    cluster = load_cluster("h100-80gb", nodes=1, gpus_per_node=8)
    model, train = load_model("llama3-8b"), TrainSpec(global_batch=64, seq_len=2048, dtype="bf16")
    with pytest.raises(DsautoError, match="--engine deepspeed cannot run this plan: DeepSpeed plans have no tensor"):
        Planner(model, cluster, train, Constraints(tp=2, engine="deepspeed")).search()


def test_megatron_overlaps_the_reductions_it_is_told_to():
    """--overlap-grad-reduce and --overlap-param-gather: a Megatron plan exposes less than its
    gradient reduction and parameter gather take, but at least the last (first) bucket of each."""
    cluster = load_cluster("a100-80gb", nodes=4, gpus_per_node=8)
    model, train = load_model("llama2-7b"), TrainSpec(global_batch=256, seq_len=4096, dtype="bf16")
    strategy = Strategy(dims=ParallelDims(dp=32), zero_stage=1, micro_batch=1, grad_accum=8,
                        sequence_parallel=False, engine="megatron")
    options = [LayerOption(checkpoint=True, shard_params=False, split=1)] * (model.num_layers + 2)
    plan = Planner(model, cluster, train).build_plan(strategy, (model.num_layers,), options)
    cost = CostModel(cluster, train, strategy, model.hidden_size)
    costs = [cost.layer(g, options[0]) for g in layer_groups(model, train.seq_len, train.dtype_bytes, 1)
             for _ in range(g.count)]
    unhidden = cost.grad_sync_seconds(sum(c.grad_sync_bytes for c in costs)) + sum(c.step_seconds for c in costs)
    exposed = plan.prediction.exposed_comm_seconds
    assert 0 < exposed < unhidden


def _plan(step: float, peak: int, budget: int = 100):
    plan = find_plans(make_problem())[0]
    prediction = dataclasses.replace(plan.prediction, step_seconds=step, peak_memory_bytes=peak)
    return dataclasses.replace(plan, prediction=prediction, memory_budget_bytes=budget, ranking=None)


def test_near_ties_go_to_the_fastest_plan_with_safe_headroom():
    risky, safe, slow = _plan(1.00, 97), _plan(1.02, 60), _plan(1.10, 10)
    ranked = rank_by_headroom([risky, safe, slow])
    assert ranked[0].prediction.step_seconds == 1.02 and ranked[1:] == [risky, slow]
    r = ranked[0].ranking
    assert (r.tolerance, r.headroom_bytes, r.fastest_headroom_bytes, r.tied_plans) == (TIE_TOLERANCE, 40, 3, 2)
    assert r.safe_headroom_bytes == int(SAFE_HEADROOM * 100)
    # The fastest keeps its place when it already has the safe headroom, or when no tie is safer.
    assert rank_by_headroom([_plan(1.0, 50), _plan(1.01, 10)])[0].prediction.step_seconds == 1.0
    assert rank_by_headroom([_plan(1.0, 99), _plan(1.01, 95)])[0].prediction.peak_memory_bytes == 95
    assert rank_by_headroom([_plan(1.0, 99), _plan(1.05, 10)])[0].prediction.step_seconds == 1.0
    # A winner short of the safe headroom says so, with the under-prediction that would fill its budget.
    from dsauto.describe import describe_plan

    thin = rank_by_headroom([_plan(1.0, 99), _plan(1.01, 95)])[0]
    assert "memory headroom 5 B, less than the 10 B counted safe: no plan within 3% of the fastest keeps that " \
           "much, and a peak 5.3% above the prediction fills the budget" in describe_plan(thin)
    assert "(safe: 10 B)" in describe_plan(ranked[0])


def test_plan_yaml_records_the_ranking(tmp_path):
    from dsauto.plan_io import read_plan, write_plan_yaml

    plan = find_plans(make_problem())[0]
    assert plan.ranking is not None
    again = read_plan(write_plan_yaml(plan, tmp_path / "plan.yaml"))
    assert again == plan and "memory headroom" in (tmp_path / "plan.yaml").read_text()


def test_megatron_without_the_overlap_flags_exposes_the_whole_reduction_and_gather():
    """A plan pinned --no-overlap-grad-reduce prices what a Megatron-LM launch without
    --overlap-grad-reduce runs: the gradient reduction after the backward and the distributed
    optimizer's gather after the step, each whole; --no-overlap-param-gather the gather alone; the
    emitted flags, the plugin's DDP config and the plan's description say so."""
    from dsauto.describe import describe_plan
    from dsauto.emit.megatron import megatron_argv
    from dsauto.runtime.megatron import ddp_config

    cluster = load_cluster("a100-80gb", nodes=4, gpus_per_node=8)
    model, train = load_model("llama2-7b"), TrainSpec(global_batch=256, seq_len=4096, dtype="bf16")
    options = [LayerOption(checkpoint=True, shard_params=False, split=1)] * (model.num_layers + 2)
    base = Strategy(dims=ParallelDims(dp=32), zero_stage=1, micro_batch=1, grad_accum=8, sequence_parallel=False,
                    engine="megatron")
    cost = CostModel(cluster, train, base, model.hidden_size)
    costs = [cost.layer(g, options[0]) for g in layer_groups(model, train.seq_len, train.dtype_bytes, 1)
             for _ in range(g.count)]
    sync = cost.grad_sync_seconds(sum(c.grad_sync_bytes for c in costs))
    gather = sum(c.step_seconds for c in costs)
    planner = Planner(model, cluster, train)

    def plan(**overlaps):
        return planner.build_plan(dataclasses.replace(base, **overlaps), (model.num_layers,), options)

    overlapped, unoverlapped = plan(), plan(overlap_grad_reduce=False, overlap_param_gather=False)
    gathered_after = plan(overlap_param_gather=False)
    assert unoverlapped.prediction.exposed_comm_seconds == pytest.approx(sync + gather)
    assert overlapped.prediction.exposed_comm_seconds < gathered_after.prediction.exposed_comm_seconds < sync + gather
    assert unoverlapped.prediction.step_seconds - overlapped.prediction.step_seconds == pytest.approx(
        sync + gather - overlapped.prediction.exposed_comm_seconds)
    assert unoverlapped.prediction.peak_memory_bytes == overlapped.prediction.peak_memory_bytes  # the same buffers
    flags = megatron_argv(gathered_after)
    assert "--overlap-grad-reduce" in flags and "--overlap-param-gather" not in flags
    assert "--overlap-grad-reduce" not in megatron_argv(unoverlapped)
    config = ddp_config(unoverlapped)
    assert (config.overlap_grad_reduce, config.overlap_param_gather) == (False, False)
    assert "its gradient reduction and parameter gather not overlapped" in describe_plan(unoverlapped)
    assert "its parameter gather not overlapped" in describe_plan(gathered_after)


@pytest.mark.parametrize("pins, message", [
    (dict(engine="deepspeed", overlap_grad_reduce=False),
     "--no-overlap-grad-reduce cannot run: --overlap-grad-reduce and --overlap-param-gather are Megatron-core's"),
    (dict(engine="megatron", zero_stage=3, overlap_param_gather=False),
     "dsauto prices Megatron-FSDP .ZeRO 3 on Megatron-core. only with its gathers and reductions overlapped"),
])
def test_unoverlapped_data_parallelism_is_megatron_cores_own(pins, message):
    with pytest.raises(DsautoError, match=message):
        find_plans(make_problem("gpt2-xl", "a100-80gb", nodes=2, global_batch=64, seq_len=1024, **pins))
    # Left to the search, Megatron-FSDP is left out rather than priced overlapped.
    plans = find_plans(make_problem("gpt2-xl", "a100-80gb", nodes=2, global_batch=64, seq_len=1024,
                                    overlap_grad_reduce=False), top_k=50)
    assert plans and all(p.engine == "megatron" and p.zero_stage <= 1 and not p.overlap_grad_reduce
                         and not p.overlap_param_gather for p in plans)


def test_a_search_that_fits_nothing_quotes_how_far_the_nearest_plan_is_over():
    """A launch pinned whole that misses its budget by a little is told by how much, and where."""
    from dsauto.units import format_bytes

    pins = dict(tp=1, pp=1, zero_stage=1, micro_batch=1, checkpoint=False, engine="megatron", offload="none",
                recompute_modules="none")
    problem = make_problem("llama3-8b", "h100-80gb", global_batch=64, seq_len=4096, memory_limit="79GiB", **pins)
    peak = find_plans(problem)[0].prediction.peak_memory_bytes
    tight = f"{(peak - 2**26) / 2**20:.3f}MiB"  # 64 MiB short
    budget = make_problem("llama3-8b", "h100-80gb", global_batch=64, seq_len=4096, memory_limit=tight,
                          **pins).cluster.memory_budget_bytes
    with pytest.raises(DsautoError, match=rf"no plan priced stays within it at every moment of the step \((the plan nearest to fitting|the fastest plan "
                                          rf"within 5% more), "
                                          rf"tp=1 pp=1 dp=8 ZeRO 1 micro-batch 1, peaks at "
                                          rf"{re.escape(format_bytes(peak))}, {re.escape(format_bytes(peak - budget))} "
                                          rf"over\)"):
        find_plans(make_problem("llama3-8b", "h100-80gb", global_batch=64, seq_len=4096, memory_limit=tight, **pins))
    # Where the layer DP's plans went over at a moment it does not see (ZeRO-2's update), the least of them.
    kw = dict(global_batch=16, seq_len=256, zero_stage=2, engine="deepspeed", micro_batch=1, offload="none")
    peak = find_plans(make_problem("gpt2-xl", "a100-80gb", **kw))[0].prediction.peak_memory_bytes
    with pytest.raises(DsautoError, match=r"\(the plan nearest to fitting, tp=1 pp=1 dp=8 ZeRO 2 micro-batch 1, peaks "
                                          r"at [\d.]+ GiB, [\d.]+ MiB over\)"):
        find_plans(make_problem("gpt2-xl", "a100-80gb", memory_limit=f"{peak * 0.9 / 2**20:.3f}MiB", **kw))


def test_zero_1_and_2_reduce_as_each_engine_does():
    """DeepSpeed's ZeRO 1-2 all-reduce each gradient bucket whole (use_multi_rank_bucket_allreduce, which
    its plans write: stage_1_and_2.py average_tensor); Megatron-core's distributed optimizer
    reduce-scatters. The written config says so, its all-gather bucket a multiple of DeepSpeed's
    alignment."""
    from dsauto.emit.ds_config import ds_config

    cluster = load_cluster("a100-80gb", nodes=4, gpus_per_node=8)
    train = TrainSpec(global_batch=256, seq_len=4096, dtype="bf16")
    for engine, reduce in (("deepspeed", "all_reduce"), ("megatron", "reduce_scatter")):
        strategy = Strategy(dims=ParallelDims(dp=32), zero_stage=1, micro_batch=1, grad_accum=8,
                            sequence_parallel=False, engine=engine)
        cost = CostModel(cluster, train, strategy, 4096)
        assert cost.grad_sync_seconds(1e9) == pytest.approx(getattr(cost.context.dp_group, reduce)(1e9))
    plan = find_plans(make_problem("gpt2-xl", "a100-80gb", nodes=2, global_batch=64, seq_len=1024, zero_stage=2,
                                   engine="deepspeed"))[0]
    zero = ds_config(plan)["zero_optimization"]
    assert zero["use_multi_rank_bucket_allreduce"] is True and zero["allgather_bucket_size"] % 2 == 0


@pytest.mark.parametrize("pins, message", [
    (dict(cp=2, hpz=8), r"--hpz 8 cannot run: hpZ's groups are consecutive ranks, which are all data-parallel only "
                        r"when tp, pp and cp are 1; leave it out, or plan with tp, pp and cp 1\."),
    (dict(hpz=3), r"--hpz 3 cannot run: hpz 3 must divide the 8 devices of a node and dp 16; pin one that divides "
                  r"both, or leave it out\."),
])
def test_hierarchical_partitioning_refusals_name_their_remedy(pins, message):
    with pytest.raises(DsautoError, match=message):
        find_plans(make_problem("llama3-8b", "h100-80gb", nodes=2, seq_len=8192, global_batch=16, engine="deepspeed",
                                zero_stage=3, **pins))


def test_deepspeed_ulysses_reduces_gradients_in_fp32():
    """DeepSpeed-Ulysses (cp > 1 under DeepSpeed) reduces the gradients in fp32 whatever the training
    dtype (seq_parallel_communication_data_type's default; ZeRO 1-2 force it): twice a bf16 plan's
    bytes; Megatron-core's context parallelism keeps its own gradients' dtype."""
    cluster = load_cluster("h100-80gb", nodes=2, gpus_per_node=8)
    model, train = load_model("llama3-8b"), TrainSpec(global_batch=16, seq_len=8192, dtype="bf16")
    group = layer_groups(model, train.seq_len, train.dtype_bytes, 1)[1]
    option = LayerOption(checkpoint=True, shard_params=False, split=1)

    def synced(engine: str, cp: int) -> float:
        strategy = Strategy(dims=ParallelDims(dp=16 // cp, cp=cp), zero_stage=0, micro_batch=1, grad_accum=1,
                            sequence_parallel=False, engine=engine)
        return CostModel(cluster, train, strategy, model.hidden_size).layer(group, option).grad_sync_bytes

    assert synced("deepspeed", 2) == pytest.approx(2 * synced("deepspeed", 1))
    assert synced("megatron", 2) == pytest.approx(synced("megatron", 1))
