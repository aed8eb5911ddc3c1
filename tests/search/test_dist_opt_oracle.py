"""The search against brute force, and its bounds, with Megatron-core's partial distributed optimizer
(``Strategy.dist_opt_instances``), as test_dimension_oracle.py checks the other newer dimensions
(its helpers are reused here): on a small two-node instance every plan of the space is priced with
``predict_step``, and for budgets around the peaks it can reach the search finds a plan that fits
whenever one exists, with the prediction of its own choices, no slower than the fastest fitting plan
beyond the DP's memory rounding; on a full-size model the lower bound that orders the strategies
never exceeds the plan it bounds, and branch and bound finds the best of solving every strategy."""

from __future__ import annotations

from functools import lru_cache

import pytest

from dsauto.cost.step import predict_step
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints, strategies
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.loaders import load_cluster, load_hardware, load_model
from dsauto.spec.training import TrainSpec
from oracle_helpers import check_search_at, strategy_key
from test_dimension_oracle import NARROW, PLAIN, TRAIN, _assignments

# dp 4 over two nodes of two ranks: one instance of all four, or one per node.
PINS = Constraints(engine="megatron", zero_stage=1, tp=1, pp=1, micro_batch=1, **PLAIN)


def cluster(budget_bytes: int | None = None):
    limit = f"{budget_bytes}B" if budget_bytes is not None else None
    return load_cluster("cpu", nodes=2, gpus_per_node=2, memory_limit=limit)


def _key(strategy) -> tuple:
    return strategy_key(strategy)


@lru_cache(maxsize=None)
def brute_force() -> tuple[tuple[tuple, float, int], ...]:
    """(strategy key, step seconds, peak bytes) of every plan in the space, for any budget."""
    c = cluster()
    out = []
    for strategy in strategies(NARROW, c, TRAIN, PINS):
        for stage_layers, options in _assignments(strategy, NARROW, PINS):
            prediction = predict_step(NARROW, c, TRAIN, strategy, stage_layers, options).prediction
            out.append((_key(strategy), prediction.step_seconds, prediction.peak_memory_bytes))
    return tuple(out)


def test_the_space_holds_both_instance_counts_and_spans_budgets():
    plans = brute_force()
    assert {key[-1] for key, _, _ in plans} == {1, 2}
    peaks = [peak for _, _, peak in plans]
    assert min(peaks) < max(peaks)


@pytest.mark.parametrize("position", [i / 15 for i in range(16)])
def test_the_search_finds_a_fitting_plan_whenever_one_exists(position):
    # Its prediction is that of its own choices (the instance count included).
    check_search_at(NARROW, PINS, TRAIN, cluster, [(step, peak) for _, step, peak in brute_force()], position,
                    lambda c: strategies(NARROW, c, TRAIN, PINS))


FULL_PINS = Constraints(engine="megatron", zero_stage=1, pp=1, micro_batch=1, **PLAIN)


def _full_planner():
    cluster_ = ClusterSpec(load_hardware("a100-80gb"), nodes=2, gpus_per_node=8, memory_limit_bytes=40 * 2**30)
    return Planner(load_model("llama2-7b"), cluster_, TrainSpec(global_batch=32, seq_len=2048), FULL_PINS)


def test_lower_bound_never_exceeds_the_plan_it_bounds():
    planner = _full_planner()
    checked = set()
    for strategy in strategies(planner.model, planner.cluster, planner.train, FULL_PINS):
        priced = planner._price(strategy)
        solved = planner._solve(priced)
        if solved is None:
            continue
        plan = planner.build_plan(solved.strategy, solved.stage_layers, solved.options)
        assert priced.lower_bound(planner.model.num_layers) <= plan.prediction.step_seconds * (1 + 1e-12), \
            strategy.describe()
        checked.add(strategy.dist_opt_instances)
    assert checked == {1, 2}


def test_branch_and_bound_finds_the_same_best_as_solving_everything():
    planner = _full_planner()
    space = strategies(planner.model, planner.cluster, planner.train, FULL_PINS)
    assert {s.dist_opt_instances for s in space} == {1, 2}  # the dimension is searched
    solved = [planner._solve(planner._price(s)) for s in space]
    fitting = [plan.prediction.step_seconds for plan in
               (planner.build_plan(s.strategy, s.stage_layers, s.options) for s in solved if s)
               if plan.prediction.peak_memory_bytes <= planner.cluster.memory_budget_bytes]
    assert planner.search()[0].prediction.step_seconds <= min(fitting) * (1 + 1e-12)
