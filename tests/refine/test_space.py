"""The refiner's space: the search's plans and the knobs around them, each a complete priced plan."""

from __future__ import annotations

import pytest

from dsauto.refine.space import (
    Knobs,
    base_plans,
    candidates,
    options_of,
    plan_label,
    strategy_of,
)
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec


def planner(memory_limit: str | None = None, **pins) -> Planner:
    return Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2, memory_limit=memory_limit),
                   TrainSpec(16, 256, "fp32"), Constraints(**pins))


def test_base_plans_start_with_the_search_winner_and_add_micro_batch_neighbours():
    p = planner(engine="deepspeed")  # trials measure through the DeepSpeed hook (an open engine is DeepSpeed)
    plans = base_plans(p, top_k=3)
    best = p.search(top_k=1)[0]
    labels = [plan_label(x) for x in plans]
    assert plan_label(best) in labels
    assert len(set(labels)) == len(labels)
    assert [x.prediction.step_seconds for x in plans] == sorted(x.prediction.step_seconds for x in plans)
    micro_batches = {x.micro_batch for x in plans if x.zero_stage == best.zero_stage}
    assert {best.micro_batch // 2, best.micro_batch * 2} & micro_batches


def test_knobs_apply_where_the_engine_has_them_and_change_exactly_one_thing():
    p = planner(zero_stage=3)
    plans = base_plans(p, top_k=2)
    space = candidates(p, plans)
    assert space and all(c.plan.zero_stage == 3 for c in space)
    assert all(c.knobs.bucket_scale is not None for c in space)  # ZeRO-3 over dp 2 has buckets
    base = {c.knobs.plan: c for c in space if c.knobs.is_base()}
    assert set(base) == {plan_label(x) for x in plans}
    for c in space:
        origin = base[c.knobs.plan].plan
        assert len(c.plan.checkpointed_layers()) == len(origin.checkpointed_layers()) + c.knobs.checkpoint_delta
        assert c.plan.reduce_bucket_bytes == round(origin.reduce_bucket_bytes * c.knobs.bucket_scale)
        if c.knobs.prefetch_scale is not None:
            assert c.plan.prefetch_bucket_bytes == round(origin.prefetch_bucket_bytes * c.knobs.prefetch_scale)
        # priced again: more buffer means more predicted memory, never less
        if c.knobs.checkpoint_delta == 0 and (c.knobs.bucket_scale or 1) >= 1 and (c.knobs.prefetch_scale or 1) >= 1:
            assert c.plan.prediction.peak_memory_bytes >= origin.prediction.peak_memory_bytes
    assert strategy_of(space[0].plan) == space[0].strategy
    assert options_of(space[0].plan) == space[0].options


def test_zero0_has_no_bucket_knob_and_the_memory_filter_drops_what_cannot_fit():
    p = planner(zero_stage=0)
    space = candidates(p, base_plans(p, top_k=2))
    assert all(c.knobs.bucket_scale is None and c.knobs.prefetch_scale is None for c in space)
    tight = candidates(p, base_plans(p, top_k=2), memory_slack=0.0)
    assert all(c.plan.prediction.peak_memory_bytes <= p.cluster.memory_budget_bytes for c in tight)


@pytest.mark.parametrize("knobs", [Knobs("z1-mb2x4-ckpt0/4", 1, 0.5, None), Knobs("z3-mb1x8-ckpt4/4", -1, 2.0, 1.0),
                                   Knobs("z0-mb8x1-ckpt0/4")])
def test_knobs_round_trip_through_trial_parameters(knobs):
    assert Knobs.from_params(knobs.params()) == knobs
    assert "bucket_scale" not in Knobs("x").params()
