"""Megatron-core trials: the space of model-parallel plans, and real trials of tensor- and pipeline-parallel
plans on two CPU ranks (the built-in harness, a user's Megatron-core script, a crash)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution

from dsauto.engines.megatron import block_recompute_layers
from dsauto.errors import DsautoError
from dsauto.profile.launch import free_port
from dsauto.refine.runner import TrialSettings, run_trial
from dsauto.refine.sampler import PEAK, STATUS, STEP, CostModelSampler, layout_of
from dsauto.refine.space import base_plans, candidates
from dsauto.refine.study import TuneSettings, check_trials, trial_pins
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "megatron" / "train_gpt.py"
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def planner(**pins) -> Planner:
    return Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(8, 64, "fp32"),
                   trial_pins(Constraints(**pins)))


def test_trials_take_megatron_and_its_model_parallel_pins():
    settings = TuneSettings(trials=2)
    check_trials(planner(engine="megatron", tp=2), settings)
    assert trial_pins(Constraints(tp=2)).engine == "megatron"  # only Megatron-core trials run tp > 1
    assert trial_pins(Constraints(pp=2, engine="megatron")).pp == 2
    assert trial_pins(Constraints()) == Constraints(tp=1, pp=1, engine="deepspeed")  # as before
    # DeepSpeed's pipeline engine, pinned, is measured as it is; tensor parallelism is not DeepSpeed's.
    assert trial_pins(Constraints(pp=2, engine="deepspeed")) == Constraints(tp=1, pp=2, engine="deepspeed")
    check_trials(planner(engine="deepspeed", pp=2), settings)
    with pytest.raises(DsautoError, match=r"--tp 2 was pinned with --engine deepspeed; use --engine megatron"):
        check_trials(Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2),
                             TrainSpec(8, 64, "fp32"), Constraints(tp=2, engine="deepspeed")), settings)


def test_the_megatron_space_has_every_layout_and_only_megatron_knobs():
    p = planner(engine="megatron")
    plans = base_plans(p, 2)
    assert {(plan.tp, plan.pp) for plan in plans} == {(1, 1), (2, 1), (1, 2)}
    assert all(plan.engine == "megatron" and plan.zero_stage < 2 for plan in plans)  # no Megatron-FSDP on CPU
    space = candidates(p, plans)
    for c in space:
        assert c.knobs.prefetch_scale is None
        assert (c.knobs.bucket_scale is not None) == (c.plan.dp > 1)  # Megatron's DDP buckets, any ZeRO stage
        # Megatron recomputes the first N layers of every stage (every chunk): nothing else is proposed.
        assert block_recompute_layers(c.plan) is not None
    assert any(c.plan.checkpointed_layers() for c in space)
    # The sampler measures each layout once, fastest predicted first, before expected improvement.
    sampler = CostModelSampler(space, p)
    study = optuna.create_study(sampler=sampler)
    layouts = []
    for _ in range(3):
        pick = sampler.propose(study)
        layouts.append(layout_of(pick))
        params = pick.knobs.params()
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={k: CategoricalDistribution([v]) for k, v in params.items()},
            value=pick.plan.prediction.step_seconds,
            user_attrs={STATUS: "complete", STEP: pick.plan.prediction.step_seconds,
                        PEAK: pick.plan.prediction.peak_memory_bytes}))
    assert layouts[0] == (1, 1) and sorted(layouts) == [(1, 1), (1, 2), (2, 1)]


def test_a_plan_that_crashed_is_not_tried_again_with_other_knobs():
    p = planner(engine="megatron")
    space = candidates(p, base_plans(p, 2))
    sampler = CostModelSampler(space, p)
    study = optuna.create_study(sampler=sampler)
    first = sampler.propose(study)
    params = first.knobs.params()
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions={k: CategoricalDistribution([v]) for k, v in params.items()},
        state=optuna.trial.TrialState.FAIL,
        user_attrs={STATUS: "failed", "reason": "crashed: DsautoError: cannot run this here"}))
    assert sum(c.knobs.plan == first.knobs.plan for c in space) > 1  # it has siblings
    for _ in range(4):
        pick = sampler.propose(study)
        if pick is None:
            break
        assert pick.knobs.plan != first.knobs.plan
        params = pick.knobs.params()
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={k: CategoricalDistribution([v]) for k, v in params.items()},
            value=1.0, user_attrs={STATUS: "complete", STEP: 1.0, PEAK: pick.plan.prediction.peak_memory_bytes}))


def _tune(out: Path, profiles: Path, trials: int) -> subprocess.CompletedProcess:
    # A quick one-process profile (layers at tp 1 and 2), so that the tune does not profile on two ranks.
    from dsauto.cli import main

    assert main(["profile", "--model", "gpt-tiny", "--out", str(profiles), "--micro-batches", "1,2,4,8", "--tp", "1,2",
                 "--warmup", "1", "--repeats", "1", "--seq-len", "64"]) == 0
    command = [sys.executable, "-m", "dsauto.cli", "tune", "--model", "gpt-tiny", "--hardware", "cpu", "--nodes", "1",
               "--gpus-per-node", "2", "--seq-len", "64", "--global-batch", "8", "--trials", str(trials),
               "--engine", "megatron", "--trial-steps", "1", "--trial-warmup", "0", "--trial-timeout", "600",
               "--out", str(out), "--profile", str(profiles)]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=1200)


@pytest.mark.slow
def test_megatron_trials_measure_tp_and_pp_plans_and_the_example_trains_the_winner(tmp_path):
    out = tmp_path / "out"
    tune = _tune(out, tmp_path / "profiles", 2)
    assert tune.returncode == 0, tune.stderr[-3000:]
    rows = (out / "trials.csv").read_text().splitlines()
    measured = [row for row in rows[1:] if ",complete," in row]
    # The best predicted plan first, then the fastest of another layout: a tp=2 or pp=2 plan.
    assert len(measured) == 2 and any("tp2pp1" in row or "tp1pp2" in row for row in measured), rows
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    assert plan["engine"] == "megatron" and plan["measured"]["step_seconds"] > 0
    port = free_port()  # with port 0 the ranks would not find each other
    train = subprocess.run(["torchrun", "--nproc_per_node", "2", "--master_port", str(port), str(EXAMPLE), "--plan",
                            str(out / "plan.yaml"), "--steps", "2"], capture_output=True, text=True, env=ENV,
                           timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "step 2 loss" in train.stdout


@pytest.mark.slow
def test_a_megatron_script_trial_measures_the_trials_plan(tmp_path):
    plan = planner(engine="megatron", tp=2).search()[0]
    settings = TrialSettings(steps=2, warmup_steps=0, memory_steps=1, timeout_seconds=600, script=str(EXAMPLE),
                             script_args=("--plan", "not-read.yaml", "--steps", "50"), launcher="torchrun")
    outcome = run_trial(plan, 2, settings, tmp_path / "t")
    assert outcome.status == "complete", outcome.reason + Path(outcome.log).read_text()[-3000:]
    m = outcome.measurement
    assert len(m.step_seconds_samples) == 2 and m.step_seconds > 0
    # The fp32 weights of a tensor-parallel half of the model, at least.
    assert m.peak_bytes > plan.model.num_parameters() * 4 / 2
    log = Path(outcome.log).read_text()
    assert "dp 1 x tp 2 x pp 1" in log and "step 3 loss" not in log  # the trial's plan, ended after its steps


def test_a_crash_in_a_megatron_trial_fails_it_with_its_error_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import dsauto.megatron as dm\n"
                      "plan = dm.load_plan('not-read.yaml')\n"
                      "raise RuntimeError(f'boom at tp {plan.tp}')\n")
    plan = planner(engine="megatron", tp=2).search()[0]
    outcome = run_trial(plan, 2, TrialSettings(script=str(script), launcher="torchrun", timeout_seconds=300),
                        tmp_path / "t")
    assert outcome.status == "failed" and outcome.reason == "crashed: RuntimeError: boom at tp 2"


@pytest.mark.slow
def test_a_megatron_trial_trains_the_prediction_layer_on_the_last_stage(tmp_path):
    """A model with a multi-token-prediction layer (rotary positions, an untied head) measured by the
    built-in harness on two pipeline stages: Megatron-core builds the layer on the last stage
    (dm.mtp_block_spec; dm.model_chunks refuses a chunk without it) and trains it, and the measured
    peak is within 10% of the priced one (measured 19,763,816 bytes against 18,704,384 priced, on the
    first stage; the harness measures the same model without the layer 6.6% above its price too)."""
    import dataclasses

    model = dataclasses.replace(load_model("gpt-tiny"), name="gpt-tiny-mtp", position_embedding="rope",
                                tied_embeddings=False, mtp_layers=1)
    plan = Planner(model, load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(8, 64, "fp32"),
                   trial_pins(Constraints(engine="megatron", pp=2))).search()[0]
    assert plan.pp == 2 and plan.model.mtp_layers == 1
    outcome = run_trial(plan, 2, TrialSettings(steps=2, warmup_steps=0, memory_steps=1, timeout_seconds=600),
                        tmp_path / "t")
    assert outcome.status == "complete", outcome.reason + Path(outcome.log).read_text()[-3000:]
    measured, predicted = outcome.measurement.peak_bytes, plan.prediction.peak_memory_bytes
    assert abs(predicted - measured) / measured <= 0.1, (predicted, measured)
