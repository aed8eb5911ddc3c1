"""Calibration per parallel dimension: steps "measured" on a machine whose tensor-parallel
collectives, pipeline transfers or pipeline bubble alone are slower than priced move that term's
factor and leave compute (and the others) at 1; a dimension with too few measured steps keeps its
factor at the prior and says so."""

from __future__ import annotations

import pytest

from dsauto.cost.calibration import IDENTITY, Calibration
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.refine.calibrate import Observation, dimension_seconds, fit_calibration, held_factors
from dsauto.refine.space import Candidate, Knobs, calibrated_planner
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec

# (dp, tp, pp), transformer layers per stage, micro-batch, micro-batches per replica, recompute
SHAPES = (
    ((2, 1, 1), (4,), 2, 4, False), ((2, 1, 1), (4,), 4, 2, True),
    ((1, 2, 1), (4,), 1, 8, False), ((1, 2, 1), (4,), 2, 4, True), ((1, 2, 1), (4,), 4, 2, False),
    ((1, 1, 2), (2, 2), 1, 8, False), ((1, 1, 2), (1, 3), 2, 4, True), ((1, 1, 2), (3, 1), 4, 2, False),
    ((1, 1, 2), (2, 2), 4, 2, True),
)


def plans(shapes=SHAPES):
    """Megatron-core plans of gpt-tiny on two A100s (where the tensor-parallel collectives and the
    pipeline's transfers and bubble are each a sizeable share of the step), each with the planner
    of its own batch."""
    model, cluster = load_model("gpt-tiny"), load_cluster("a100-80gb", nodes=1, gpus_per_node=2)
    out = []
    for (dp, tp, pp), layout, micro_batch, micro_batches, recompute in shapes:
        train = TrainSpec(global_batch=dp * micro_batch * micro_batches, seq_len=256, dtype="bf16")
        planner = Planner(model, cluster, train, Constraints(engine="megatron"))
        strategy = Strategy(dims=ParallelDims(dp=dp, tp=tp, pp=pp), zero_stage=0, micro_batch=micro_batch,
                            grad_accum=micro_batches, sequence_parallel=False, engine="megatron")
        options = tuple(LayerOption(checkpoint=recompute and 1 <= j <= model.num_layers, shard_params=False, split=1)
                        for j in range(model.num_layers + 2))
        plan = planner.build_plan(strategy, layout, options)
        out.append((planner, Candidate(Knobs(f"plan{len(out)}"), strategy, layout, options, plan)))
    return out


def observe(priced, truth: Calibration) -> list[Observation]:
    """Each plan's step and peak as the cost model predicts them under ``truth``."""
    observed = []
    for planner, candidate in priced:
        real = candidate.price(calibrated_planner(planner, truth)).prediction
        observed.append(Observation(candidate, real.step_seconds, real.peak_memory_bytes, planner=planner))
    return observed


def test_the_step_breakdown_is_what_each_factor_scales():
    priced = plans(SHAPES[3:4] + SHAPES[6:7])
    (_, tp_plan), (_, pp_plan) = priced
    for planner, candidate in priced:
        base = candidate.plan.prediction
        terms = dimension_seconds(base)
        for name in ("tensor_parallel", "pipeline_bubble"):
            doubled = candidate.price(calibrated_planner(planner, Calibration(**{name: 2.0}))).prediction
            # an additive term: doubling its factor adds exactly its share of the step
            assert doubled.step_seconds - base.step_seconds == pytest.approx(terms[name], rel=1e-6, abs=1e-12)
    assert tp_plan.plan.prediction.tp_comm_seconds > 0.3 * tp_plan.plan.prediction.step_seconds
    assert pp_plan.plan.prediction.p2p_seconds > 0.1 * pp_plan.plan.prediction.step_seconds
    assert pp_plan.plan.prediction.tp_comm_seconds == tp_plan.plan.prediction.p2p_seconds == 0.0


@pytest.mark.parametrize("name, factor", [("tensor_parallel", 1.8), ("pipeline_p2p", 2.0),
                                          ("pipeline_bubble", 1.5)])
def test_one_slow_term_moves_its_own_factor_only(name, factor):
    priced = plans()
    planner = priced[0][0]
    fitted = fit_calibration(planner, observe(priced, Calibration(**{name: factor})), prior=IDENTITY)
    # the prior holds the factor back a little (PRIOR_WEIGHT), so a small misfit remains
    assert getattr(fitted, name) == pytest.approx(factor, rel=0.05)
    for other in ("compute", "tensor_parallel", "pipeline_p2p", "pipeline_bubble", "optimizer"):
        if other != name:
            assert getattr(fitted, other) == pytest.approx(1.0, abs=0.04), other
    assert fitted.held == ()
    assert fitted.time_error_before > 0.05 and fitted.time_error_after < fitted.time_error_before / 5


def test_slow_compute_is_mostly_put_on_compute():
    priced = plans()
    fitted = fit_calibration(priced[0][0], observe(priced, Calibration(compute=1.5)), prior=IDENTITY)
    assert fitted.compute == pytest.approx(1.5, rel=0.06)
    # the dimension factors' lighter pull (their terms' shares) lets them take a little of it
    for name in ("tensor_parallel", "pipeline_p2p", "pipeline_bubble"):
        assert getattr(fitted, name) == pytest.approx(1.0, abs=0.15), name


def test_a_dimension_measured_once_keeps_its_factor_and_says_so():
    # one tensor-parallel step among data-parallel and pipeline ones
    priced = plans(SHAPES[:2] + SHAPES[2:3] + SHAPES[5:])
    assert held_factors([c.plan for _, c in priced]) == ("tensor_parallel",)
    fitted = fit_calibration(priced[0][0], observe(priced, Calibration(tensor_parallel=2.0)), prior=IDENTITY)
    assert fitted.tensor_parallel == 1.0
    assert fitted.held == ("tensor_parallel",)
    assert "tensor parallel left at x1.00: too few of the steps had that term" in fitted.describe()
    # without a single pipeline step, both pipeline factors stay too
    assert held_factors([c.plan for _, c in plans(SHAPES[:5])]) == ("pipeline_p2p", "pipeline_bubble")
