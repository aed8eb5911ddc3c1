"""The DeepSpeed hook refuses, before DeepSpeed builds anything, a config whose keys contradict its
own plan (stage, dtype) and a ds_config.json whose set of artifacts belongs to two plans."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import deepspeed
import pytest

import dsauto.deepspeed
from dsauto.emit.artifacts import write_artifacts
from dsauto.emit.ds_config import ds_config
from dsauto.errors import DsautoError
from dsauto.models import build_model
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec


@pytest.fixture(scope="module")
def plan():
    planner = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(4, 64, "fp32"))
    return planner.search()[0]


@pytest.fixture
def no_engine(monkeypatch):
    def reached(**kwargs):
        raise AssertionError("deepspeed.initialize was called")
    monkeypatch.setattr(deepspeed, "initialize", reached)


def test_a_dtype_the_plan_does_not_train_in_is_refused(plan, no_engine):
    config = ds_config(plan)
    config["bf16"] = {"enabled": True}
    with pytest.raises(DsautoError, match="the config trains in bf16 .* but the plan in fp32"):
        dsauto.deepspeed.initialize(model=build_model(plan.model), config=config)


def test_a_stage_that_is_not_a_number_is_refused(plan, no_engine):
    config = ds_config(plan)
    config["zero_optimization"]["stage"] = "three"
    with pytest.raises(DsautoError, match="zero_optimization.stage is 'three'"):
        dsauto.deepspeed.initialize(model=build_model(plan.model), config=config)


def test_a_mixed_set_is_refused(plan, tmp_path, no_engine):
    out = tmp_path / "out"
    write_artifacts(plan, out)
    old = (out / "plan.yaml").read_text()
    write_artifacts(replace(plan, reduce_bucket_bytes=plan.reduce_bucket_bytes * 2), out)
    (out / "plan.yaml").write_text(old)
    with pytest.raises(DsautoError, match="belong to different plans"):
        dsauto.deepspeed.initialize(model=build_model(plan.model), config=str(out / "ds_config.json"))
    assert json.loads((out / "ds_config.json").read_text())["dsauto"]["reduce_bucket_bytes"] == plan.reduce_bucket_bytes * 2


def test_the_hooks_warnings_are_said_by_rank_zero_alone(plan, no_engine, monkeypatch):
    """Every rank reads the same plan and config, so what the hook warns of is said once a job: by the
    launcher's rank 0, not by the others (before the process group exists, RANK says which)."""
    import warnings

    from dsauto.errors import DsautoWarning

    config = ds_config(plan)
    config["zero_optimization"]["overlap_comm"] = False  # not what the plan prices: a warning
    for rank, warned in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(AssertionError, match="deepspeed.initialize was called"):
                dsauto.deepspeed.initialize(model=build_model(plan.model), config=copy.deepcopy(config))
        said = [str(w.message) for w in caught if issubclass(w.category, DsautoWarning)]
        assert any("overlap_comm is false" in text for text in said) == warned, (rank, said)
