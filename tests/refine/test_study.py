"""Trials for real: the built-in harness on two ranks, failures with their reasons, a tune that is
killed mid-trial and resumed without losing or repeating a finished trial, and "machines" sharing one
study in SQLite and in a real PostgreSQL server (the ``postgres_url`` fixture of conftest.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

from dsauto.refine.runner import TrialSettings, run_trial
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec

ROOT = Path(__file__).resolve().parents[2]


def tiny_plan():
    planner = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(4, 64, "fp32"))
    return planner.search()[0]


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(body)
    return str(path)


def test_a_crash_fails_the_trial_with_its_error_line(tmp_path):
    settings = TrialSettings(script=script(tmp_path, "raise RuntimeError('boom: 3 != 4')\n"), timeout_seconds=120)
    outcome = run_trial(tiny_plan(), 1, settings, tmp_path / "t")
    assert outcome.status == "failed"
    assert outcome.reason == "crashed: RuntimeError: boom: 3 != 4"
    assert outcome.measurement is None and Path(outcome.log).exists()


def test_a_hang_is_killed_at_the_timeout(tmp_path):
    settings = TrialSettings(script=script(tmp_path, "import time\ntime.sleep(600)\n"), timeout_seconds=3)
    started = time.perf_counter()
    outcome = run_trial(tiny_plan(), 1, settings, tmp_path / "t")
    assert outcome.status == "failed" and outcome.reason == "hung: no result after 3 s"
    assert time.perf_counter() - started < 30


def test_out_of_memory_is_named(tmp_path):
    body = "import torch\nraise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
    outcome = run_trial(tiny_plan(), 1, TrialSettings(script=script(tmp_path, body)), tmp_path / "t")
    assert outcome.status == "failed" and outcome.reason == "out of memory"


def test_a_result_written_before_a_teardown_abort_stands(tmp_path):
    body = (
        "import json, os\n"
        "from dsauto.profile.steps import StepMeasurement\n"
        "from dsauto.refine.trial_hook import requested_trial\n"
        "from dsauto.serde import to_dict\n"
        "request = requested_trial()\n"
        "m = StepMeasurement(0.5, (0.5,), 1000, 500, ())\n"
        "open(request.out, 'w').write(json.dumps(to_dict(m)))\n"
        "os.abort()  # as gloo sometimes does at exit\n"
    )
    outcome = run_trial(tiny_plan(), 1, TrialSettings(script=script(tmp_path, body)), tmp_path / "t")
    assert outcome.status == "complete" and outcome.measurement.step_seconds == 0.5
    assert "exited with code" in Path(outcome.log).read_text()


@pytest.mark.slow
def test_built_in_harness_measures_and_judges_the_budget(tmp_path):
    plan = tiny_plan()
    settings = TrialSettings(steps=2, warmup_steps=0, memory_steps=1, timeout_seconds=300)
    outcome = run_trial(plan, 2, settings, tmp_path / "t")
    assert outcome.status == "complete", outcome.reason
    m = outcome.measurement
    assert len(m.step_seconds_samples) == 2 and m.step_seconds > 0
    assert m.peak_bytes > plan.model.num_parameters() * 4  # at least the fp32 weights
    over = run_trial(plan, 2, settings, tmp_path / "u", budget_bytes=m.peak_bytes // 2)
    assert over.status == "infeasible" and "over the" in over.reason


def _tune(tmp_path: Path, trials: int) -> list[str]:
    return [sys.executable, "-m", "dsauto.cli", "tune", "--model", "gpt-tiny", "--hardware", "cpu", "--nodes", "1",
            "--gpus-per-node", "2", "--seq-len", "64", "--trials", str(trials), "--trial-steps", "1",
            "--trial-warmup", "0", "--trial-timeout", "900", "--out", str(tmp_path / "out"),
            "--profile-dir", str(tmp_path / "profiles")]


def _trials(tmp_path: Path) -> list[optuna.trial.FrozenTrial]:
    return _study_trials(f"sqlite:///{tmp_path / 'out' / 'dsauto-study.db'}")


def _study_trials(storage: str) -> list[optuna.trial.FrozenTrial]:
    """Every trial of the one study in ``storage``."""
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage).get_trials()


def _finished(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    return [t for t in trials if t.user_attrs.get("status") in ("complete", "infeasible", "failed")]


@pytest.mark.slow
def test_a_killed_tune_resumes_without_losing_or_repeating_finished_trials(tmp_path):
    env = MACHINE_ENV
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(_tune(tmp_path, 3), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    # Wait until one trial has finished and the next one is running, then stop the tune. No wall-clock
    # deadline (a loaded machine is slow, not wrong): the tune ends on its own if it never gets
    # there (each trial has --trial-timeout), and that fails the test.
    while first.poll() is None:
        time.sleep(1)
        text = (tmp_path / "first.log").read_text()
        if text.count("complete:") >= 1 and "trial 1 (2/3)" in text:
            break
    else:
        pytest.fail("the tune ended before its second trial: " + (tmp_path / "first.log").read_text()[-2000:])
    time.sleep(2)  # into trial 1's launch
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 130
    before = _trials(tmp_path)
    finished_before = {t.number: (t.params, t.value) for t in before if t.user_attrs.get("status") == "complete"}
    assert len(finished_before) == 1
    assert any(t.user_attrs.get("status") == "interrupted" for t in before)

    second = subprocess.run(_tune(tmp_path, 3), capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    after = _trials(tmp_path)
    finished = _finished(after)
    assert len(finished) == 3
    for number, (params, value) in finished_before.items():  # kept as it was, not measured again
        assert after[number].params == params and after[number].value == value
    keys = [json.dumps(t.params, sort_keys=True) for t in finished]
    assert len(set(keys)) == 3  # no candidate measured twice
    assert "resuming study" in second.stderr and "trial 1 was cut off" not in second.stderr  # SIGTERM marked it

    out = tmp_path / "out"
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    assert plan["measured"]["step_seconds"] > 0 and plan["measured"]["trial"] in [t.number for t in finished]
    assert (out / "trials.csv").read_text().count("\n") == len(after) + 1
    assert (out / "trials.png").stat().st_size > 0 and (out / "ds_config.json").exists()
    (profile,) = (tmp_path / "profiles").glob("*.json")
    assert json.loads(profile.read_text())["calibration"]["trials"] >= 3

    # A third run with the budget spent measures nothing and writes the same winner.
    third = subprocess.run(_tune(tmp_path, 3), capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert third.returncode == 0 and "(0 run now)" in third.stdout
    assert yaml.safe_load((out / "plan.yaml").read_text())["measured"] == plan["measured"]


MACHINE_ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _profile_for_machines(tmp_path: Path) -> None:
    """One profile the "machines" of a shared study all read (so none of them profiles)."""
    profile = subprocess.run([sys.executable, "-m", "dsauto.cli", "profile", "--model", "gpt-tiny", "--seq-len", "64",
                              "--tp", "1", "--micro-batches", "1,2,4", "--out", str(tmp_path / "profiles")],
                             capture_output=True, text=True, env=MACHINE_ENV, timeout=300)
    assert profile.returncode == 0, profile.stderr[-2000:]


def _machine(tmp_path: Path, name: str, storage: str, trials: int, log: Path | None = None,
             ranks: int = 1) -> subprocess.Popen:
    """A tune of gpt-tiny on ``ranks`` CPU ranks into ``tmp_path/name`` that stands for one machine
    sharing ``storage``; its output is piped, or written to ``log``."""
    command = [sys.executable, "-m", "dsauto.cli", "tune", "--model", "gpt-tiny", "--hardware", "cpu",
               "--gpus-per-node", str(ranks), "--seq-len", "64", "--global-batch", "8", "--trials", str(trials),
               "--trial-steps", "1", "--trial-warmup", "0", "--trial-timeout", "900", "--storage", storage,
               "--out", str(tmp_path / name), "--profile", str(tmp_path / "profiles")]
    if log is None:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=MACHINE_ENV)
    with open(log, "w") as output:
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=MACHINE_ENV)


@pytest.mark.slow
def test_two_machines_share_one_study_without_measuring_a_candidate_twice(tmp_path):
    # Two tunes at once on one storage stand for two machines (one rank each, to fit this machine).
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    _profile_for_machines(tmp_path)
    machines = [_machine(tmp_path, "a", storage, 4), _machine(tmp_path, "b", storage, 4)]
    outputs = [m.communicate(timeout=600)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    finished = _finished(_study_trials(storage))
    # The budget is shared (a machine may start one as the other ends); on one rank the space is small
    # and the sampler may rightly stop before the budget, once nothing left is likely to beat the best.
    stopped = any("no candidate left" in out for out in outputs)
    assert len(finished) <= 5 and (len(finished) >= 4 or stopped), outputs[0][-2000:] + outputs[1][-2000:]
    keys = [json.dumps(t.params, sort_keys=True) for t in finished]
    assert len(set(keys)) == len(keys)
    assert all(re.search(r"trial \d+ \(\d/4\)", out) for out in outputs)  # both machines measured


OUTCOME = re.compile(r"^  (complete|infeasible|failed): ", re.MULTILINE)
"""A line of a tune's output that reports a finished trial."""


@pytest.mark.slow
def test_machines_share_a_postgresql_study_and_a_killed_one_loses_nothing(tmp_path, postgres_url):
    # The several-machines story against a real database server: two tunes share the study at once,
    # one is killed (SIGKILL: no chance to mark its trial) in the middle of a trial, the other goes on
    # to the budget, and a later tune on the killed one's machine frees its trial and resumes. Two
    # ranks per machine, so that the space has reduction-bucket siblings the sampler keeps proposing
    # (on one rank it may rightly stop after two trials).
    _profile_for_machines(tmp_path)
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}
    a, b = (_machine(tmp_path, name, postgres_url, 3, log, ranks=2) for name, log in logs.items())
    # No wall-clock deadline (a loaded machine is slow, not wrong): "a" ends on its own if it never
    # gets into a second trial (each trial has --trial-timeout), and that fails the test.
    while a.poll() is None:
        time.sleep(0.5)
        text = logs["a"].read_text()
        first = OUTCOME.search(text)
        if first and re.search(r"^trial \d+ ", text[first.end():], re.MULTILINE):
            break
    else:
        b.kill()
        pytest.fail("machine a ended before its second trial: " + logs["a"].read_text()[-2000:])
    time.sleep(2)  # into the trial's launch
    a.kill()
    a.wait(timeout=60)
    assert b.wait(timeout=600) == 0, logs["b"].read_text()[-3000:]

    trials = _study_trials(postgres_url)
    finished = _finished(trials)
    reported = sum(len(OUTCOME.findall(log.read_text())) for log in logs.values())
    assert len(finished) == reported == 3  # every measured trial recorded, the budget shared
    keys = [json.dumps(t.params, sort_keys=True) for t in finished]
    assert len(set(keys)) == len(keys)  # no candidate measured twice
    (cut_off,) = [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert cut_off.user_attrs["pid"] == a.pid and "status" not in cut_off.user_attrs

    # A later tune on the killed machine asks for one trial more (--trials is the study's total).
    later = _machine(tmp_path, "a", postgres_url, 4, ranks=2)
    output = later.communicate(timeout=600)[0]
    assert later.returncode == 0, output[-3000:]
    assert f"trial {cut_off.number} was cut off by an earlier run" in output and "resuming study" in output
    after = {t.number: t for t in _study_trials(postgres_url)}
    assert after[cut_off.number].user_attrs["status"] == "interrupted"
    assert after[cut_off.number].state == optuna.trial.TrialState.FAIL
    for t in finished:  # kept as they were
        assert after[t.number].params == t.params and after[t.number].value == t.value
        assert after[t.number].user_attrs == t.user_attrs
    now_finished = _finished(list(after.values()))
    assert len(now_finished) == 4
    assert len({json.dumps(t.params, sort_keys=True) for t in now_finished}) == 4


def _open_study(url: str, barrier, results) -> None:
    from dsauto.refine.study import open_storage

    barrier.wait()
    try:
        optuna.create_study(storage=open_storage(url), study_name="shared", load_if_exists=True)
        results.put("opened")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(repr(exc))


def test_machines_that_open_a_new_postgresql_storage_at_once_all_get_it(postgres_url):
    # PostgreSQL reports the race to create the schema as a unique violation (SQLite serializes it).
    from dsauto.refine.study import open_storage  # noqa: F401 - imported before forking, not in each child

    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(4), context.Queue()
    machines = [context.Process(target=_open_study, args=(postgres_url, barrier, results)) for _ in range(4)]
    for m in machines:
        m.start()
    outcomes = [results.get(timeout=120) for _ in machines]
    for m in machines:
        m.join(timeout=60)
    assert outcomes == ["opened"] * 4
    assert [s.study_name for s in optuna.get_all_study_summaries(postgres_url)] == ["shared"]


def test_a_storage_that_cannot_be_opened_is_one_sentence():
    from dsauto.errors import DsautoError
    from dsauto.refine.study import open_storage

    with pytest.raises(DsautoError, match=r"^Cannot open the study storage nosuchdb://x: .*; pass an Optuna RDB URL"):
        open_storage("nosuchdb://x")
    for memory in ("sqlite:///", "sqlite://", "sqlite:///:memory:"):  # the study would be gone at exit
        with pytest.raises(DsautoError, match=r"is a database in memory, gone when dsauto exits"):
            open_storage(memory)


def test_a_missing_database_driver_names_the_extra(monkeypatch):
    from dsauto.errors import DsautoError
    from dsauto.refine.study import open_storage

    monkeypatch.setitem(sys.modules, "psycopg", None)  # as where psycopg is not installed
    with pytest.raises(DsautoError, match=r"driver is not installed .*install dsauto\[postgres\]"):
        open_storage("postgresql://dsauto@127.0.0.1:1/study", attempts=1)


def test_a_winner_chosen_among_trials_measured_under_contention_is_said_to_be():
    """A trial measured while other processes kept the CPU busy ran slower than it runs: where the
    winner was chosen among such trials, the sentence names them; measured alike, nothing is said."""
    from dsauto.refine.study import CONTENDED, contended_comparison

    def trial(number: int, seconds: float, contended: bool) -> optuna.trial.FrozenTrial:
        made = optuna.trial.create_trial(value=seconds, params={}, distributions={},
                                         user_attrs={CONTENDED: contended})
        made.number = number
        return made

    calm, busy, busier = trial(0, 0.13, False), trial(1, 0.27, True), trial(2, 0.28, True)
    assert contended_comparison([calm, busy, busier], calm) == (
        "trial 0 measured the fastest step of 3, but trials 1, 2 ran while other processes kept the CPU busy and "
        "may run faster than measured; rerun the study on an idle machine to compare them fairly.")
    assert contended_comparison([calm, trial(1, 0.2, False)], calm) is None
    assert contended_comparison([busy, trial(3, 0.3, False)], busy) is None  # a contended winner won anyway


def test_a_study_named_for_another_problem_is_refused_before_any_trial(tmp_path):
    """--study-name of a study another problem made (another engine, batch, pins) would measure its
    plans and write them as this command's: refused in one sentence, nothing measured."""
    from dsauto.errors import DsautoError
    from dsauto.refine.study import TuneSettings, open_storage, refine
    from dsauto.search.space import Constraints

    deepspeed = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2),
                        TrainSpec(4, 64, "fp32"), Constraints(engine="deepspeed"))
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    study = optuna.create_study(study_name="theirs", storage=open_storage(url))
    study.set_user_attr("base_plans", [deepspeed.search()[0].to_dict()])
    study.set_user_attr("candidates", [])
    study.set_user_attr("problem", "dsauto-gpt-tiny-0123456789")  # what another problem's run stored
    megatron = Planner(deepspeed.model, deepspeed.cluster, deepspeed.train, Constraints(engine="megatron"))
    with pytest.raises(DsautoError, match=r"^Study theirs measures another problem than this command's \(its plans "
                                          r"are deepspeed plans of gpt-tiny on 2 devices, global batch 4"):
        refine(megatron, tmp_path / "out", TuneSettings(trials=1, storage=url, study_name="theirs"))
    assert not study.get_trials()


def test_a_trial_that_only_timed_out_is_measured_again_with_a_longer_timeout():
    """A trial that failed by running out of its timeout frees its candidate for a run with a longer
    one (--trial-timeout), where a crash keeps its candidate taken."""
    from optuna.trial import TrialState

    from dsauto.refine.sampler import CostModelSampler, key_of
    from dsauto.refine.space import candidates

    planner = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(4, 64, "fp32"))
    distinct = {key_of(c.knobs): c for c in candidates(planner, planner.search(top_k=2))}
    space = list(distinct.values())[:2]
    study = optuna.create_study()
    for candidate, reason in zip(space, ("hung: no result after 4 s", "crashed: ValueError: boom")):
        params = candidate.knobs.params()
        study.add_trial(optuna.trial.create_trial(
            state=TrialState.FAIL, params=params, user_attrs={"status": "failed", "reason": reason},
            distributions={name: optuna.distributions.CategoricalDistribution([value]) for name, value in params.items()}))
    assert len(CostModelSampler(space, planner, retry_timeouts_below=4.0).taken(study)) == 2  # it would hang again
    assert len(CostModelSampler(space, planner, retry_timeouts_below=120.0).taken(study)) == 1


def test_a_script_that_stops_early_is_failed_with_what_the_hook_said(tmp_path):
    from dsauto.refine.runner import _failure_reason

    log = ("[rank0]: dsauto trial: the script ended after 3 of the trial's 5 optimizer steps, so nothing was "
           "measured; let it run at least 5 steps.\n")
    assert _failure_reason(0, log) == ("exited with code 0 without a result: the script ended after 3 of the trial's "
                                       "5 optimizer steps, so nothing was measured; let it run at least 5 steps.")
    assert _failure_reason(0, "done\n") == "exited with code 0 without a result"
