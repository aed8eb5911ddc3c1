"""A Megatron-core mixture of experts trained on 2 CPU ranks through the dsauto plugin: expert
parallelism 2 gives the losses of expert parallelism 1 within fp32 summation noise (each rank holds
half the experts, the tokens travel to them and back, the expert gradients reduce over the expert
data-parallel group instead of dp)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_launch import TINY, launch

import dsauto

MOE = dataclasses.replace(TINY, name="moe-test", num_experts=4, moe_top_k=2, moe_ffn_hidden_size=128,
                          linear_bias=False)
"""The test GPT with 4 experts of half its MLP width, top-2, in every layer; no biases (Megatron's
experts add theirs in place on a view at ep 1, which autograd refuses)."""

WORKER = Path(__file__).resolve().parent / "megatron_moe_worker.py"
CAPACITY = dict(expert_capacity_factor=1.0, expert_pad_to_capacity=True)


def moe_plan(ep: int, recompute_modules: str = "none", **capacity):
    plan = dsauto.make_plan(MOE, "cpu", nodes=1, gpus_per_node=2, engine="megatron", tp=1, pp=1, zero_stage=1,
                            ep=ep, global_batch=4, seq_len=32, recompute_modules=recompute_modules, **capacity)
    assert (plan.ep, plan.dp) == (ep, 2)
    return plan


@pytest.mark.slow
def test_expert_parallelism_trains_like_one_expert_rank(tmp_path):
    """With the plan's alltoall dispatcher, as with Megatron-core's allgather one. And a plan
    recomputing each MoE layer's MLP ('moe': Megatron-core's MoELayer runs its forward
    under tensor_parallel.checkpoint) trains the same network to the same losses."""
    results = launch(2, {"ep1": {"plan": moe_plan(1)}, "ep2": {"plan": moe_plan(2)},
                         "ep2-moe": {"plan": moe_plan(2, "moe")},
                         "ep2-allgather": {"plan": moe_plan(2), "dispatcher": "allgather"},
                         "ep1-capacity": {"plan": moe_plan(1, **CAPACITY)},
                         "ep2-capacity": {"plan": moe_plan(2, **CAPACITY)}},
                     tmp_path, steps=4, lr=1e-2, worker=WORKER)
    assert (results["ep1"]["experts_per_rank"], results["ep2"]["experts_per_rank"]) == (4, 2)
    # The plan's dispatcher, alltoall, runs on CPU ranks (dsauto.compat.megatron_cpu) and moves the
    # same tokens as Megatron-core's allgather dispatcher.
    assert results["ep2"]["dispatcher"] == "MoEAlltoAllTokenDispatcher"
    assert results["ep2-allgather"]["dispatcher"] == "MoEAllGatherTokenDispatcher"
    assert results["ep2-allgather"]["losses"] == pytest.approx(results["ep2"]["losses"], rel=1e-5)
    one, two = results["ep1"]["losses"], results["ep2"]["losses"]
    assert one[-1] < one[0]  # it trains
    assert two == pytest.approx(one, rel=1e-5), (one, two)
    assert [results[run]["moe_layer_recompute"] for run in ("ep2", "ep2-moe")] == [False, True]
    assert results["ep2-moe"]["losses"] == pytest.approx(two, rel=1e-5)
    # Token dropping as the plan prices it: the plugin sets Megatron-core's capacity and padding; each
    # rank's router drops and pads its own tokens, so expert parallelism trains as one expert rank, and
    # the padded experts train another network than the dropless ones.
    capacity = results["ep2-capacity"]
    assert capacity["capacity"] == [1.0, True] and results["ep2"]["capacity"] == [None, False]
    assert capacity["losses"] == pytest.approx(results["ep1-capacity"]["losses"], rel=1e-5)
    assert capacity["losses"][-1] < capacity["losses"][0] and capacity["losses"][1:] != pytest.approx(two[1:], rel=1e-4)
