"""The DeepSpeed hook refuses, before DeepSpeed builds anything, a config whose keys contradict its
own plan (stage, dtype) and a ds_config.json whose set of artifacts belongs to two plans."""

from __future__ import annotations

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
from dsauto.search.space import Constraints
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec


@pytest.fixture(scope="module")
def plan():
    planner = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(4, 64, "fp32"),
                      Constraints(engine="deepspeed"))
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


def test_the_hooks_warnings_are_said_by_rank_zero_alone(tmp_path):
    """Every rank reads the same plan and config, so what the hook warns of is said once a job: by the
    launcher's rank 0, not by the others (before the process group exists, RANK, or MPI's or Slurm's
    variable, says which). Run in a fresh process: no process group of another test answers first."""
    import os
    import subprocess
    import sys

    script = tmp_path / "ranks.py"
    script.write_text("""
import os, warnings
import deepspeed
import dsauto.deepspeed
from dsauto.emit.ds_config import ds_config
from dsauto.errors import DsautoWarning
from dsauto.models import build_model
from dsauto.runtime.deepspeed import RANK_VARIABLES
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec

plan = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(4, 64, "fp32"),
               Constraints(engine="deepspeed", zero_stage=1)).search()[0]
def reached(**kwargs):
    raise RuntimeError("deepspeed.initialize was called")
deepspeed.initialize = reached
for variable, rank in (("RANK", "0"), ("RANK", "1"), ("SLURM_PROCID", "1")):
    for name in RANK_VARIABLES:
        os.environ.pop(name, None)
    os.environ[variable] = rank
    config = ds_config(plan)
    config["zero_optimization"]["overlap_comm"] = False  # not what the plan prices: a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            dsauto.deepspeed.initialize(model=build_model(plan.model), config=config)
        except RuntimeError as exc:
            assert "deepspeed.initialize was called" in str(exc)
    said = any("overlap_comm is false" in str(w.message) for w in caught if issubclass(w.category, DsautoWarning))
    print("said:", variable, rank, said)
""")
    from dsauto.runtime.deepspeed import RANK_VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in (*RANK_VARIABLES, "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    run = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    said = [line for line in run.stdout.splitlines() if line.startswith("said: ")]  # not DeepSpeed's logs
    assert said == ["said: RANK 0 True", "said: RANK 1 False", "said: SLURM_PROCID 1 False"], run.stdout
