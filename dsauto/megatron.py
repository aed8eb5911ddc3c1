"""dsauto in a Megatron-core training script: a few lines added to the script a user already has.

    import dsauto.megatron as dm
    plan = dm.load_plan("out/plan.yaml")            # or the ds_config.json with its "dsauto" block
    dm.initialize_model_parallel(plan)              # TP / PP / DP process groups from the plan
    config = dm.apply(plan, TransformerConfig(...)) # recompute per layer, pipeline layout, sequence parallel
    model = dm.model_chunks(plan, build)            # one chunk per virtual pipeline stage
    ddp_config = dm.ddp_config(plan)                # distributed optimizer / sharding strategy

The batch shape is ``plan.micro_batch`` sequences of ``plan.seq_len`` tokens, ``plan.grad_accum``
micro-batches per step (``num_microbatches`` of ``get_forward_backward_func()``).
:func:`optimizer_config` matches the optimizer to ``ddp_config``; :func:`deepspeed_mpu` lets
DeepSpeed ZeRO drive a Megatron-core tensor-parallel model. What Megatron-core cannot express is
logged as a warning by ``apply`` and ``ddp_config``. On a machine without CUDA, enable
:mod:`dsauto.compat.megatron_cpu` first. The implementation is :mod:`dsauto.runtime.megatron`.

Under ``dsauto tune --engine megatron --script train.py`` (``$DSAUTO_TRIAL`` set), ``load_plan``
returns the trial's plan instead of the file's and the optimizer steps that follow are measured;
the script ends after them (see :mod:`dsauto.refine.megatron_trial`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from dsauto.plan import Plan
from dsauto.refine import megatron_trial
from dsauto.refine.trial_hook import requested_trial
from dsauto.runtime import megatron as _runtime
from dsauto.runtime.megatron import (
    apply,
    ddp_config,
    gpt_model_kwargs,
    initialize_model_parallel,
    mtp_block_spec,
    optimizer_config,
    transformer_config_kwargs,
)
from dsauto.runtime.mpu import MegatronCoreMpu, deepspeed_mpu

M = TypeVar("M")


def load_plan(path: Path | str) -> Plan:
    """The plan in ``path``: a ``plan.yaml``, or a ``ds_config.json`` with its ``"dsauto"`` block.
    In a trial of ``dsauto tune --script``, the trial's plan (``path`` is not read)."""
    request = requested_trial()
    if request is not None:
        return megatron_trial.start(request)
    return _runtime.load_plan(path)


def model_chunks(plan: Plan, build: Callable[..., M]) -> list[M]:
    """This pipeline rank's model chunks (see :func:`dsauto.runtime.megatron.model_chunks`); in a
    trial, the end of the build, from which its step memory counts."""
    chunks = _runtime.model_chunks(plan, build)
    megatron_trial.model_built()
    return chunks

__all__ = [
    "MegatronCoreMpu",
    "apply",
    "ddp_config",
    "deepspeed_mpu",
    "gpt_model_kwargs",
    "initialize_model_parallel",
    "load_plan",
    "model_chunks",
    "mtp_block_spec",
    "optimizer_config",
    "transformer_config_kwargs",
]
