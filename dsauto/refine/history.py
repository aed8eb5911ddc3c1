"""The calibration that accumulates: every study's measured steps are kept with the profile, and the
correction factors are fitted to all of them, not only to the last study's.

A study measures a handful of steps of one cluster size, batch and budget; fitted alone, they would
replace what earlier studies taught the model (a 2-trial fit overwriting a 6-step one). Each step is
kept with the plan that ran, the study's cluster and workload, and the load of the machine while it
ran, so any later fit prices it again under that study's own planner. Steps measured while other
processes competed for the ranks' cores count :data:`~dsauto.refine.calibrate.CONTENDED_WEIGHT` of
a step in the time factors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import socket
from collections.abc import Sequence
from pathlib import Path

from dsauto.cost.calibration import IDENTITY, Calibration
from dsauto.errors import DsautoError
from dsauto.plan import Plan
from dsauto.profile.store import MAX_HISTORY_STEPS, Profile, StudyRecord, update_profile
from dsauto.refine.calibrate import CONTENDED_WEIGHT, Observation, fit_calibration
from dsauto.refine.space import Candidate, Knobs, options_of, plan_label, strategy_of
from dsauto.refine.study import TuneResult
from dsauto.search.planner import Planner
from dsauto.spec.model import ModelSpec


def study_record(planner: Planner, result: TuneResult) -> StudyRecord:
    """What ``result``'s study measured, as kept with the profile: named by the study and a digest of
    its storage (two --out folders hold two studies of the same name; the URL may carry a password),
    so that a study's record replaces only its own."""
    storage = hashlib.sha256(result.storage.encode()).hexdigest()[:8]
    return StudyRecord(study=f"{result.study_name} ({storage})", host=socket.gethostname(), cluster=planner.cluster,
                       train=planner.train, steps=result.steps)


def with_study(history: Sequence[StudyRecord], record: StudyRecord) -> tuple[StudyRecord, ...]:
    """``history`` with ``record`` last (replacing an earlier record of the same study, which a
    resumed study's steps include), trimmed to the most recent :data:`MAX_HISTORY_STEPS` steps."""
    kept = [r for r in history if r.study != record.study] + [record]
    while len(kept) > 1 and sum(len(r.steps) for r in kept) > MAX_HISTORY_STEPS:
        kept.pop(0)
    return tuple(kept)


def observations(profile: Profile, history: Sequence[StudyRecord]) -> list[Observation]:
    """The steps of ``history`` as observations, each priced by its own study's planner (measured
    layers from ``profile``) for the model its plan trained (a profile serves the model with and
    without its multi-token-prediction layers: store.profiled_model); a step whose plan this dsauto
    cannot read any more is left out."""
    found = []
    for record in history:
        planners: dict[ModelSpec, Planner] = {}
        for step in record.steps:
            try:
                plan = Plan.from_dict(step.plan, f"a plan measured by study {record.study}")
            except DsautoError:
                continue
            model = dataclasses.replace(profile.model, mtp_layers=plan.model.mtp_layers)
            planner = planners.setdefault(model, Planner(model, record.cluster, record.train, profile=profile))
            candidate = Candidate(Knobs(plan_label(plan)), strategy_of(plan), plan.stage_layers,
                                  options_of(plan), plan)
            found.append(Observation(candidate, step.step_seconds, step.peak_bytes,
                                     CONTENDED_WEIGHT if step.contended else 1.0, planner))
    return found


def fit_history(profile: Profile, history: Sequence[StudyRecord]) -> Calibration:
    """Correction factors fitted to every step of ``history``, from the identity (or, for a profile
    calibrated before it kept its history, from that calibration)."""
    prior = profile.calibration if not profile.history and profile.calibration is not None else IDENTITY
    observed = observations(profile, history)
    if not observed:
        return prior
    return fit_calibration(observed[0].planner, observed, prior=prior)


def record_study(source: Path | str, profile: Profile, planner: Planner,
                 result: TuneResult) -> tuple[Profile, Path]:
    """Add the study of ``result`` to the profile stored at ``source`` (as it is on disk now: another
    tune may have added its own meanwhile), fit the calibration to all the studies, and store both."""
    record = study_record(planner, result)

    def add(stored: Profile) -> Profile:
        history = with_study(stored.history, record)
        return dataclasses.replace(stored, history=history, calibration=fit_history(stored, history))

    return update_profile(source, profile, add)
