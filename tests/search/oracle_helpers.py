"""What the brute-force oracle tests share: the search's space enumerated, and a searched plan's
own choices priced again, and the two checks they run the search through.

``test_memory_oracle.py`` and ``test_dimension_oracle.py`` (tests/search is on sys.path as pytest
imports them) price every assignment of small spaces (:func:`assignments`) and check that the plan
the search returns carries the prediction of its own choices: they rebuild its strategy and
per-layer options from the plan and call ``predict_step`` on them (:func:`assert_own_prediction`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

from dsauto.cost.step import predict_step
from dsauto.errors import DsautoError
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.plan import Plan, Prediction
from dsauto.search.planner import Planner
from dsauto.search.planner import block_recompute_options
from dsauto.search.space import Constraints, allowed, layer_options
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec


def assignments(strategy: Strategy, model: ModelSpec,
                pins: Constraints) -> Iterator[tuple[tuple[int, ...], tuple[LayerOption, ...]]]:
    """Every (stage layout, per-layer options) of the search's space for ``strategy``: with one stage
    the multisets of block options (identical blocks in one stage are interchangeable); with two,
    every split leaving each rank at least one layer per chunk, and every option per block. The
    transformer layers take the strategy's selective recomputation, as the planner's do."""
    options = layer_options(strategy)
    embedding = [o for o in options if allowed("embedding", o, pins)]
    head = [o for o in options if allowed("head", o, pins)]
    block = [o for o in options if allowed("transformer", o, pins, strategy.recompute_modules)]
    L, v = model.num_layers, strategy.virtual_stages
    if strategy.pp == 1:
        for e, h in itertools.product(embedding, head):
            for blocks in itertools.combinations_with_replacement(block, L):
                yield (L,), (e, *blocks, h)
        return
    assert strategy.pp == 2, "the oracle enumerates one or two pipeline stages"
    for first in range(v, L - v + 1):
        for e, h, blocks in itertools.product(embedding, head, itertools.product(block, repeat=L)):
            options = (e, *blocks, h)
            # Megatron-core checkpoints the first N layers of every chunk, one N for all
            if strategy.engine == "megatron" and list(options) != block_recompute_options(options, (first, L - first), v):
                continue
            yield (first, L - first), options


def strategy_key(strategy: Strategy) -> tuple:
    """What tells two strategies of one space apart: dims, ZeRO stage, micro-batch, engine, sequence
    parallelism, virtual stages (the positions test_dimension_oracle.py reads), offload, selective
    recomputation, hpZ and the distributed optimizer's instances."""
    return (strategy.dims, strategy.zero_stage, strategy.micro_batch, strategy.engine, strategy.sequence_parallel,
            strategy.virtual_stages, strategy.offload, strategy.recompute_modules, strategy.hpz,
            strategy.dist_opt_instances)


def plan_key(plan: Plan) -> tuple:
    """:func:`strategy_key` of the strategy ``plan`` was built from."""
    return (plan.dims, plan.zero_stage, plan.micro_batch, plan.engine, plan.sequence_parallel,
            plan.virtual_stages, plan.offload, plan.uniform_recompute_modules(), plan.hpz, plan.dist_opt_instances)


def plan_options(plan: Plan) -> list[LayerOption]:
    """The per-layer option of each flat layer of ``plan`` (embedding, blocks, head), every field."""
    out = []
    for j in range(plan.model.num_layers + 2):
        choice = plan.layer_choice(j)
        out.append(LayerOption(choice.checkpoint, choice.shard_params, choice.split, choice.recompute_modules))
    return out


def plan_strategy(plan: Plan, candidates: Iterable[Strategy]) -> Strategy:
    """The strategy among ``candidates`` that ``plan`` was built from."""
    key = plan_key(plan)
    return next(s for s in candidates if strategy_key(s) == key)


def predict_again(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan,
                  candidates: Iterable[Strategy]) -> Prediction:
    """``predict_step`` of ``plan``'s own strategy (found among ``candidates``), layout and options."""
    strategy = plan_strategy(plan, candidates)
    return predict_step(model, cluster, train, strategy, plan.stage_layers, plan_options(plan)).prediction


def assert_own_prediction(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan,
                          candidates: Iterable[Strategy]) -> None:
    """The plan's predicted peak and step are those of its own choices, exactly."""
    again = predict_again(model, cluster, train, plan, candidates)
    assert again.peak_memory_bytes == plan.prediction.peak_memory_bytes
    assert again.step_seconds == plan.prediction.step_seconds


def frontier(plans: Iterable[tuple[float, int]]) -> list[tuple[int, float]]:
    """(peak bytes, step seconds) of the plans, ``plans`` given as (step seconds, peak bytes), that
    are faster than every plan that needs less memory: the budgets at which the fastest fitting
    plan changes, and its step there. At each, the least rounding of memory loses that plan."""
    out: list[tuple[int, float]] = []
    for peak, step in sorted((peak, step) for step, peak in plans):
        if not out or step < out[-1][1]:
            out.append((peak, step))
    return out


STEP_TOLERANCE = 1.05
"""How much slower than the fastest fitting brute-force plan a searched plan may be: the DP rounds
memory to units, which may cost it the fastest plan right at a budget."""


def check_search_at(model: ModelSpec, pins: Constraints, train: TrainSpec, cluster: Callable[[int], ClusterSpec],
                    plans: Sequence[tuple[float, int]], position: float,
                    candidates: Callable[[ClusterSpec], Iterable[Strategy]]) -> None:
    """Searches at a budget ``position`` of the way from 3% below the least peak of the brute-forced
    ``plans`` ((step seconds, peak bytes) of every plan of the space) to 2% above the largest, where
    decisions flip: a plan comes back exactly when one of ``plans`` fits; it fits, carries the
    prediction of its own choices (its strategy found among ``candidates`` of the budget's cluster)
    and is no slower than the fastest fitting plan beyond :data:`STEP_TOLERANCE`."""
    peaks = sorted({peak for _, peak in plans})
    low, high = int(peaks[0] * 0.97), int(peaks[-1] * 1.02)
    budget = low + int(position * (high - low))
    exists = any(peak <= budget for _, peak in plans)
    planner = Planner(model, cluster(budget), train, pins)
    try:
        plan = planner.search()[0]
    except DsautoError as error:
        assert not exists, f"a plan fits {budget} B but the search says: {error}"
        return
    assert exists
    assert plan.prediction.peak_memory_bytes <= budget
    assert_own_prediction(model, planner.cluster, train, plan, candidates(planner.cluster))
    fastest = min(step for step, peak in plans if peak <= budget)
    assert plan.prediction.step_seconds <= fastest * STEP_TOLERANCE


def check_search_at_frontier(model: ModelSpec, pins: Constraints, train: TrainSpec,
                             cluster: Callable[[int], ClusterSpec], plans: Iterable[tuple[float, int]],
                             name: str) -> None:
    """Searches at every budget where the fastest fitting plan of ``plans`` changes (where any
    rounding of memory, or a moment counted twice, loses it): a plan as fast fits there."""
    for peak, step in frontier(plans):
        plan = Planner(model, cluster(peak), train, pins).search()[0]
        assert plan.prediction.peak_memory_bytes <= peak
        assert plan.prediction.step_seconds <= step * STEP_TOLERANCE, f"{name} at {peak} B: {plan.prediction.step_seconds} s"
