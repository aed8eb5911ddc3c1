"""Running one trial: real training steps of one plan, in fresh processes, with a timeout.

Two harnesses measure the same things (:class:`dsauto.profile.steps.StepMeasurement`):

- the built-in one trains dsauto's reference implementation of the model on random tokens,
  launched with torchrun (``-m dsauto.profile.steps``); a Megatron-core plan (engine ``megatron``)
  trains Megatron-core's GPT there instead (:mod:`dsauto.profile.megatron_steps`);
- the user's own DeepSpeed script, launched with the DeepSpeed launcher (or torchrun) with
  ``DSAUTO_TRIAL`` pointing at the trial's request: ``dsauto.deepspeed.initialize`` in the script
  then trains the trial's config, measures the steps and ends the script
  (:mod:`dsauto.refine.trial_hook`); or, for a Megatron-core plan, the user's Megatron-core script,
  in which ``dsauto.megatron.load_plan`` returns the request's plan and the optimizer steps are
  measured (:mod:`dsauto.refine.megatron_trial`).

The outcome is ``complete``, ``infeasible`` (the measured peak is over the memory budget), or
``failed`` with the reason: out of memory, killed, a crash (its last error line), a hang (no
result within the timeout: the launcher and every rank are ended), or not launched (on CPU ranks,
the plan would not fit in the machine's available memory). Every launch runs under the guard of
:mod:`dsauto.profile.launch`, so no rank outlives the tune, however the tune ends; the CPU time
other processes took meanwhile says whether the step was measured under contention.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dsauto.emit.ds_config import ds_config
from dsauto.errors import DsautoError
from dsauto.plan import Plan
from dsauto.profile.launch import free_port, launch, remove_shared_memory, stop
from dsauto.profile.resources import MEMORY_WAIT_SECONDS, PROCESS_BYTES, CpuMeter, await_fits, ranks_on_cpu
from dsauto.profile.steps import StepMeasurement
from dsauto.refine.launchers import Rendezvous, deepspeed_env_file, node_args
from dsauto.serde import from_dict
from dsauto.units import format_bytes

Status = Literal["complete", "infeasible", "failed"]


@dataclass(frozen=True)
class TrialSettings:
    """How every trial of a tune runs."""

    steps: int = 5
    """Timed optimizer steps (their median is the trial's step time)."""
    warmup_steps: int = 2
    """Untimed steps before timing."""
    memory_steps: int = 2
    """First steps, with the memory tracker on (not timed: tracking slows steps down)."""
    timeout_seconds: float = 600.0
    """A trial with no result after this long is killed and counted as hung."""
    script: str | None = None
    """The user's training script; None runs the built-in harness."""
    script_args: tuple[str, ...] = ()
    """Arguments of the user's script."""
    launcher: Literal["torchrun", "deepspeed"] = "torchrun"
    """Launcher of the trial's processes (one per rank, on this machine)."""

    def __post_init__(self) -> None:
        if min(self.steps, self.warmup_steps + 1, self.memory_steps + 1) < 1:
            raise DsautoError(f"Trials need at least 1 timed step and no negative warm-up or memory "
                              f"steps, got {self.steps}, {self.warmup_steps} and {self.memory_steps}.")
        if not (math.isfinite(self.timeout_seconds) and self.timeout_seconds > 0):  # NaN would disable it
            raise DsautoError(f"The trial timeout must be a positive number of seconds, got {self.timeout_seconds}.")
        if self.script is not None and not Path(self.script).is_file():
            raise DsautoError(f"The training script {self.script} does not exist; pass the path of "
                              f"your DeepSpeed script to --script.")


@dataclass(frozen=True)
class TrialOutcome:
    """What one trial gave."""

    status: Status
    """``complete``, ``infeasible`` (over the memory budget) or ``failed``."""
    reason: str
    """Why it was infeasible or failed; empty when complete."""
    measurement: StepMeasurement | None
    """The measured steps (also for an infeasible trial); None when it failed."""
    wall_seconds: float
    """Wall time of the whole trial, start-up included."""
    log: str
    """Path of the trial's combined output."""
    other_load: float = 0.0
    """CPU cores other processes kept busy while the trial ran (:class:`dsauto.profile.resources.CpuMeter`)."""
    loadavg: float = 0.0
    """The machine's one-minute load average at the launch."""
    contended: bool = False
    """Whether the trial's CPU ranks competed with other processes for cores (its step time is
    then slower than the plan runs alone, and it counts little in the calibration)."""


def launch_env(ranks: int, extra: dict[str, str]) -> dict[str, str]:
    """The environment of a launch of ``ranks`` local processes, with ``extra`` added."""
    env = dict(os.environ)
    import torch

    if not torch.cuda.is_available():
        # DeepSpeed on CPU: its CPU accelerator, and its launcher counts LOCAL_SIZE "devices".
        env.setdefault("DS_ACCELERATOR", "cpu")
        env["LOCAL_SIZE"] = str(ranks)
        env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def trial_command(settings: TrialSettings, ranks: int, plans_path: Path, out_path: Path, port: int,
                  rendezvous: Rendezvous | None = None) -> list[str]:
    """The command line of a trial on ``ranks`` local processes with master port ``port``, or, with
    ``rendezvous``, of this node's part of a trial that spans nodes (:mod:`dsauto.refine.launchers`)."""
    port = str(port)
    if settings.launcher == "deepspeed":
        # The launcher of this interpreter (what the `deepspeed` script runs), so that a virtual
        # environment works without being activated.
        launch = [sys.executable, "-m", "deepspeed.launcher.runner", "--include",
                  "localhost:" + ",".join(map(str, range(ranks))), "--master_port", port]
        if rendezvous is not None:
            launch[3:] = node_args("deepspeed", rendezvous)
        if settings.script is None:
            launch.append("--module")
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                  "--master_port", port]
        if rendezvous is not None:
            launch[3:] = node_args("torchrun", rendezvous)
        if settings.script is None:
            launch.append("-m")
    if settings.script is not None:
        return [*launch, settings.script, *settings.script_args]
    return [*launch, "dsauto.profile.steps", "--plans", str(plans_path), "--out", str(out_path),
            "--steps", str(settings.steps), "--warmup", str(settings.warmup_steps)]


def _failure_reason(returncode: int, log_text: str) -> str:
    lowered = log_text.lower()
    if "out of memory" in lowered or "outofmemoryerror" in lowered:
        return "out of memory"
    # The last Python error a rank printed (launchers add their own lines about killing the rest).
    errors = re.findall(r"^\s*(?:\[rank\d+\]: )?([A-Za-z_.]*(?:Error|Exception)\b.*)$", log_text, re.MULTILINE)
    errors = [e for e in errors if "ChildFailedError" not in e]
    if errors:
        return f"crashed: {errors[-1].strip()[:300]}"
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) or "exitcode  : -9" in log_text:
        return "killed by SIGKILL (the machine may have run out of host memory)"
    # what the trial's hook said of a script that stopped early (dsauto.refine.trial_hook, megatron_trial)
    said = re.findall(r"^(?:\[rank\d+\]: )?dsauto trial: (.+)$", log_text, re.MULTILINE)
    if said:
        return f"exited with code {returncode} without a result: {said[-1].strip()[:300]}"
    return f"exited with code {returncode} without a result"


def run_trial(plan: Plan, ranks: int, settings: TrialSettings, work_dir: Path | str,
              budget_bytes: int | None = None, config: dict | None = None,
              rendezvous: Rendezvous | None = None, say: Callable[[str], None] | None = None) -> TrialOutcome:
    """Train ``plan`` for the trial's steps on ``ranks`` local processes and judge the result
    against ``budget_bytes`` (default: the plan's memory budget). Files go to ``work_dir``.

    With ``rendezvous`` (node 0 of a plan that spans nodes), ``ranks`` are this node's and the
    launcher meets the other nodes' at the rendezvous (or, DeepSpeed's with a hostfile, starts them).

    ``config`` (the user-script harness only) sends another DeepSpeed config than the plan's, e.g.
    a plain one without the ``"dsauto"`` block, to measure DeepSpeed's own behaviour.

    On CPU ranks, a launch the machine's memory would hold but other processes leave too little of
    now waits for them (``say`` is told) within the trial's timeout, at most
    :data:`dsauto.profile.resources.MEMORY_WAIT_SECONDS`, before the trial fails as not launched."""
    if config is not None and settings.script is None:
        raise ValueError("a config other than the plan's needs a training script to run it")
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out_path, log_path = work / "measured.json", work / "log.txt"
    out_path.unlink(missing_ok=True)
    extra_env: dict[str, str] = {}
    plans_path = work / "plan.json"
    plans_path.write_text(json.dumps([plan.to_dict()]))
    if settings.script is not None:
        from dsauto.refine.trial_hook import TRIAL_ENV, TrialRequest, write_request

        request = work / "request.json"
        write_request(TrialRequest(config=config or ds_config(plan), out=str(out_path.resolve()), steps=settings.steps,
                                   warmup_steps=settings.warmup_steps, memory_steps=settings.memory_steps),
                      request)
        extra_env[TRIAL_ENV] = str(request.resolve())
    port = free_port() if rendezvous is None else rendezvous.master_port
    if rendezvous is not None and rendezvous.hostfile is not None and extra_env:
        extra_env.update(deepspeed_env_file(work, extra_env))  # its launcher forwards only what is listed
    command = trial_command(settings, ranks, plans_path, out_path, port, rendezvous)
    refusal = host_memory_refusal(plan, ranks, min(settings.timeout_seconds, MEMORY_WAIT_SECONDS), say)
    if refusal is not None:
        log_path.write_text(f"dsauto: not launched: {refusal}\n")
        return TrialOutcome("failed", f"not launched: {refusal}", None, 0.0, str(log_path))
    started = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        # Under a guard (dsauto.profile.launch): on a timeout, an interrupt or dsauto's death the
        # launcher and every rank are ended, and their shared memory is removed.
        meter = CpuMeter()
        process = launch(command, launch_env(ranks, extra_env), port, stdout=log, stderr=subprocess.STDOUT)
        try:
            returncode = process.wait(timeout=settings.timeout_seconds)
        except subprocess.TimeoutExpired:
            stop(process)
            return TrialOutcome("failed", f"hung: no result after {settings.timeout_seconds:.0f} s",
                                None, time.perf_counter() - started, str(log_path))
        except BaseException:
            stop(process)
            raise
        finally:
            remove_shared_memory(port)
    wall = time.perf_counter() - started
    other_load = meter.other_load()
    load = dict(other_load=other_load, loadavg=meter.loadavg,
                contended=ranks_on_cpu() and meter.contended(other_load, ranks))
    if not out_path.exists():
        return TrialOutcome("failed", _failure_reason(returncode, log_path.read_text(errors="replace")), None,
                            wall, str(log_path))
    # The result is written atomically once every rank has measured, so it stands even when the
    # processes abort at teardown afterwards (gloo on CPU sometimes does: "terminate called without
    # an active exception"); the exit code is kept in the log.
    if returncode != 0:
        with open(log_path, "a") as log:
            log.write(f"dsauto: the trial exited with code {returncode} after writing its result\n")
    try:
        data = json.loads(out_path.read_text())
        measured = from_dict(StepMeasurement, data[0] if isinstance(data, list) and data else data, str(out_path))
    except (ValueError, OSError, DsautoError) as exc:  # a script that wrote something else there
        return TrialOutcome("failed", f"unreadable result: {str(exc)[:300]}", None, wall, str(log_path), **load)
    budget = plan.memory_budget_bytes if budget_bytes is None else budget_bytes
    if measured.peak_bytes > budget:
        return TrialOutcome("infeasible", f"peak {format_bytes(measured.peak_bytes)} per rank is over the "
                            f"{format_bytes(budget)} budget", measured, wall, str(log_path), **load)
    return TrialOutcome("complete", "", measured, wall, str(log_path), **load)


def host_memory_refusal(plan: Plan, ranks: int, wait_seconds: float = 0.0,
                        say: Callable[[str], None] | None = None) -> str | None:
    """Why ``ranks`` CPU ranks of ``plan`` must not be launched on this machine (they would not fit
    in its available memory, even after waiting up to ``wait_seconds`` for other processes to free
    it), or None; ranks on GPUs are not checked."""
    if not ranks_on_cpu():
        return None
    try:
        await_fits(f"Training {plan.model.name}", ranks, plan.prediction.peak_memory_bytes + PROCESS_BYTES,
                   "the trial was not launched", wait_seconds, say)
    except DsautoError as exc:
        return str(exc)
    return None

