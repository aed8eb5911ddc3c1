"""Fitting the cost model's correction factors (:class:`dsauto.cost.calibration.Calibration`) to
measured steps.

Each factor scales one part of the model (compute, collectives, ZeRO-3 hooks, optimizer; static and
activation memory), so a measurement corrects every plan in proportion to how much of that part it
has: a ZeRO-3 step that runs slow raises the hook or communication factor, which then ranks every
ZeRO-3 plan lower but leaves ZeRO-0 plans alone. The fit is a regularised least squares in log
space, solved by Gauss-Newton over the full step prediction (overlaps, pipeline schedule and all),
so factors the measurements say nothing about stay at their prior.

The tensor-parallel collectives, the pipeline's transfers and its bubble have factors of their own
(:data:`~dsauto.cost.calibration.DIMENSION_FACTORS`): a TP step measured slow raises the
tensor-parallel factor by as much of the misfit as its share of the predicted step explains
(:attr:`~dsauto.plan.Prediction.tp_comm_seconds`), and leaves compute to the steps of every plan.
Each moves only when at least :data:`MIN_TRIALS_PER_FACTOR` measured steps had its term, since a
single step cannot tell one term's error from another's; otherwise it stays at its prior, which the
fitted calibration names (``Calibration.held``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dsauto.cost.calibration import DIMENSION_FACTORS, IDENTITY, MEMORY_FACTORS, TIME_FACTORS, Calibration
from dsauto.plan import Plan, Prediction
from dsauto.refine.space import Candidate, calibrated_planner
from dsauto.search.planner import Planner

PRIOR_WEIGHT = 0.5
"""Pull of each log-factor towards its prior, against residuals of log step time: a 10% change of a
factor costs as much as a 5% misfit of one measurement (about the step-time noise on a CPU)."""
LOG_BOUND = math.log(5.0)
"""Factors stay within 1/5 .. 5 of the prior: a larger correction means the model is wrong in kind."""
MIN_TRIALS_PER_FACTOR = 2
"""Measured steps with a dimension factor's term (:func:`dimension_seconds`) needed before the fit
moves that factor."""
MIN_TERM_SHARE = 0.01
"""A step has a term when the term is at least this fraction of its predicted time."""
CONTENDED_WEIGHT = 0.1
"""Weight of a step measured under CPU contention, against 1 for a step measured alone: it still
says something about memory and about the ranking, little about speed."""


@dataclass(frozen=True)
class Observation:
    """One measured step of one candidate."""

    candidate: Candidate
    """What ran."""
    step_seconds: float
    """Measured median step time."""
    peak_bytes: int
    """Measured peak live tensor bytes per rank."""
    weight: float = 1.0
    """How much the step counts in the fit: 1, or :data:`CONTENDED_WEIGHT` for a step whose ranks
    competed with other processes for CPU cores (its time says more about the load than the plan)."""
    planner: Planner | None = None
    """The planner of the study that measured the step, when it is not the one fitting: steps of
    earlier studies, kept with the profile, ran on other cluster sizes, batches or budgets."""


def dimension_seconds(prediction: Prediction) -> dict[str, float]:
    """The seconds of a predicted step that each of :data:`DIMENSION_FACTORS` scales: the
    tensor-parallel collectives, the pipeline's transfers and its bubble (the cost model's breakdown
    of the step, :class:`~dsauto.plan.Prediction`)."""
    return {"tensor_parallel": prediction.tp_comm_seconds, "pipeline_p2p": prediction.p2p_seconds,
            "pipeline_bubble": prediction.bubble_seconds}


def dimension_shares(plans: Sequence[Plan]) -> dict[str, list[float]]:
    """For each of :data:`DIMENSION_FACTORS`, its term's share of the predicted step in each of
    ``plans`` that has the term (at least :data:`MIN_TERM_SHARE`)."""
    shares: dict[str, list[float]] = {name: [] for name in DIMENSION_FACTORS}
    for plan in plans:
        for name, seconds in dimension_seconds(plan.prediction).items():
            share = seconds / plan.prediction.step_seconds
            if share >= MIN_TERM_SHARE:
                shares[name].append(share)
    return shares


def held_factors(plans: Sequence[Plan], min_trials: int = MIN_TRIALS_PER_FACTOR) -> tuple[str, ...]:
    """The dimension factors that fewer than ``min_trials`` of the measured ``plans`` have a term
    for (at least :data:`MIN_TERM_SHARE` of the predicted step): a fit leaves them at their prior."""
    return tuple(name for name, shares in dimension_shares(plans).items() if len(shares) < min_trials)


def rms_relative_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Root mean square of (predicted - measured) / measured."""
    if not measured:
        return 0.0
    return math.sqrt(sum(((p - m) / m) ** 2 for p, m in zip(predicted, measured)) / len(measured))


def _gauss_newton(residuals: Callable[[np.ndarray], np.ndarray], start: np.ndarray,
                  iterations: int = 8, step: float = 1e-3) -> np.ndarray:
    """Minimise ||residuals(x)||^2 from ``start`` (numerical Jacobian, box |x - start| <= LOG_BOUND)."""
    x = start.copy()
    for _ in range(iterations):
        r = residuals(x)
        jacobian = np.empty((r.size, x.size))
        for k in range(x.size):
            moved = x.copy()
            moved[k] += step
            jacobian[:, k] = (residuals(moved) - r) / step
        delta, *_ = np.linalg.lstsq(jacobian, -r, rcond=None)
        x = np.clip(x + np.clip(delta, -1.0, 1.0), start - LOG_BOUND, start + LOG_BOUND)
        if np.abs(delta).max() < 1e-4:
            break
    return x


def _predictions(planner: Planner, observations: Sequence[Observation], calibration: Calibration) -> list[Plan]:
    """Each observed candidate priced under ``calibration`` by its own study's planner."""
    priced: dict[int, Planner] = {}
    plans = []
    for o in observations:
        base = o.planner or planner
        if id(base) not in priced:
            priced[id(base)] = calibrated_planner(base, calibration)
        plans.append(o.candidate.price(priced[id(base)]))
    return plans


def fit_calibration(planner: Planner, observations: Sequence[Observation],
                    prior: Calibration | None = None) -> Calibration:
    """Correction factors that make ``planner``'s predictions of ``observations`` match them best,
    starting from (and regularised towards) ``prior`` (default: the planner's own)."""
    prior = prior or planner.calibration or (planner.profile.calibration if planner.profile else None) or IDENTITY
    if not observations:
        return prior
    measured_time = np.log([o.step_seconds for o in observations])
    measured_peak = np.log([max(o.peak_bytes, 1) for o in observations])
    # Weighted least squares: contention slows steps down but does not change their memory.
    time_scale, memory_scale = np.sqrt([o.weight for o in observations]), np.ones(len(observations))

    def with_factors(base: Calibration, names: Sequence[str], logs: np.ndarray) -> Calibration:
        return dataclasses.replace(base, **{n: float(math.exp(v)) for n, v in zip(names, logs)})

    def fit(names: Sequence[str], base: Calibration, measured: np.ndarray,
            value: Callable[[Plan], float], scale: np.ndarray) -> Calibration:
        start = np.log([getattr(prior, n) for n in names])
        pull = np.array([PRIOR_WEIGHT * prior_shares.get(n, 1.0) for n in names])

        def residuals(logs: np.ndarray) -> np.ndarray:
            plans = _predictions(planner, observations, with_factors(base, names, logs))
            misfit = scale * (np.log([max(value(p), 1e-12) for p in plans]) - measured)
            return np.concatenate([misfit, pull * (logs - start)])

        return with_factors(base, names, _gauss_newton(residuals, start))

    # A dimension factor's pull towards its prior is in step time, like the other factors': its
    # term's mean share of the steps that have it, so that a term a tenth of the step is not held
    # back ten times harder than compute (which is most of every step) and the misfit of a TP or PP
    # step goes to the term it belongs to.
    priced = _predictions(planner, observations, prior)
    held = held_factors(priced)
    prior_shares = {name: float(np.mean(values)) for name, values in dimension_shares(priced).items() if values}
    timed = fit([n for n in TIME_FACTORS if n not in held], prior, measured_time,
                lambda p: p.prediction.step_seconds, time_scale)
    fitted = fit(MEMORY_FACTORS, timed, measured_peak, lambda p: float(p.prediction.peak_memory_bytes),
                 memory_scale)

    def errors(calibration: Calibration) -> tuple[float, float]:
        plans = _predictions(planner, observations, calibration)
        return (rms_relative_error([p.prediction.step_seconds for p in plans], [o.step_seconds for o in observations]),
                rms_relative_error([p.prediction.peak_memory_bytes for p in plans], [o.peak_bytes for o in observations]))

    time_before, memory_before = errors(prior)
    time_after, memory_after = errors(fitted)
    return dataclasses.replace(fitted, trials=len(observations), held=held,
                               time_error_before=time_before, time_error_after=time_after,
                               memory_error_before=memory_before, memory_error_after=memory_after)
