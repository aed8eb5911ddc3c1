"""The trial hook of Megatron-core scripts: ``dsauto tune --engine megatron --script train.py``.

The tuner launches the script once per trial (with torchrun) and sets ``DSAUTO_TRIAL`` to the path
of a :class:`~dsauto.refine.trial_hook.TrialRequest`, whose config carries the trial's plan in its
``"dsauto"`` block. A Megatron-LM style script needs no line of its own for it: the calls it already
makes to :mod:`dsauto.megatron` do the rest.

1. ``dm.load_plan(path)`` returns the trial's plan instead of the file's (:func:`start`), so that
   ``initialize_model_parallel``, ``apply``, ``model_chunks``, ``ddp_config`` and ``optimizer_config``
   all set up the trial's layout, and it starts counting live tensor bytes: the model is built
   after it.
2. ``dm.model_chunks`` marks the end of the build (:meth:`StepMeter.model_built`).
3. Each optimizer step is seen where it happens, in the torch optimizer under Megatron's
   (``torch.optim.Optimizer`` step post-hook, registered for the whole process: a script's optimizer
   is built by ``get_megatron_optimizer``, which dsauto never sees). The first ``memory_steps`` steps
   are tracked, ``warmup_steps`` more pass untimed, the next ``steps`` are timed
   (:class:`~dsauto.profile.megatron_steps.StepMeter`, as the built-in harness measures).
4. After the last timed step rank 0 writes the
   :class:`~dsauto.profile.steps.StepMeasurement` at the request's ``out``, every rank leaves the
   process group and the process ends (``os._exit(0)``): the script ends there.

What the script must do for the measurement to be the plan's: take the micro-batch, the number of
micro-batches per step and the sequence length from the plan it gets (``plan.micro_batch``,
``plan.grad_accum``, ``plan.seq_len``), and run at least ``memory_steps + warmup_steps + steps``
optimizer steps. The loss is not seen, so a script trial reports none.
"""

from __future__ import annotations

import atexit
import os
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from dsauto.plan import Plan
from dsauto.plan_io import PLAN_KEY, plan_from_data
from dsauto.profile.megatron_steps import StepMeter
from dsauto.profile.memory import MemoryTracker
from dsauto.profile.run import current_device
from dsauto.refine.trial_hook import TRIAL_ENV, TrialRequest, end_trial


class MegatronTrial:
    """One script's trial: its plan and the meter of its optimizer steps."""

    def __init__(self, request: TrialRequest):
        where = f"the plan of the trial request {os.environ.get(TRIAL_ENV, '')}"
        self.request = request
        self.plan: Plan = plan_from_data(request.config.get(PLAN_KEY), where)
        self.device = current_device()
        self.finished = False
        self._optimizer: object | None = None
        tracker = MemoryTracker(self.device)
        tracker.__enter__()  # left when the memory steps end, in StepMeter
        self.meter = StepMeter(tracker, self.device, request.steps, request.warmup_steps, request.memory_steps)
        self._hook = register_optimizer_step_post_hook(self._after_step)
        atexit.register(self._report_unfinished)
        if self._rank() == 0:
            print(f"dsauto trial: the plan from ${TRIAL_ENV} (the script's is not read): {self.plan.engine}, "
                  f"dp {self.plan.dp} x tp {self.plan.tp} x pp {self.plan.pp}, micro-batch {self.plan.micro_batch} "
                  f"x {self.plan.grad_accum}; measuring {request.memory_steps} + {request.warmup_steps} + "
                  f"{request.steps} optimizer steps", flush=True)

    @staticmethod
    def _rank() -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))

    def _after_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        # Megatron chains one torch optimizer per parameter group kind (ChainedOptimizer); the first
        # one to step stands for the whole optimizer step.
        if self._optimizer is None:
            self._optimizer = optimizer
        if optimizer is not self._optimizer or self.finished:
            return
        measured = self.meter.optimizer_step_done()
        if measured is None:
            return
        import torch.distributed as dist

        self.finished = True
        self._hook.remove()
        end_trial(self.request, measured, self._rank(), dist.destroy_process_group)

    def _report_unfinished(self) -> None:
        if not self.finished and self._rank() == 0:
            print(f"dsauto trial: the script ended after {self.meter.optimizer_steps} of the trial's "
                  f"{self.meter.total_steps} optimizer steps, so nothing was measured; let it run at least "
                  f"{self.meter.total_steps} steps.", file=sys.stderr, flush=True)


_active: MegatronTrial | None = None
"""The trial of this process: one per script run, started by its first ``load_plan``."""


def start(request: TrialRequest) -> Plan:
    """The trial's plan, its measurement started (once per process; a second call returns the same plan)."""
    global _active
    if _active is None:
        _active = MegatronTrial(request)
    return _active.plan


def model_built() -> None:
    """Tells a running trial that the script's model is built (nothing outside a trial)."""
    if _active is not None:
        _active.meter.model_built()
