"""An Optuna sampler that uses the cost model as its prior: expected improvement over the best
measured step, with the calibrated cost model's prediction as the expected step time of every
point not yet measured.

Before each trial it fits the correction factors to every step the study has measured (on any
machine), prices the whole space again with them, and estimates each unmeasured candidate:

- from a measured *sibling* (the same base plan with other knobs), when there is one: the sibling's
  measured time scaled by the calibrated ratio of the two predictions, with a small uncertainty
  (knobs move a plan's time by a few percent, and the sibling already absorbed the model's error);
- otherwise from the calibrated prediction, with the uncertainty of the calibrated fit (at least
  the model's typical error).

Memory is estimated the same way; the probability of fitting the budget multiplies the expected
improvement, so a candidate predicted near the limit is tried only when it promises enough.
Candidates already measured, running on another machine, or failed are never proposed again; a
trial interrupted by a killed tune (status ``interrupted``) frees its candidate.

Used with a study like any sampler: ``optuna.create_study(sampler=CostModelSampler(space, planner))``;
the objective asks for the knobs with ``trial.suggest_*`` (see :func:`suggest`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    IntDistribution,
)
from optuna.trial import FrozenTrial, TrialState

from dsauto.cost.calibration import Calibration
from dsauto.refine.calibrate import CONTENDED_WEIGHT, Observation, fit_calibration
from dsauto.refine.space import (
    BUCKET_SCALES,
    CHECKPOINT_DELTAS,
    PREFETCH_SCALES,
    Candidate,
    Knobs,
    calibrated_planner,
)
from dsauto.search.planner import Planner

MODEL_TIME_SIGMA = 0.10
"""Relative uncertainty of an uncalibrated step-time prediction (benchmarks/results/accuracy.md:
median error 6-9%, largest about 22%)."""
MODEL_MEMORY_SIGMA = 0.10
"""Relative uncertainty of an uncalibrated peak-memory prediction (same benchmark: median 6%)."""
SIBLING_SIGMA = 0.03
"""Relative uncertainty of an estimate from a measured sibling that differs in buffer sizes."""
SIBLING_CHECKPOINT_SIGMA = 0.05
"""The same for a sibling that checkpoints a different number of layers."""
FLOOR_SIGMA = 0.04
"""Least uncertainty granted to the calibrated model (step-time noise between runs on a CPU)."""

STATUS = "status"
"""Trial user attribute: ``complete``, ``infeasible``, ``failed`` or ``interrupted``."""
PEAK = "peak_bytes"
"""Trial user attribute: the measured peak live bytes per rank."""
STEP = "step_seconds"
"""Trial user attribute: the measured median step time (also the value of a complete trial)."""
CONTENDED = "contended"
"""Trial user attribute: whether other processes competed with the trial's ranks for CPU cores."""
OTHER_LOAD = "other_load"
"""Trial user attribute: CPU cores other processes kept busy while the trial ran."""


def knob_rules(space: Sequence[Candidate]) -> dict[str, tuple[bool, bool]]:
    """For each base plan label: whether it has the bucket knob and the prefetch knob."""
    rules: dict[str, tuple[bool, bool]] = {}
    for c in space:
        bucket, prefetch = rules.get(c.knobs.plan, (False, False))
        rules[c.knobs.plan] = (bucket or c.knobs.bucket_scale is not None,
                               prefetch or c.knobs.prefetch_scale is not None)
    return rules


def suggest(trial: optuna.Trial, rules: dict[str, tuple[bool, bool]]) -> Knobs:
    """Ask ``trial`` for a point of the space, knob by knob (``rules``: :func:`knob_rules`)."""
    plan = trial.suggest_categorical("plan", list(rules))
    delta = trial.suggest_int("checkpoint_delta", min(CHECKPOINT_DELTAS), max(CHECKPOINT_DELTAS))
    has_bucket, has_prefetch = rules[plan]
    bucket = trial.suggest_categorical("bucket_scale", list(BUCKET_SCALES)) if has_bucket else None
    prefetch = trial.suggest_categorical("prefetch_scale", list(PREFETCH_SCALES)) if has_prefetch else None
    return Knobs(plan, delta, bucket, prefetch)


@dataclass(frozen=True)
class Estimate:
    """What the sampler expects of one candidate."""

    step_seconds: float
    time_sigma: float
    """Relative uncertainty of ``step_seconds``."""
    peak_bytes: float
    memory_sigma: float
    """Relative uncertainty of ``peak_bytes``."""


def _normal_cdf(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def expected_improvement(best: float, mean: float, sigma: float) -> float:
    """E[max(0, best - T)] for T ~ N(mean, sigma^2) (Jones et al. 1998, eq. 15, for minimisation)."""
    if sigma <= 0:
        return max(0.0, best - mean)
    z = (best - mean) / sigma
    return (best - mean) * _normal_cdf(z) + sigma * math.exp(-z * z / 2) / math.sqrt(2 * math.pi)


def trial_observation(trial: FrozenTrial, by_key: dict[str, Candidate]) -> Observation | None:
    """The measured step of a finished trial (complete, or infeasible but measured)."""
    attrs = trial.user_attrs
    if trial.state not in (TrialState.COMPLETE, TrialState.PRUNED) or STEP not in attrs or PEAK not in attrs:
        return None
    candidate = by_key.get(key_of(Knobs.from_params(trial.params)))
    if candidate is None:
        return None
    weight = CONTENDED_WEIGHT if attrs.get(CONTENDED) else 1.0
    return Observation(candidate, float(attrs[STEP]), int(attrs[PEAK]), weight)


def layout_of(candidate: Candidate) -> tuple[int, int]:
    """The model-parallel layout of a candidate: (tp, pp)."""
    return candidate.strategy.dims.tp, candidate.strategy.dims.pp


def key_of(knobs: Knobs) -> str:
    return repr(sorted(knobs.params().items()))


_TIMED_OUT = re.compile(r"^hung: no result after (\d+(?:\.\d+)?) s")


def timed_out_at(status: Any, reason: Any) -> float | None:
    """The timeout a failed trial ran out of (its only failure), from its status and reason, or None."""
    found = _TIMED_OUT.match(str(reason or "")) if status == "failed" else None
    return float(found.group(1)) if found else None


class CostModelSampler(optuna.samplers.BaseSampler):
    """Proposes the candidate with the largest feasible expected improvement (see the module)."""

    def __init__(self, space: Sequence[Candidate], planner: Planner, seed: int = 0,
                 retry_timeouts_below: float = 0.0):
        """``retry_timeouts_below``: this run's trial timeout; a candidate whose trial failed only by
        running out of a shorter one is free again (:meth:`taken`)."""
        if not space:
            raise ValueError("the sampler needs at least one candidate")
        self.space = tuple(space)
        self.planner = planner
        self.budget_bytes = planner.cluster.memory_budget_bytes
        self._by_key = {key_of(c.knobs): c for c in self.space}
        self._picks: dict[int, Candidate] = {}
        self._fallback = optuna.samplers.RandomSampler(seed=seed)
        self.calibration: Calibration | None = None
        """The correction factors of the last proposal (fitted to the study's measured steps)."""
        self._proposal: tuple[tuple, Candidate | None] | None = None
        self.retry_timeouts_below = retry_timeouts_below

    # Optuna's sampler interface: everything is sampled "independently", from one joint pick.
    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        if trial.number not in self._picks:
            pick = self.propose(study, exclude=trial.number)
            if pick is None:
                return self._fallback.sample_independent(study, trial, param_name, param_distribution)
            self._picks[trial.number] = pick
        value = self._picks[trial.number].knobs.params().get(param_name)
        if value is None or not _contains(param_distribution, value):
            return self._fallback.sample_independent(study, trial, param_name, param_distribution)
        return value

    # The choice itself.
    def taken(self, study: optuna.Study, exclude: int | None = None, before: int | None = None) -> set[str]:
        """Keys of candidates measured, being measured or failed, by trials numbered below ``before``
        (all by default) other than ``exclude``. A trial cut off (``interrupted``, or failed by
        heartbeat without a status of its own) frees its candidate, and so does one that failed only
        by running out of a timeout shorter than this run's."""
        keys = set()
        for t in study.get_trials(deepcopy=False):
            status = t.user_attrs.get(STATUS)
            if t.number == exclude or (before is not None and t.number >= before) or status == "interrupted":
                continue
            limit = timed_out_at(status, t.user_attrs.get("reason"))
            if limit is not None and limit < self.retry_timeouts_below:
                continue
            if t.state == TrialState.FAIL and status not in ("failed",):
                continue
            if t.state == TrialState.RUNNING and t.number in self._picks:
                keys.add(key_of(self._picks[t.number].knobs))
            elif "plan" in t.params:
                keys.add(key_of(Knobs.from_params(t.params)))
        return keys

    def observations(self, study: optuna.Study) -> list[Observation]:
        return [o for t in study.get_trials(deepcopy=False) if (o := trial_observation(t, self._by_key)) is not None]

    def estimates(self, observed: Sequence[Observation]) -> dict[str, Estimate]:
        """The estimate of every candidate under the calibration fitted to ``observed`` steps."""
        self.calibration = fit_calibration(self.planner, observed) if observed else self.planner.calibration
        planner = calibrated_planner(self.planner, self.calibration)
        priced = {key_of(c.knobs): c.price(planner).prediction for c in self.space}
        time_sigma = max(FLOOR_SIGMA, self.calibration.time_error_after) if observed else MODEL_TIME_SIGMA
        memory_sigma = max(FLOOR_SIGMA, self.calibration.memory_error_after) if observed else MODEL_MEMORY_SIGMA
        measured = {key_of(o.candidate.knobs): o for o in observed}
        result = {}
        for candidate in self.space:
            key = key_of(candidate.knobs)
            mine = priced[key]
            siblings = [o for o in observed if o.candidate.knobs.plan == candidate.knobs.plan]
            if key in measured:
                o = measured[key]
                result[key] = Estimate(o.step_seconds, 0.0, o.peak_bytes, 0.0)
            elif siblings:
                # The nearest sibling: the fewest knobs apart, a different checkpoint count last.
                def distance(o: Observation, b: Knobs = candidate.knobs) -> tuple[int, int]:
                    a = o.candidate.knobs
                    return (a.checkpoint_delta != b.checkpoint_delta,
                            (a.bucket_scale != b.bucket_scale) + (a.prefetch_scale != b.prefetch_scale))
                o = min(siblings, key=distance)
                theirs = priced[key_of(o.candidate.knobs)]
                far = o.candidate.knobs.checkpoint_delta != candidate.knobs.checkpoint_delta
                result[key] = Estimate(
                    o.step_seconds * mine.step_seconds / theirs.step_seconds,
                    SIBLING_CHECKPOINT_SIGMA if far else SIBLING_SIGMA,
                    o.peak_bytes * mine.peak_memory_bytes / max(theirs.peak_memory_bytes, 1),
                    SIBLING_CHECKPOINT_SIGMA if far else SIBLING_SIGMA)
            else:
                result[key] = Estimate(mine.step_seconds, time_sigma, mine.peak_memory_bytes, memory_sigma)
        return result

    def fit_probability(self, estimate: Estimate) -> float:
        """Probability that the candidate's peak fits the budget."""
        if estimate.memory_sigma <= 0:
            return 1.0 if estimate.peak_bytes <= self.budget_bytes else 0.0
        return _normal_cdf((self.budget_bytes - estimate.peak_bytes) / (estimate.memory_sigma * estimate.peak_bytes))

    def propose(self, study: optuna.Study, exclude: int | None = None) -> Candidate | None:
        """The next candidate to measure, or None when every promising one has been. The answer is
        kept until the study's trials change (other than ``exclude``, the trial asking), so that
        asking whether to go on and then sampling the trial fits the calibration once."""
        state = tuple((t.number, t.state, t.user_attrs.get(STATUS)) for t in study.get_trials(deepcopy=False)
                      if t.number != exclude)
        if self._proposal is None or self._proposal[0] != state:
            self._proposal = (state, self._choose(study, exclude))
        return self._proposal[1]

    def _choose(self, study: optuna.Study, exclude: int | None) -> Candidate | None:
        taken = self.taken(study, exclude)
        # A plan whose trial crashed (an error, not memory or time) crashes with other knobs too,
        # e.g. a setting the engine cannot run on this machine: its siblings are not tried.
        crashed = {t.params["plan"] for t in study.get_trials(deepcopy=False)
                   if t.user_attrs.get(STATUS) == "failed" and str(t.user_attrs.get("reason", "")).startswith("crashed")
                   and "plan" in t.params}
        open_ = [c for c in self.space if key_of(c.knobs) not in taken and c.knobs.plan not in crashed]
        if not open_:
            return None
        observed = self.observations(study)
        estimates = self.estimates(observed)
        # Each model-parallel layout of the space is measured once, its fastest likely-fitting
        # candidate, before expected improvement ranks the rest: no step of another layout says how
        # wrong the model is about this one's terms (tensor-parallel collectives, pipeline bubble).
        tried = {layout_of(self._by_key[k]) for k in taken if k in self._by_key}
        fresh = [c for c in open_ if layout_of(c) not in tried
                 and self.fit_probability(estimates[key_of(c.knobs)]) >= 0.5]
        if fresh and len({layout_of(c) for c in self.space}) > 1:
            return min(fresh, key=lambda c: estimates[key_of(c.knobs)].step_seconds)
        best = min((o.step_seconds for o in observed if o.peak_bytes <= self.budget_bytes), default=None)

        def score(c: Candidate) -> float:
            e = estimates[key_of(c.knobs)]
            fits = self.fit_probability(e)
            if best is None:  # nothing feasible measured yet: the fastest likely-feasible one
                return fits / e.step_seconds if fits >= 0.5 else fits * 1e-9
            return fits * expected_improvement(best, e.step_seconds, e.time_sigma * e.step_seconds)

        scores = [score(c) for c in open_]
        top = max(range(len(open_)), key=lambda i: (scores[i], -i))
        if scores[top] <= 0 or (best is not None and scores[top] < 1e-4 * best):
            return None  # nothing left that is likely to fit and beat the best measured step
        return open_[top]


def _contains(distribution: BaseDistribution, value: Any) -> bool:
    if isinstance(distribution, CategoricalDistribution):
        return value in distribution.choices
    if isinstance(distribution, IntDistribution):
        return distribution.low <= value <= distribution.high
    return True
