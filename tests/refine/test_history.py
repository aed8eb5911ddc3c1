"""The calibration accumulates: every study's steps stay with the profile, the factors are fitted to
all of them (each priced by its own study's planner), and steps measured under CPU contention count
less."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dsauto.cost.calibration import Calibration
from dsauto.profile.store import (
    MAX_HISTORY_STEPS,
    MeasuredStep,
    Profile,
    StudyRecord,
    load_profile,
    save_profile,
)
from dsauto.refine.history import fit_history, record_study, with_study
from dsauto.refine.space import base_plans, calibrated_planner, candidates
from dsauto.refine.study import TuneResult
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec

MODEL = load_model("gpt-tiny")
TRUTH = Calibration(compute=1.5, activation_memory=0.9)


def empty_profile() -> Profile:
    """A profile without layer measurements: every layer is priced analytically."""
    return Profile(model=MODEL, device="cpu", dtype="fp32", seq_len=64, threads=1, versions={"torch": "x"},
                   layers=(), optimizer_seconds_per_param=1e-9)


def study(name: str, gpus: int, batch: int, truth: Calibration = TRUTH, contended: bool = False,
          count: int = 4) -> StudyRecord:
    cluster, train = load_cluster("cpu", nodes=1, gpus_per_node=gpus), TrainSpec(batch, 64, "fp32")
    planner = Planner(MODEL, cluster, train, profile=empty_profile())
    real = calibrated_planner(planner, truth)
    steps = []
    for candidate in candidates(planner, base_plans(planner, top_k=2))[:count]:
        measured = candidate.price(real).prediction
        steps.append(MeasuredStep(plan=candidate.plan.to_dict(), step_seconds=measured.step_seconds,
                                  peak_bytes=measured.peak_memory_bytes, other_load=2.0 if contended else 0.0,
                                  cores=2, contended=contended))
    return StudyRecord(study=name, host="h", cluster=cluster, train=train, steps=tuple(steps))


def test_a_resumed_study_replaces_its_record_and_old_steps_are_trimmed():
    a, b = study("a", 2, 8), study("b", 1, 16)
    assert [r.study for r in with_study((a, b), dataclasses.replace(a, steps=a.steps[:1]))] == ["b", "a"]
    many = tuple(dataclasses.replace(a, study=str(i)) for i in range(MAX_HISTORY_STEPS // len(a.steps) + 3))
    kept = with_study(many[:-1], many[-1])
    assert sum(len(r.steps) for r in kept) <= MAX_HISTORY_STEPS and kept[-1].study == many[-1].study


def test_the_fit_covers_every_study_each_priced_by_its_own_planner():
    history = (study("a", 2, 8), study("b", 1, 16))
    fitted = fit_history(empty_profile(), history)
    assert fitted.trials == sum(len(r.steps) for r in history)
    assert fitted.compute == pytest.approx(TRUTH.compute, rel=0.05)
    assert fitted.time_error_after < 0.02 < fitted.time_error_before


def test_steps_of_a_model_with_prediction_layers_are_priced_with_them():
    """One profile serves a model with and without its multi-token-prediction layers (the layers it
    measures are the same: store.profiled_model); a Megatron-core study of the model with them is
    priced with them, so the fit finds the truth (priced without them, the compute factor came out
    2.05 for a truth of 1.5)."""
    plain = dataclasses.replace(MODEL, name="gpt-tiny-rope", position_embedding="rope", tied_embeddings=False)
    profile = dataclasses.replace(empty_profile(), model=plain)
    mtp = dataclasses.replace(plain, mtp_layers=1)
    cluster, train = load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(8, 64, "fp32")
    planner = Planner(mtp, cluster, train, Constraints(engine="megatron"), profile=profile)
    real = calibrated_planner(planner, TRUTH)
    steps = []
    for candidate in candidates(planner, base_plans(planner, top_k=2))[:6]:
        measured = candidate.price(real).prediction
        steps.append(MeasuredStep(plan=candidate.plan.to_dict(), step_seconds=measured.step_seconds,
                                  peak_bytes=measured.peak_memory_bytes, other_load=0.0, cores=2, contended=False))
    fitted = fit_history(profile, (StudyRecord(study="mtp", host="h", cluster=cluster, train=train,
                                               steps=tuple(steps)),))
    assert fitted.compute == pytest.approx(TRUTH.compute, rel=0.05)


def test_steps_measured_under_contention_count_less():
    calm, busy = study("calm", 2, 8), study("busy", 2, 16, truth=Calibration(compute=3.0), contended=True)
    weighted = fit_history(empty_profile(), (calm, busy))
    unweighted = fit_history(empty_profile(), (calm, dataclasses.replace(
        busy, steps=tuple(dataclasses.replace(s, contended=False) for s in busy.steps))))
    assert abs(weighted.compute - 1.5) < abs(unweighted.compute - 1.5)
    assert weighted.compute < 1.8


def test_each_tune_adds_its_study_to_what_is_stored(tmp_path):
    profile = empty_profile()
    save_profile(profile, tmp_path)
    # two studies of one name in two storages (two --out folders) are two records; the same study again
    # (a resumed one, in the same storage) replaces its own
    runs = (("one", 2, 8, "sqlite:///a/dsauto-study.db"), ("one", 1, 16, "sqlite:///b/dsauto-study.db"),
            ("one", 2, 8, "sqlite:///a/dsauto-study.db"))
    for name, gpus, batch, storage in runs:
        record = study(name, gpus, batch)
        planner = Planner(MODEL, record.cluster, record.train, profile=profile)
        result = TuneResult(plan=None, records=(), calibration=Calibration(), study_name=name, storage=storage,
                            new_trials=0, space=(), winner=None, steps=record.steps)
        profile, path = record_study(tmp_path, profile, planner, result)
    stored = load_profile(path)
    names = [r.study for r in stored.history]
    assert len(set(names)) == 2 and all(name.startswith("one (") for name in names)
    assert [r.train.global_batch for r in stored.history] == [16, 8]
    assert stored.calibration.trials == sum(len(r.steps) for r in stored.history)
    assert json.loads(path.read_text())["history"][0]["steps"][0]["plan"]["model"]["name"] == "gpt-tiny"
