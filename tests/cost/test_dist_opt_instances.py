"""Megatron-core's partial distributed optimizer (``num_distributed_optimizer_instances``): its terms
against hand-computed values, its rules, where the search tries it, its pin, its flag and the plan's
round trip. Its training on CPU ranks is tests/runtime/test_megatron_dist_opt.py; its search against
brute force, tests/search/test_dist_opt_oracle.py."""

from __future__ import annotations

import dataclasses

import pytest

from dsauto.api import make_plan, make_problem
from dsauto.cost.collectives import Group
from dsauto.cost.layer import CostModel
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import partial_dist_opt_sync_seconds
from dsauto.describe import describe_plan
from dsauto.emit.megatron import megatron_args
from dsauto.engines.rules import dist_opt_instances_refusal
from dsauto.errors import DsautoError
from dsauto.parallel import ParallelDims
from dsauto.plan_io import read_plan, write_plan_yaml
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints, dist_opt_instance_counts
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.model import layer_groups
from dsauto.spec.training import TrainSpec

KEEP = LayerOption(checkpoint=False, shard_params=False, split=1)
TRAIN = TrainSpec(global_batch=64, seq_len=2048, dtype="bf16")


def _strategy(dp: int, instances: int, tp: int = 1, zero_stage: int = 1) -> Strategy:
    return Strategy(dims=ParallelDims(dp=dp, tp=tp), zero_stage=zero_stage, micro_batch=1, grad_accum=64 // dp,
                    sequence_parallel=tp > 1, engine="megatron", dist_opt_instances=instances)


def test_the_gradient_sync_reduce_scatters_inside_and_all_reduces_across_instances_by_hand():
    # 8 GB of gradients; an instance of 8 ranks at 100 GB/s, 10 us a step; 4 instances at 25 GB/s, 20 us.
    reduce_scatter = 7 / 8 * 8e9 / 100e9 + 7 * 10e-6  # 70.07 ms
    all_reduce = 2 * 3 / 4 * (8e9 / 8) / 25e9 + 2 * 3 * 20e-6  # this rank's eighth: 60.12 ms
    seconds = partial_dist_opt_sync_seconds(8e9, Group(8, 100e9, 10e-6), Group(4, 25e9, 20e-6))
    assert seconds == pytest.approx(reduce_scatter + all_reduce) == pytest.approx(0.13019)


def test_instances_shard_the_optimizer_over_their_own_ranks_and_keep_the_intra_node_links():
    # llama2-7b on 4 nodes of 8 A100s, dp 32: 4 instances of 8 ranks, one per node.
    cluster = load_cluster("a100-80gb", nodes=4, gpus_per_node=8)
    model = load_model("llama2-7b")
    block = next(g for g in layer_groups(model, TRAIN.seq_len, TRAIN.dtype_bytes, 1) if g.kind == "transformer")
    flat, partial = (CostModel(cluster, TRAIN, _strategy(32, n), model.hidden_size) for n in (1, 4))
    one, four = flat.layer(block, KEEP), partial.layer(block, KEEP)
    # Megatron bf16: 12 bytes of optimizer state per parameter over 32, then over 8 ranks; the fp32
    # gradient buffer (4 bytes) and the bf16 parameters (2 bytes) are whole either way.
    assert one.optimizer_bytes == pytest.approx(block.params * 12 / 32)
    assert four.optimizer_bytes == pytest.approx(block.params * 12 / 8)
    assert (four.params_bytes, four.grads_bytes) == (one.params_bytes, one.grads_bytes) == (
        pytest.approx(block.params * 2), pytest.approx(block.params * 4))
    # Each rank updates its shard: four times the parameters of one instance over all 32.
    assert four.optimizer_seconds == pytest.approx(4 * one.optimizer_seconds)
    # The instance is the 8 ranks of a node (NVLink: 300 GB/s x 0.8), the shard's all-reduce crosses
    # the 4 nodes through one NIC a rank (25 GB/s x 0.8).
    instance, across = partial.context.dist_opt_group, partial.context.dist_opt_inter_group
    assert (instance.size, instance.bandwidth_bytes_per_second) == (8, pytest.approx(240e9))
    assert (across.size, across.bandwidth_bytes_per_second) == (4, pytest.approx(20e9))
    assert flat.context.dist_opt_group is None
    grads = block.params * 4
    assert partial.grad_sync_seconds(grads) == pytest.approx(
        7 / 8 * grads / 240e9 + 7 * instance.latency_seconds + 1.5 * grads / 8 / 20e9 + 6 * across.latency_seconds)
    # The updated parameters are gathered inside the instance only.
    assert four.step_seconds == pytest.approx(instance.all_gather(block.params * 2))
    assert one.step_seconds == pytest.approx(flat.context.dp_group.all_gather(block.params * 2))
    assert four.step_seconds < one.step_seconds


def test_rules():
    dims = ParallelDims(dp=16)
    assert dist_opt_instances_refusal("megatron", dims, 1, 1) is None
    assert dist_opt_instances_refusal("megatron", dims, 1, 2) is None
    assert "Megatron-core's distributed optimizer" in dist_opt_instances_refusal("deepspeed", dims, 1, 2)
    assert "hybrid sharding is not planned" in dist_opt_instances_refusal("megatron", dims, 3, 2)
    assert "16 data-parallel ranks" in dist_opt_instances_refusal("megatron", dims, 1, 3)
    assert "at least 2 ranks" in dist_opt_instances_refusal("megatron", dims, 1, 16)
    # context parallelism's ranks join the data-parallel ones; experts need their dp divisible too
    assert dist_opt_instances_refusal("megatron", ParallelDims(dp=2, cp=2), 1, 2) is None
    assert "expert data-parallel degree 2" in dist_opt_instances_refusal("megatron", ParallelDims(dp=8, ep=4), 1, 4)


@pytest.mark.parametrize("nodes, tp, zero, engine, expected", [
    (4, 1, 1, "megatron", (1, 4)),  # dp 32 over 4 nodes: an instance per node
    (4, 2, 1, "megatron", (1, 4)),  # dp 16 of stride 2: 4 replicas fill a node
    (4, 8, 1, "megatron", (1,)),  # tp fills the node: an instance of one rank shards nothing
    (1, 1, 1, "megatron", (1,)),  # one node: the distributed optimizer's traffic is on it already
    (4, 1, 0, "megatron", (1,)),
    (4, 1, 1, "deepspeed", (1,)),
])
def test_the_search_tries_an_instance_per_node_when_the_distributed_optimizer_spans_nodes(nodes, tp, zero, engine,
                                                                                      expected):
    cluster = load_cluster("a100-80gb", nodes=nodes, gpus_per_node=8)
    strategy = dataclasses.replace(_strategy(8 * nodes // tp, 1, tp=tp, zero_stage=zero), engine=engine)
    assert dist_opt_instance_counts(strategy, cluster, Constraints()) == expected
    assert dist_opt_instance_counts(strategy, cluster, Constraints(dist_opt_instances=1)) == (1,)


def test_a_pinned_count_is_planned_emitted_printed_and_read_back(tmp_path):
    plan = make_plan("llama2-7b", "a100-80gb", nodes=2, gpus_per_node=8, global_batch=64, seq_len=2048,
                     engine="megatron", tp=1, pp=1, dist_opt_instances=2)
    assert (plan.dist_opt_instances, plan.dp, plan.zero_stage) == (2, 16, 1)
    args = megatron_args(plan)
    assert "--num-distributed-optimizer-instances 2" in args and "--use-distributed-optimizer" in args
    assert "distributed optimizer in 2 instances of 8 ranks" in describe_plan(plan)
    assert read_plan(write_plan_yaml(plan, tmp_path / "plan.yaml")) == plan
    flat = make_plan("llama2-7b", "a100-80gb", nodes=2, gpus_per_node=8, global_batch=64, seq_len=2048,
                     engine="megatron", tp=1, pp=1, zero_stage=1, micro_batch=plan.micro_batch,
                     dist_opt_instances=1)
    assert not any("instances" in line for line in megatron_args(flat))
    # twice the optimizer state per rank: sharded over 8 ranks instead of 16
    assert plan.stages[0].optimizer_bytes == pytest.approx(2 * flat.stages[0].optimizer_bytes, rel=1e-6)


@pytest.mark.parametrize("pins, words", [
    (dict(dist_opt_instances=3), "must split the 16 data-parallel ranks"),
    (dict(dist_opt_instances=2, engine="deepspeed"), "--engine megatron --zero-stage 1"),
    (dict(dist_opt_instances=2, zero_stage=3, engine="megatron"), "hybrid sharding is not planned"),
])
def test_a_pin_that_cannot_run_is_refused_in_one_sentence(pins, words):
    with pytest.raises(DsautoError, match="--dist-opt-instances") as error:
        make_plan("llama2-7b", "a100-80gb", nodes=2, gpus_per_node=8, global_batch=64, seq_len=2048, tp=1, pp=1,
                  **pins)
    assert words in str(error.value)


def test_plans_refuse_instances_the_engine_cannot_run():
    plan = make_plan("gpt2-xl", "a100-80gb", nodes=2, gpus_per_node=8, global_batch=64, seq_len=1024,
                     engine="megatron", tp=1, pp=1, dist_opt_instances=2)
    for bad in (dict(dist_opt_instances=16), dict(dist_opt_instances=3), dict(engine="deepspeed")):
        with pytest.raises(ValueError, match="dist_opt_instances"):
            dataclasses.replace(plan, **bad)


def test_the_search_prices_both_and_keeps_the_faster_that_fits():
    problem = make_problem("gpt2-xl", "a100-80gb", nodes=2, gpus_per_node=8, global_batch=64, seq_len=1024,
                           engine="megatron", tp=1, pp=1, zero_stage=1, micro_batch=4)
    planner = Planner(problem.model, problem.cluster, problem.train, problem.pins)
    plans = planner.search(top_k=2)
    assert {p.dist_opt_instances for p in plans} == {1, 2}
    assert plans[0].prediction.step_seconds <= plans[1].prediction.step_seconds * 1.03  # near-ties ranked
