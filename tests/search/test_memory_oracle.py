"""One memory model for the search and the prediction, checked against brute force.

For small models every plan of the space the search defines is priced with ``predict_step`` (the
prediction the emitted plan carries, every moment of the step included: forward, backward and
the optimizer update). For many budgets: whenever some plan fits, the search finds one that fits,
and its predicted peak is the prediction of its own choices; when none fits, it says so. At the
peaks where the fastest fitting plan changes, the search's plan is as fast.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsauto.cost.step import predict_step
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints, offloaded_variants, strategies
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec
from oracle_helpers import assignments, check_search_at, check_search_at_frontier

MODELS = {
    "narrow": ModelSpec(name="narrow", architecture="decoder", num_layers=2, hidden_size=64,
                        num_attention_heads=2, ffn_hidden_size=256, vocab_size=2048,
                        max_position_embeddings=64, dropout=False),
    "wide-vocab": ModelSpec(name="wide-vocab", architecture="decoder", num_layers=2, hidden_size=128,
                            num_attention_heads=4, ffn_hidden_size=256, vocab_size=8192,
                            max_position_embeddings=64, dropout=False),
}
TRAIN = TrainSpec(global_batch=4, seq_len=64, dtype="fp32")


def cluster(budget_bytes: int | None = None):
    limit = f"{budget_bytes}B" if budget_bytes is not None else None
    return load_cluster("cpu", nodes=1, gpus_per_node=2, memory_limit=limit)


def all_strategies(model, c):
    return [variant for strategy in strategies(model, c, TRAIN, Constraints())
            for variant in (strategy, *offloaded_variants(strategy, c, Constraints()))]


@lru_cache(maxsize=None)
def brute_force(name: str) -> tuple[tuple[float, int], ...]:
    """(step seconds, peak bytes) of every plan in the space, for any budget."""
    model = MODELS[name]
    c = cluster()
    out = []
    # The search's space: every strategy, and each offloaded (which the planner tries for the ones
    # that fit nowhere without it).
    for strategy in all_strategies(model, c):
        for stage_layers, options in assignments(strategy, model, Constraints()):
            prediction = predict_step(model, c, TRAIN, strategy, stage_layers, options).prediction
            out.append((prediction.step_seconds, prediction.peak_memory_bytes))
    return tuple(out)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_space_spans_fitting_and_not_fitting_budgets(name):
    peaks = [peak for _, peak in brute_force(name)]
    assert len(peaks) > 500 and min(peaks) < max(peaks)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(MODELS)), position=st.floats(0.0, 1.0))
def test_the_search_finds_a_fitting_plan_whenever_one_exists(name, position):
    model = MODELS[name]
    check_search_at(model, Constraints(), TRAIN, cluster, brute_force(name), position,
                    lambda c: all_strategies(model, c))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_search_keeps_up_with_brute_force_where_the_fastest_plan_changes(name):
    """Budgets exactly at the peaks where the fastest fitting plan changes: the search finds a plan
    as fast there (as test_dimension_oracle.py does for the newer dimensions)."""
    check_search_at_frontier(MODELS[name], Constraints(), TRAIN, cluster, brute_force(name), name)


def test_zero3_with_layers_resident_fits_where_all_resident_does_not():
    """A strategy whose fastest layer choices overflow the optimizer update keeps the choices that
    fit it (the issue's 17M-parameter GPT, 2 ranks, ZeRO-3, micro-batch 1; with the fused AdamW
    update every layer resident needs 277.8 MiB)."""
    model = ModelSpec(name="bench-wide", architecture="decoder", num_layers=4, hidden_size=512,
                      num_attention_heads=8, ffn_hidden_size=2048, vocab_size=8192,
                      max_position_embeddings=128, dropout=False)
    train = TrainSpec(global_batch=16, seq_len=128, dtype="fp32")
    pins = Constraints(tp=1, pp=1, zero_stage=3, micro_batch=1, engine="deepspeed")
    for mib in (216, 256, 276, 300):
        c = load_cluster("cpu", nodes=1, gpus_per_node=2, memory_limit=f"{mib}MiB")
        plan = Planner(model, c, train, pins).search()[0]
        assert plan.prediction.peak_memory_bytes <= c.memory_budget_bytes
    plan = Planner(model, load_cluster("cpu", nodes=1, gpus_per_node=2, memory_limit="256MiB"), train,
                   pins).search()[0]
    assert any(run.shard_params for run in plan.layers) and not all(run.shard_params for run in plan.layers)
