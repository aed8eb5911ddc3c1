"""The trial hook: ``dsauto tune --script train.py`` measures each trial's plan with the user's own script.

The tuner launches the script once per trial (with the DeepSpeed launcher) and sets
``DSAUTO_TRIAL`` to the path of a JSON :class:`TrialRequest`. The script calls
``dsauto.deepspeed.initialize`` as it always does; with the variable set, that call
(:func:`start_trial`):

1. builds the engine from the request's config (a complete ds_config with the trial's ``"dsauto"``
   plan block) instead of the config the script passes, so the trial's plan is what runs;
2. counts live tensor bytes from before the engine is built, the model's existing parameters and
   buffers included (:meth:`MemoryTracker.adopt`), over the first ``memory_steps`` optimizer steps,
   then stops counting (the CPU counter slows every operator down);
3. counts optimizer steps at ``engine.step()`` (a pipeline engine's at ``engine.train_batch()``),
   skips ``warmup_steps`` more, then times ``steps`` steps, each from the end of one optimizer step
   to the end of the next, ranks synchronised at every step end;
4. after the last timed step, writes the :class:`~dsauto.profile.steps.StepMeasurement` (slowest
   rank's times, largest rank's memory) as JSON at the request's ``out`` from rank 0, leaves the
   process group on every rank and ends the process (``os._exit(0)``, skipping the script's own
   teardown, which DeepSpeed on CPU sometimes aborts in): the script ends there.

The quantities are those of the built-in harness (:mod:`dsauto.profile.steps`), which shares its
rank synchronisation and reduction with this module. What the script must do for the measurement to
be the plan's: take the micro-batch and the accumulation from the engine
(``engine.train_micro_batch_size_per_gpu()``, ``engine.gradient_accumulation_steps()``), call
``engine.step()`` after every micro-batch's ``engine.backward(loss)`` (or, for a pipeline plan,
build its model with ``dsauto.deepspeed.pipeline_module``, which cuts it for the trial's plan, and
call ``engine.train_batch()``), and run at least ``memory_steps + warmup_steps + steps`` optimizer
steps.
"""

from __future__ import annotations

import atexit
import copy
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsauto.profile.memory import MemoryTracker
from dsauto.profile.run import current_device
from dsauto.profile.steps import StepMeasurement, slowest_rank, sync_ranks
from dsauto.serde import from_dict, read_data, to_dict, write_json

TRIAL_ENV = "DSAUTO_TRIAL"
"""Environment variable naming the trial request file; unset outside ``dsauto tune --script``."""


@dataclass(frozen=True)
class TrialRequest:
    """What one trial of ``dsauto tune --script`` asks the script's ``initialize`` to run and measure."""

    config: dict[str, Any]
    """The trial's complete DeepSpeed config (with the ``"dsauto"`` plan block); replaces the script's.
    A Megatron-core script takes only the plan block (:mod:`dsauto.refine.megatron_trial`)."""
    out: str
    """Where rank 0 writes the :class:`~dsauto.profile.steps.StepMeasurement` JSON."""
    steps: int = 5
    """Timed optimizer steps."""
    warmup_steps: int = 2
    """Untimed optimizer steps after the memory steps (first-step allocations, caches, ZeRO-3 traces)."""
    memory_steps: int = 2
    """First optimizer steps, with the memory tracker on (not timed: the tracker slows them down)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.memory_steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"steps ({self.steps}) and memory_steps ({self.memory_steps}) must be at "
                             f"least 1 and warmup_steps ({self.warmup_steps}) at least 0")
        if not self.out:
            raise ValueError("out must name the file the measurement is written to")

    @property
    def total_steps(self) -> int:
        """Optimizer steps the trial runs before the script is stopped."""
        return self.memory_steps + self.warmup_steps + self.steps


def end_trial(request: TrialRequest, measured: StepMeasurement, rank: int,
              destroy_process_group: Callable[[], None]) -> None:
    """End a measured trial: rank 0 writes ``measured`` where the request says and reports it, the
    process group goes, and the script leaves at once. The interpreter's own teardown, with the
    engine and its communication threads still alive, sometimes aborts ("terminate called without
    an active exception"), which would make a measured trial look failed; the script's own teardown
    is not part of the trial, and the result is written, so nothing is lost."""
    if rank == 0:
        write_json(Path(request.out), to_dict(measured))
        print(f"dsauto trial: step {measured.step_seconds * 1e3:.1f} ms, peak "
              f"{measured.peak_bytes / 2**20:.1f} MiB per rank; wrote {request.out}", flush=True)
    destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_request(request: TrialRequest, path: Path | str) -> None:
    """Write ``request`` as JSON at ``path``, atomically (a launched rank never reads half a file)."""
    write_json(Path(path), to_dict(request))


def read_request(path: Path | str) -> TrialRequest:
    """The request in ``path``; :class:`DsautoError` naming the file when it is unreadable or malformed."""
    path = Path(path)
    where = f"the trial request {path} (from ${TRIAL_ENV})"
    return from_dict(TrialRequest, read_data(path, where), where)


def requested_trial() -> TrialRequest | None:
    """The request named by ``$DSAUTO_TRIAL``, or None when the variable is unset or empty."""
    path = os.environ.get(TRIAL_ENV)
    return read_request(path) if path else None


Initialize = Callable[[dict[str, Any]], tuple[Any, Any, Any, Any]]


def start_trial(request: TrialRequest, forwarded: dict[str, Any],
                initialize: Initialize) -> tuple[Any, Any, Any, Any]:
    """``initialize(forwarded)`` with the trial's config, memory tracked from before the engine is
    built, and the engine's steps measured (see the module doc); returns what ``initialize`` does.

    ``forwarded`` holds ``deepspeed.initialize``'s keyword arguments as the script gave them.
    """
    args = forwarded.get("args")
    trial_args = _without_config(args)
    trial_forwarded = {**forwarded, "args": trial_args, "config": copy.deepcopy(request.config),
                       "config_params": None}
    device = current_device()
    tracker = MemoryTracker(device)
    tracker.__enter__()  # left when the memory steps end, in _TrialSteps
    try:
        # The model (and a client optimizer's states, if any) predate the tracker, yet they are what
        # a plan's static memory is made of.
        tracker.adopt(_existing_tensors(forwarded.get("model"), forwarded.get("optimizer")))
        result = initialize(trial_forwarded)
        engine = result[0]
        _TrialSteps(request, engine, tracker, device).attach()
    except BaseException:
        tracker.__exit__(None, None, None)
        raise
    if trial_args is not args and hasattr(args, "local_rank"):
        # DeepSpeed aligns args.local_rank with $LOCAL_RANK (DeepSpeedEngine._configure_with_arguments),
        # which scripts may rely on; it did so on the copy.
        args.local_rank = trial_args.local_rank
    return result


def _without_config(args: Any) -> Any:
    """``args`` without a config path, copied so the script's object stays as it was: DeepSpeed
    refuses a config both in ``args.deepspeed_config`` and in ``config=`` (deepspeed/__init__.py)."""
    names = [n for n in ("deepspeed_config", "deepscale_config") if getattr(args, n, None) is not None]
    if not names:
        return args
    trial_args = copy.copy(args)
    for name in names:
        setattr(trial_args, name, None)
    return trial_args


def _existing_tensors(model: Any, optimizer: Any) -> Iterator[torch.Tensor]:
    """The model's parameters, their gradients and its buffers, and a client torch optimizer's states.

    Not ``model_parameters``: it is often a generator, which DeepSpeed must still be able to read.
    """
    if isinstance(model, torch.nn.Module):
        for param in model.parameters():
            yield param
            if param.grad is not None:
                yield param.grad
        yield from model.buffers()
    if isinstance(optimizer, torch.optim.Optimizer):
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class _TrialSteps:
    """Counts the engine's optimizer steps and measures them: replaces ``engine.step`` (and
    ``engine.backward``, to see the loss) on the engine instance by its own methods, or a pipeline
    engine's ``train_batch`` (one optimizer step each)."""

    def __init__(self, request: TrialRequest, engine: Any, tracker: MemoryTracker, device: torch.device):
        self.request = request
        self.engine = engine
        self.tracker = tracker
        self.device = device
        self.optimizer_steps = 0
        self.step_seconds: list[float] = []
        self.losses: list[float] = []
        self.finished = False
        self.rank = 0
        self._engine_step = engine.step
        self._engine_backward = engine.backward
        self._engine_train_batch: Callable[..., Any] | None = None
        self._loss: torch.Tensor | None = None
        self._clock = 0.0
        self._step_region = tracker.region("step")

    def attach(self) -> None:
        import deepspeed.comm as dist
        from deepspeed.runtime.pipe.engine import PipelineEngine

        engine, request = self.engine, self.request
        # Between steps: parameters, gradients and optimizer states, as in dsauto.profile.steps.
        with self.tracker.region("static"):
            pass
        self._step_region.__enter__()  # until the last memory step ends
        if isinstance(engine, PipelineEngine):
            # DeepSpeed's pipeline engine runs a whole step (its micro-batches, the reduction and the
            # optimizer) in train_batch() and returns the step's mean loss.
            self._engine_train_batch = engine.train_batch
            engine.train_batch = self.train_batch
        else:
            engine.step = self.step
            engine.backward = self.backward
        atexit.register(self._report_unfinished)
        self.rank = dist.get_rank()
        if self.rank == 0:
            print(f"dsauto trial: ZeRO stage {engine.zero_optimization_stage()}, micro-batch "
                  f"{engine.train_micro_batch_size_per_gpu()}, {engine.gradient_accumulation_steps()} "
                  f"micro-batches per step, {dist.get_world_size()} ranks, config from ${TRIAL_ENV} "
                  f"(the script's is not used); measuring {request.memory_steps} + "
                  f"{request.warmup_steps} + {request.steps} optimizer steps", flush=True)

    def train_batch(self, *args: Any, **kwargs: Any) -> Any:
        loss = self._engine_train_batch(*args, **kwargs)
        self._loss = loss.detach() if isinstance(loss, torch.Tensor) else None
        self._after_optimizer_step()
        return loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._loss = loss.detach()  # a view: nothing allocated, the graph is not kept
        return self._engine_backward(loss, *args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        # Asked before the call: the engine counts the micro-step at the end of step()
        # (DeepSpeedEngine.step, DeepSpeed 0.19.8). With managed_gradient_accumulation false every
        # step() is an optimizer step, and the query is true only while step() runs.
        managed = getattr(self.engine, "managed_gradient_accumulation", lambda: True)()
        optimizer_step = not managed or self.engine.is_gradient_accumulation_boundary()
        result = self._engine_step(*args, **kwargs)
        if optimizer_step:
            self._after_optimizer_step()
        return result

    def _after_optimizer_step(self) -> None:
        request = self.request
        self.optimizer_steps += 1
        done = self.optimizer_steps
        if done == request.memory_steps:
            self._step_region.__exit__(None, None, None)
            with self.tracker.region("static"):
                pass
            self.tracker.__exit__(None, None, None)
        loss = float(self._loss) if self._loss is not None else None
        sync_ranks(self.device)
        now = time.perf_counter()
        if done > request.memory_steps + request.warmup_steps:
            self.step_seconds.append(now - self._clock)
            if loss is not None:
                self.losses.append(loss)
        self._clock = now
        if done == request.total_steps:
            self._finish()

    def _finish(self) -> None:
        import deepspeed.comm as dist

        request = self.request
        losses = self.losses if len(self.losses) == request.steps else []  # none, if backward was bypassed
        measured = slowest_rank(self.step_seconds, self.tracker.peak_bytes("step"),
                                self.tracker.peak_bytes("static"), losses, self.device)
        self.finished = True
        end_trial(request, measured, self.rank, dist.destroy_process_group)

    def _report_unfinished(self) -> None:
        if not self.finished and self.rank == 0:
            print(f"dsauto trial: the script ended after {self.optimizer_steps} of the trial's "
                  f"{self.request.total_steps} optimizer steps, so nothing was measured; let it run at "
                  f"least {self.request.total_steps} steps.", file=sys.stderr, flush=True)
