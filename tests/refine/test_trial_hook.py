"""The trial hook: requests round-trip and fail clearly; a user's script, launched on 2 ranks with
``DSAUTO_TRIAL`` set, runs the trial's config, measures its steps and stops after them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.emit.ds_config import ds_config
from dsauto.errors import DsautoError
from dsauto.parallel import ParallelDims
from dsauto.plan import Plan
from dsauto.profile.launch import free_port
from dsauto.profile.memory import MemoryTracker
from dsauto.profile.steps import StepMeasurement
from dsauto.refine.trial_hook import (
    TRIAL_ENV,
    TrialRequest,
    read_request,
    requested_trial,
    write_request,
)
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec

from guarded_run import guarded_run  # tests/ is on sys.path through its conftest

ROOT = Path(__file__).resolve().parents[2]
MB = 1_000_000


def test_request_round_trips(tmp_path):
    request = TrialRequest(config={"train_batch_size": 8, "dsauto": {"dp": 2}}, out=str(tmp_path / "m.json"),
                           steps=3, warmup_steps=0, memory_steps=1)
    write_request(request, tmp_path / "request.json")
    assert read_request(tmp_path / "request.json") == request
    assert not list(tmp_path.glob("*.tmp"))


def test_requested_trial_reads_the_file_named_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(TRIAL_ENV, raising=False)
    assert requested_trial() is None
    request = TrialRequest(config={"train_batch_size": 2}, out="m.json")
    write_request(request, tmp_path / "request.json")
    monkeypatch.setenv(TRIAL_ENV, str(tmp_path / "request.json"))
    assert requested_trial() == request


@pytest.mark.parametrize("text, problem", [
    (None, "Cannot read"),
    ("{not json", "is not valid JSON"),
    ('["config", "out"]', "must be a mapping"),
    ('{"config": {}}', "missing the required key 'out'"),
    ('{"config": {}, "out": "m.json", "step": 3}', "unknown key(s) 'step'"),
    ('{"config": [], "out": "m.json"}', "config must be a mapping"),
    ('{"config": {}, "out": "m.json", "steps": "five"}', "steps must be a whole number"),
    ('{"config": {}, "out": "m.json", "steps": 0}', "steps (0) and memory_steps (2) must be at least 1"),
])
def test_a_bad_request_is_one_sentence_naming_the_file(tmp_path, text, problem):
    path = tmp_path / "request.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(DsautoError) as error:
        read_request(path)
    message = str(error.value)
    assert str(path) in message and problem in message, message
    assert "\n" not in message


def test_adopted_tensors_count_once_until_freed():
    old = torch.empty(4 * MB, dtype=torch.uint8)
    with MemoryTracker() as tracker:
        tracker.adopt([old, old[MB:], old.view(2, -1)])  # one storage, three tensors
        with tracker.region("with"):
            new = torch.empty(1 * MB, dtype=torch.uint8)
        del old  # the weak reference notices the free
        with tracker.region("after"):
            pass
    assert tracker.peak_bytes("with") == 5 * MB
    assert tracker.peak_bytes("after") == 1 * MB
    assert tracker.final_bytes() == 1 * MB
    del new


def test_adopting_a_tracked_tensor_does_not_count_it_twice():
    with MemoryTracker() as tracker:
        t = torch.empty(2 * MB, dtype=torch.uint8)
        tracker.adopt([t])
    assert tracker.peak_bytes() == 2 * MB
    del t


# --- the hook in a real DeepSpeed script ----------------------------------------------------------

MEMORY_STEPS, WARMUP_STEPS, TIMED_STEPS = 2, 1, 3  # 2 memory steps, as dsauto.profile.steps measures
SCRIPT_CONFIG = {  # what the script is given: ZeRO-2, micro-batch 1, no accumulation, no plan
    "train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
}
NUM_PARAMS = load_model("gpt-tiny").num_parameters()


def trial_plan() -> Plan:
    """The trial: gpt-tiny on 2 CPU ranks under ZeRO-0, micro-batch 2, 2 micro-batches per step.

    ZeRO-0 leaves the parameters where the script built them (ZeRO-1/2 copy them into flat buffers
    and ZeRO-3 into partitions, both made under the tracker), so only adopting them counts them."""
    planner = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2),
                      TrainSpec(global_batch=8, seq_len=64, dtype="fp32"))
    strategy = Strategy(dims=ParallelDims(dp=2, tp=1, pp=1), zero_stage=0, micro_batch=2, grad_accum=2, sequence_parallel=False)
    return planner.build_plan(strategy, [4], [LayerOption(checkpoint=False, shard_params=False, split=1)] * 6)


def deepspeed_launch(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Runs ``args`` on 2 CPU ranks with DeepSpeed's launcher, from the repository root, under dsauto's
    launch guard (tests/guarded_run.py)."""
    port = free_port()
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--include", "localhost:0,1",
               "--master_port", str(port), *args]
    return guarded_run(command, {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1", **env}, port,
                       cwd=ROOT)


@pytest.fixture(scope="module")
def trial(tmp_path_factory) -> dict:
    """examples/deepspeed/train_gpt.py given a ZeRO-2 config and 1000 steps, run as a ZeRO-0 trial."""
    tmp = tmp_path_factory.mktemp("trial")
    script_config, request, out = tmp / "script_config.json", tmp / "request.json", tmp / "measured.json"
    script_config.write_text(json.dumps(SCRIPT_CONFIG))
    write_request(TrialRequest(config=ds_config(trial_plan()), out=str(out), steps=TIMED_STEPS,
                               warmup_steps=WARMUP_STEPS, memory_steps=MEMORY_STEPS), request)
    run = deepspeed_launch([str(ROOT / "examples" / "deepspeed" / "train_gpt.py"), "--deepspeed_config",
                            str(script_config), "--steps", "1000"], {TRIAL_ENV: str(request)})
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0, log
    return {"stdout": run.stdout, "log": log,
            "measured": StepMeasurement(**json.loads(out.read_text())) if out.exists() else None}


@pytest.mark.slow
def test_the_script_runs_the_trial_config_and_stops_after_its_steps(trial):
    stdout, log = trial["stdout"], trial["log"]
    # The trial's config ran, not the script's ZeRO-2 with micro-batch 1 and no accumulation.
    assert "dsauto trial: ZeRO stage 0, micro-batch 2, 2 micro-batches per step, 2 ranks" in stdout, log
    # The script stopped inside the trial's last step: it printed the steps before it, and no more.
    printed = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(printed) == MEMORY_STEPS + WARMUP_STEPS + TIMED_STEPS - 1, log


@pytest.mark.slow
def test_the_trial_writes_its_measurement(trial):
    measured = trial["measured"]
    assert measured is not None, trial["log"]
    assert len(measured.step_seconds_samples) == TIMED_STEPS
    assert all(t > 0 for t in measured.step_seconds_samples) and measured.step_seconds > 0
    assert len(measured.losses) == TIMED_STEPS and all(0 < loss < 20 for loss in measured.losses)
    assert measured.peak_bytes > measured.static_bytes > 4 * NUM_PARAMS
    # Between steps ZeRO-0 holds the parameters (fp32: 4 bytes per parameter) and the AdamW moments
    # (8), 12 bytes per parameter: the parameters, built by the script before initialize, count
    # (without them: 8). The script's ZeRO-2 over 2 ranks would hold 4 + 2 (half the fp32 master
    # copy) + 4 (half the moments) = 10. Gradients are freed after the step in both.
    assert 11.5 * NUM_PARAMS < measured.static_bytes < 12.5 * NUM_PARAMS, measured


@pytest.mark.slow
def test_the_trial_measures_the_memory_the_built_in_harness_measures(trial, tmp_path):
    """dsauto.profile.steps builds the model under the tracker; the hook adopts the script's model.
    Same plan, same batch shapes: the same bytes, up to the script's few loss tensors (a ZeRO-0
    step's memory does not depend on timing; ZeRO-1/2's overlap_comm moves the peak by ~1%)."""
    plans = tmp_path / "plans.json"
    plans.write_text(json.dumps([trial_plan().to_dict()]))
    run = deepspeed_launch(["--module", "dsauto.profile.steps", "--plans", str(plans), "--out",
                            str(tmp_path / "steps.json"), "--steps", "1", "--warmup", "0"], {})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    harness = StepMeasurement(**json.loads((tmp_path / "steps.json").read_text())[0])
    measured = trial["measured"]
    assert measured.static_bytes == pytest.approx(harness.static_bytes, rel=1e-3)
    assert measured.peak_bytes == pytest.approx(harness.peak_bytes, rel=1e-3)


def pipeline_trial_plan() -> Plan:
    """A DeepSpeed pipeline trial: gpt-tiny (tied embeddings) cut 3 + 1 over the 2 ranks, ZeRO-0,
    micro-batch 2, 4 micro-batches per step, layer 2 checkpointed."""
    planner = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2),
                      TrainSpec(global_batch=8, seq_len=64, dtype="fp32"))
    strategy = Strategy(dims=ParallelDims(dp=1, tp=1, pp=2), zero_stage=0, micro_batch=2, grad_accum=4,
                        sequence_parallel=False)
    plain, checkpointed = (LayerOption(checkpoint=c, shard_params=False, split=1) for c in (False, True))
    return planner.build_plan(strategy, [3, 1], [plain, plain, checkpointed, plain, plain, plain])


@pytest.mark.slow
def test_a_pipeline_trial_runs_through_the_script_and_measures_what_the_harness_does(tmp_path):
    """The script is given a data-parallel config; the trial is a pipeline plan: the example builds
    its PipelineModule with dsauto.deepspeed.pipeline_module, which cuts it for the trial's plan, and
    the hook counts the engine's train_batch() steps. Memory as the built-in harness measures it."""
    script_config, request, out = tmp_path / "script_config.json", tmp_path / "request.json", tmp_path / "m.json"
    script_config.write_text(json.dumps(SCRIPT_CONFIG))
    plan = pipeline_trial_plan()
    write_request(TrialRequest(config=ds_config(plan), out=str(out), steps=TIMED_STEPS, warmup_steps=WARMUP_STEPS,
                               memory_steps=MEMORY_STEPS), request)
    run = deepspeed_launch([str(ROOT / "examples" / "deepspeed" / "train_gpt.py"), "--deepspeed_config",
                            str(script_config), "--steps", "1000"], {TRIAL_ENV: str(request)})
    log = run.stdout[-4000:] + run.stderr[-4000:]
    assert run.returncode == 0 and out.exists(), log
    assert "dsauto trial: ZeRO stage 0, micro-batch 2, 4 micro-batches per step, 2 ranks" in run.stdout, log
    measured = StepMeasurement(**json.loads(out.read_text()))
    assert len(measured.step_seconds_samples) == TIMED_STEPS and len(measured.losses) == TIMED_STEPS
    assert all(0 < loss < 20 for loss in measured.losses)

    plans = tmp_path / "plans.json"
    plans.write_text(json.dumps([plan.to_dict()]))
    harness_run = deepspeed_launch(["--module", "dsauto.profile.steps", "--plans", str(plans), "--out",
                                    str(tmp_path / "steps.json"), "--steps", "1", "--warmup", "0"], {})
    assert harness_run.returncode == 0, harness_run.stdout[-4000:] + harness_run.stderr[-4000:]
    harness = StepMeasurement(**json.loads((tmp_path / "steps.json").read_text())[0])
    assert measured.static_bytes == pytest.approx(harness.static_bytes, rel=1e-3)
    assert measured.peak_bytes == pytest.approx(harness.peak_bytes, rel=1e-2)
    # And the plan's prediction of that peak (the last stage holds the tied table's copy).
    assert plan.prediction.peak_memory_bytes == pytest.approx(measured.peak_bytes, rel=0.03)
