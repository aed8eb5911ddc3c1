"""A profile store survives what goes wrong around it: a corrupt file is skipped (never measured
again and again), and an update builds on what is on disk now, so no tune erases another's steps."""

from __future__ import annotations

import dataclasses

import pytest

from dsauto.cost.calibration import Calibration
from dsauto.errors import DsautoError
from dsauto.profile.store import (
    NoMatchingProfile,
    Profile,
    StudyRecord,
    find_profile,
    load_profile,
    save_profile,
    software_versions,
    update_profile,
)
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec


@pytest.fixture
def profile():
    return Profile(model=load_model("gpt-tiny"), device="cpu", dtype="fp32", seq_len=64, threads=1,
                   versions=software_versions(), layers=(), optimizer_seconds_per_param=1e-9)


def test_a_corrupt_file_beside_the_profile_is_skipped(tmp_path, profile):
    save_profile(profile, tmp_path)
    (tmp_path / "broken.json").write_text('{"model": ')
    assert find_profile(tmp_path, profile.model, "fp32", 64) == profile
    with pytest.raises(NoMatchingProfile, match=r"found: gpt-tiny fp32 seq 64 \(\w+'s layers\); unreadable, skipped: broken.json"):
        find_profile(tmp_path, profile.model, "fp32", 128)


def test_a_nan_in_a_profile_is_refused(tmp_path, profile):
    path = save_profile(profile, tmp_path)
    path.write_text(path.read_text().replace('"optimizer_seconds_per_param": 1e-09', '"optimizer_seconds_per_param": NaN'))
    with pytest.raises(DsautoError, match="optimizer_seconds_per_param must be a finite number, got nan"):
        load_profile(path)


def test_an_update_builds_on_what_is_stored_now(tmp_path, profile):
    save_profile(profile, tmp_path)
    record = StudyRecord(study="other tune", host="h", cluster=load_cluster("cpu"), train=TrainSpec(8, 64, "fp32"),
                         steps=())
    # Another tune stored its study after this one read the profile ...
    update_profile(tmp_path, profile, lambda stored: dataclasses.replace(stored, history=(record,)))
    # ... so this one's update starts from the stored history, not from its own stale copy.
    updated, path = update_profile(tmp_path, profile, lambda stored: dataclasses.replace(
        stored, calibration=Calibration(compute=1.2)))
    assert load_profile(path).history == (record,) and updated.calibration.compute == 1.2
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no lock or temporary file left
