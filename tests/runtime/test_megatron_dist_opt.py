"""Megatron-core's partial distributed optimizer through the dsauto plugin, on four CPU processes
with gloo: dp 4 on two nodes of two ranks, one instance per node against one instance of all four.
The instances shard the optimizer state over their own two ranks (twice the bytes per rank, as the
plan predicts), reduce-scatter gradients inside and all-reduce them across, and train the same
losses within fp32 summation noise."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.plan import Plan
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_cluster
from dsauto.spec.training import TrainSpec
from megatron_launch import GLOBAL_MICRO_BATCHES, MICRO_BATCH, SEQ_LEN, TINY, launch

WORKER = Path(__file__).resolve().parent / "megatron_dist_opt_worker.py"


def dist_opt_plan(instances: int) -> Plan:
    """dp 4 over 2 nodes x 2 ranks, ZeRO-1 (the distributed optimizer) in ``instances`` instances."""
    cluster = load_cluster("cpu", nodes=2, gpus_per_node=2)
    train = TrainSpec(global_batch=MICRO_BATCH * GLOBAL_MICRO_BATCHES, seq_len=SEQ_LEN, dtype="fp32",
                      flash_attention=False)
    strategy = Strategy(dims=ParallelDims(dp=4), zero_stage=1, micro_batch=MICRO_BATCH,
                        grad_accum=GLOBAL_MICRO_BATCHES // 4, sequence_parallel=False, engine="megatron",
                        dist_opt_instances=instances)
    options = [LayerOption(checkpoint=False, shard_params=False, split=1)] * (TINY.num_layers + 2)
    return Planner(TINY, cluster, train).build_plan(strategy, (TINY.num_layers,), options)


def test_the_plugin_configures_the_instances():
    import dsauto.megatron as dm

    plan = dist_opt_plan(2)
    config = dm.ddp_config(plan)
    assert config.use_distributed_optimizer and config.num_distributed_optimizer_instances == 2
    assert dm.ddp_config(dist_opt_plan(1)).num_distributed_optimizer_instances == 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    runs = {f"instances{n}": {"plan": dist_opt_plan(n)} for n in (1, 2)}
    return launch(4, runs, tmp_path_factory.mktemp("dist_opt"), steps=3, worker=WORKER), runs


def test_instances_form_one_group_per_node_and_one_across(trained):
    results, _ = trained
    ranks = results["instances2"]["ranks"]
    assert [r["instance_ranks"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["across_ranks"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert {r["ddp_instances"] for r in ranks} == {2}
    assert [r["instance_ranks"] for r in results["instances1"]["ranks"]] == [[0, 1, 2, 3]] * 4


def test_each_rank_holds_the_optimizer_state_of_its_instance_shard(trained):
    results, runs = trained
    for name, run in runs.items():
        predicted = run["plan"].stages[0].optimizer_bytes
        for rank in results[name]["ranks"]:
            # fp32 Adam: two moments of 4 bytes for each parameter of the rank's shard (Megatron pads
            # each bucket and aligns each parameter, a few hundred elements here).
            shard = 4 // run["plan"].dist_opt_instances
            assert rank["optimizer_state_bytes"] == pytest.approx(8 * rank["params"] / shard, rel=0.01)
            assert rank["optimizer_state_bytes"] == pytest.approx(predicted, rel=0.02)
    one = results["instances1"]["ranks"][0]["optimizer_state_bytes"]
    assert results["instances2"]["ranks"][0]["optimizer_state_bytes"] == pytest.approx(2 * one, rel=0.01)


def test_instances_train_the_losses_of_one_instance(trained):
    results, _ = trained
    one, two = results["instances1"]["losses"], results["instances2"]["losses"]
    assert len(one) == 3 and one[-1] < one[0]  # it trains
    assert two == pytest.approx(one, rel=1e-5)  # the same sums, added in another order
