"""The search against brute force, and its bounds, on the newer dimensions: the interleaved pipeline
(virtual stages), context parallelism (Megatron-core's ring attention and DeepSpeed-Ulysses) and
expert parallelism.

As in test_memory_oracle.py: on small instances every plan of the space the search defines (for
pinned choices that select the dimension) is priced with ``predict_step``; for budgets around the
peaks it can reach, the search finds a plan that fits whenever one exists, its predicted peak and
time are those of its own choices, and it is no slower than the fastest fitting plan beyond the
DP's memory rounding, also exactly at the peaks where the fastest fitting plan changes. And on
full-size models the lower bound that orders the strategies never exceeds the plan solving the
strategy yields, so branch and bound stays exact with these dimensions.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsauto.cost.step import predict_step
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints, strategies
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.loaders import load_cluster, load_hardware, load_model
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec
from oracle_helpers import assignments, check_search_at, check_search_at_frontier, strategy_key

NARROW = ModelSpec(name="narrow", architecture="decoder", num_layers=2, hidden_size=64, num_attention_heads=2,
                   ffn_hidden_size=256, vocab_size=2048, max_position_embeddings=64, dropout=False)
DEEP = dataclasses.replace(NARROW, name="deep", num_layers=4)  # two layers per stage: two chunks each
MOE = dataclasses.replace(NARROW, name="moe", num_experts=4, moe_top_k=2, moe_ffn_hidden_size=128)
ROTARY = dataclasses.replace(NARROW, name="rotary", position_embedding="rope")  # Ulysses' (no learned positions)
TRAIN = TrainSpec(global_batch=4, seq_len=64, dtype="fp32")
PLAIN = {"offload": "none", "recompute_modules": "none"}  # dimensions the cases below leave out

CASES = {
    # pp 2 with 1 and 2 chunks per rank (4 micro-batches of 1, a multiple of pp).
    "interleaved": (DEEP, Constraints(pp=2, engine="megatron", micro_batch=1, **PLAIN)),
    # cp 2: ring attention (Megatron-core) and Ulysses (DeepSpeed), ZeRO over the cp ranks.
    "ring": (NARROW, Constraints(cp=2, engine="megatron", micro_batch=2, **PLAIN)),
    "ulysses": (ROTARY, Constraints(cp=2, engine="deepspeed", micro_batch=2, **PLAIN)),
    # ep 1 and 2 over dp 2 for 4 experts.
    "experts": (MOE, Constraints(engine="megatron", micro_batch=2, pp=1, **PLAIN)),
}


def cluster(budget_bytes: int | None = None):
    limit = f"{budget_bytes}B" if budget_bytes is not None else None
    return load_cluster("cpu", nodes=1, gpus_per_node=2, memory_limit=limit)


# Shared with test_memory_oracle.py (oracle_helpers); the names here stay for the tests that import them.
_key = strategy_key  # (dims, zero stage, micro-batch, engine, sp, virtual stages, ...)
_assignments = assignments


@lru_cache(maxsize=None)
def brute_force(case: str) -> tuple[tuple[tuple, float, int], ...]:
    """(strategy key, step seconds, peak bytes) of every plan in the case's space, for any budget."""
    model, pins = CASES[case]
    return _every_plan(model, pins, TRAIN)


def _every_plan(model, pins, train) -> tuple[tuple[tuple, float, int], ...]:
    c = cluster()
    out = []
    for strategy in strategies(model, c, train, pins):
        for stage_layers, options in _assignments(strategy, model, pins):
            prediction = predict_step(model, c, train, strategy, stage_layers, options).prediction
            out.append((_key(strategy), prediction.step_seconds, prediction.peak_memory_bytes))
    return tuple(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_space_holds_the_dimension_and_spans_budgets(case):
    plans = brute_force(case)
    keys = {key for key, _, _ in plans}
    if case == "interleaved":
        assert {key[5] for key in keys} == {1, 2}
    elif case == "experts":
        assert {key[0].ep for key in keys} == {1, 2}
    else:
        assert {key[0].cp for key in keys} == {2} and {key[1] for key in keys} == {0, 1, 2, 3}
    peaks = [peak for _, _, peak in plans]
    assert min(peaks) < max(peaks)


@settings(max_examples=24, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(sorted(CASES)), position=st.floats(0.0, 1.0))
def test_the_search_finds_a_fitting_plan_whenever_one_exists(case, position):
    model, pins = CASES[case]
    check_search_at(model, pins, TRAIN, cluster, [(step, peak) for _, step, peak in brute_force(case)], position,
                    lambda c: strategies(model, c, TRAIN, pins))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_search_keeps_up_with_brute_force_where_the_fastest_plan_changes(case):
    """Budgets exactly at the peaks where the fastest fitting plan changes (where any rounding of
    memory, or a moment counted twice, loses it): the search finds a plan as fast there."""
    model, pins = CASES[case]
    check_search_at_frontier(model, pins, TRAIN, cluster, [(step, peak) for _, step, peak in brute_force(case)], case)


# Ulysses' neighbours, only where the fastest plan changes (their spaces are as large as the cases').
EDGES = {
    # One micro-batch per step: DeepSpeed without ZeRO holds no gradient yet at the loss.
    "one-micro-batch": (Constraints(cp=2, engine="deepspeed", micro_batch=4, **PLAIN), TRAIN),
    # Eager attention: the attention core's selective recomputation is searched too, and what it
    # frees can let the head split its loss less.
    "selective": (Constraints(cp=2, engine="deepspeed", micro_batch=2, offload="none"),
                  dataclasses.replace(TRAIN, flash_attention=False)),
}


@pytest.mark.parametrize("edge", sorted(EDGES))
def test_ulysses_edges_keep_up_with_brute_force_where_the_fastest_plan_changes(edge):
    pins, train = EDGES[edge]
    plans = _every_plan(ROTARY, pins, train)
    if edge == "selective":
        assert {key[7] for key, _, _ in plans} == {(), ("core_attn",)}
    check_search_at_frontier(ROTARY, pins, train, cluster, [(step, peak) for _, step, peak in plans], edge)


MIXTRAL_LIKE = dataclasses.replace(load_model("llama2-7b"), name="moe-7b", num_layers=8, num_experts=8,
                                   moe_top_k=2, moe_ffn_hidden_size=11008)
# Llama 4's alternation: the search averages the dense and MoE layers, the prediction prices each
MIXED = dataclasses.replace(MIXTRAL_LIKE, name="mixed-7b", moe_layer_freq=2, moe_layer_phase=1)
# Gemma 3's alternation: local layers within a window and a global one, averaged by the search too
WINDOWED = dataclasses.replace(load_model("llama2-7b"), name="windowed-7b", num_layers=10, sliding_window=512,
                               global_attention_every=3)


@pytest.mark.parametrize("model, seq, pins", [
    (load_model("llama2-7b"), 4096, Constraints(pp=4, vpp=2, engine="megatron", **PLAIN)),
    (load_model("llama2-7b"), 32768, Constraints(cp=2, engine="megatron", **PLAIN)),
    (load_model("llama2-7b"), 32768, Constraints(cp=4, engine="deepspeed", **PLAIN)),
    (MIXTRAL_LIKE, 4096, Constraints(engine="megatron", ep=4, **PLAIN)),
    (MIXED, 4096, Constraints(engine="megatron", ep=8, **PLAIN)),
    (WINDOWED, 8192, Constraints(engine="megatron", pp=4, **PLAIN)),
], ids=["interleaved", "ring", "ulysses", "experts", "dense-and-moe", "local-and-global"])
def test_lower_bound_never_exceeds_the_plan_it_bounds(model, seq, pins):
    cluster_ = ClusterSpec(load_hardware("a100-80gb"), nodes=1, gpus_per_node=8)
    train = TrainSpec(global_batch=32, seq_len=seq)
    planner = Planner(model, cluster_, train, pins)
    checked = 0
    for strategy in strategies(model, cluster_, train, pins):
        priced = planner._price(strategy)
        solved = planner._solve(priced)
        if solved is None:
            continue
        plan = planner.build_plan(solved.strategy, solved.stage_layers, solved.options)
        assert priced.lower_bound(model.num_layers) <= plan.prediction.step_seconds * (1 + 1e-12), strategy.describe()
        checked += 1
    assert checked > 0


def test_lower_bound_holds_where_a_chunk_of_local_layers_is_light():
    """With local and global attention layers priced apart, a model chunk of local layers holds far less
    than 1/v of its stage: four micro-batches at 64K tokens over pp 2 x vpp 2, a 128-token window and
    a light head (before, the bound exceeded the plan by 2.5%)."""
    model = dataclasses.replace(WINDOWED, num_layers=16, sliding_window=128, vocab_size=1024)
    cluster_ = ClusterSpec(load_hardware("h100-80gb"), nodes=1, gpus_per_node=8)
    train = TrainSpec(global_batch=4, seq_len=65536)
    pins = Constraints(engine="megatron", pp=2, vpp=2, tp=4, micro_batch=1, offload="none", checkpoint=False)
    planner = Planner(model, cluster_, train, pins)
    checked = 0
    for strategy in strategies(model, cluster_, train, pins):
        priced = planner._price(strategy)
        solved = planner._solve(priced)
        if solved is not None:
            plan = planner.build_plan(solved.strategy, solved.stage_layers, solved.options)
            assert priced.lower_bound(model.num_layers) <= plan.prediction.step_seconds, strategy.describe()
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("model, seq, pins", [
    (load_model("gpt2-xl"), 1024, Constraints(pp=4, engine="megatron", **PLAIN)),  # 1, 2 and 4 chunks per rank
    (load_model("llama2-7b"), 32768, Constraints(engine="megatron", micro_batch=1, **PLAIN)),  # cp searched
    (load_model("llama2-7b"), 32768, Constraints(engine="deepspeed", micro_batch=1, **PLAIN)),
    (MIXTRAL_LIKE, 2048, Constraints(engine="megatron", micro_batch=1, **PLAIN)),  # ep searched
], ids=["interleaved", "ring", "ulysses", "experts"])
def test_branch_and_bound_finds_the_same_best_as_solving_everything(model, seq, pins):
    cluster_ = ClusterSpec(load_hardware("a100-80gb"), nodes=1, gpus_per_node=8, memory_limit_bytes=40 * 2**30)
    train = TrainSpec(global_batch=32, seq_len=seq)
    planner = Planner(model, cluster_, train, pins)
    space = strategies(model, cluster_, train, pins)
    assert len({(s.virtual_stages, s.dims.cp, s.dims.ep) for s in space}) > 1  # the dimension is searched
    solved = [planner._solve(planner._price(s)) for s in space]
    fitting = [plan.prediction.step_seconds for plan in
               (planner.build_plan(s.strategy, s.stage_layers, s.options) for s in solved if s)
               if plan.prediction.peak_memory_bytes <= cluster_.memory_budget_bytes]
    assert planner.search()[0].prediction.step_seconds <= min(fitting) * (1 + 1e-12)
