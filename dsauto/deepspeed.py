"""``dsauto.deepspeed.initialize``: ``deepspeed.initialize`` that also applies the plan in the config.

In an existing DeepSpeed script, replace ``deepspeed.initialize(...)`` by
``dsauto.deepspeed.initialize(...)``: same arguments, same return tuple
``(engine, optimizer, training_dataloader, lr_scheduler)``. When the config (``config``,
``config_params`` or ``args.deepspeed_config``) has a ``"dsauto"`` block, the plan's per-layer
choices are applied (see :mod:`dsauto.runtime.deepspeed`): which ZeRO-3 layer groups keep their
parameters resident, which blocks are checkpointed, which operators are split. A config without
the block is passed through untouched, and the call is exactly ``deepspeed.initialize``.

A pipeline plan (pp > 1) trains under DeepSpeed's pipeline engine: build the model with
:func:`pipeline_module`, which cuts the ``PipelineModule`` where the plan does.

Under ``dsauto tune --script`` (``$DSAUTO_TRIAL`` set) the call runs the trial's config instead of
the script's and measures the steps that follow (see :mod:`dsauto.refine.trial_hook`).

The config itself reaches DeepSpeed as given: DeepSpeed reads only the top-level keys it knows
(deepspeed/runtime/config.py), so the ``"dsauto"`` block rides along unread.

Code that calls ``deepspeed.initialize`` itself (Hugging Face's Trainer, accelerate) gets the same
with one line before it runs::

    import dsauto.deepspeed
    dsauto.deepspeed.install()   # deepspeed.initialize now applies the config's "dsauto" plan

:func:`install` replaces the name ``deepspeed.initialize`` (which transformers and accelerate look
up when they call it: accelerate's ``Accelerator._prepare_deepspeed``), and :func:`uninstall` puts
DeepSpeed's own back. The hook itself always calls DeepSpeed's own, so installing twice, or
calling :func:`initialize` while installed, applies a plan once.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from torch import nn

from dsauto.errors import DsautoError
from dsauto.plan import Plan
from dsauto.plan_io import PLAN_KEY
from dsauto.refine.trial_hook import requested_trial, start_trial
from dsauto.runtime import deepspeed as hook


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: str | dict[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | dict[str, Any] | None = None,
) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize`` (same parameters, same order, same result) applying the config's plan.

    Raises :class:`dsauto.errors.DsautoError` before the engine is built when the plan does not
    match the model or the config (block count, shape, layer names, ZeRO stage, tp/pp), and after
    it is built, before any step, when the data-parallel size is not the plan's.
    """
    forwarded: dict[str, Any] = dict(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
        training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
        mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
        config_params=config_params,
    )
    if mesh_param is not None:  # forwarded only when given: older DeepSpeed releases lack it
        forwarded["mesh_param"] = mesh_param
    request = requested_trial()
    if request is not None:  # launched by `dsauto tune --script`: run and measure the trial's plan
        return start_trial(request, forwarded, hook.initialize)
    built = hook.initialize(forwarded)
    _unlink_cpu_all_reduce_buffer_at_exit()
    return built


def _unlink_cpu_all_reduce_buffer_at_exit() -> None:
    """On the CPU accelerator, DeepSpeed's all-reduce gives each rank of a one-node job a shared-memory
    buffer of about 66 MiB, named after the user, the master address and port and the rank
    (deepspeed/ops/csrc/cpu/comm/shm_interface.cpp and shm.cpp, ``shm_initialize``), and never unlinks
    it: every CPU run would leave its ranks' buffers in /dev/shm for good. Each rank maps every other
    rank's buffer when the process group starts, so once the engine is built each may unlink its own
    name at exit (the mappings stay valid). dsauto's own launches remove them from the outside too
    (:func:`dsauto.profile.launch.remove_shared_memory`)."""
    import atexit

    from deepspeed.accelerator import get_accelerator

    from dsauto.profile.launch import all_reduce_buffer

    addr, port, rank = (os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT", "RANK"))
    if get_accelerator().device_name() != "cpu" or not (addr and port and rank):
        return
    atexit.register(all_reduce_buffer(addr, port, rank).unlink, missing_ok=True)


def pipeline_module(config: str | os.PathLike[str] | dict[str, Any] | Plan, layers: Sequence[Any],
                    loss_fn: Callable[..., Any] | None = None, block_type: type | str | None = None,
                    **kwargs: Any) -> nn.Module:
    """DeepSpeed's ``PipelineModule`` of ``layers`` cut into the stages of the plan in ``config``
    (the ``ds_config.json`` dsauto wrote, its dict, or the plan), with the plan's checkpointed
    transformer layers wrapped; pass it to :func:`initialize` with the same config::

        deepspeed.init_distributed()
        net = dsauto.deepspeed.pipeline_module("out/ds_config.json", layer_specs, loss_fn=loss)
        engine, *_ = dsauto.deepspeed.initialize(model=net, config="out/ds_config.json")
        loss = engine.train_batch(data_iter)

    ``layers`` is the list a ``PipelineModule`` takes (``LayerSpec``s, modules, functions), in model
    order; the transformer layers are the entries of ``block_type`` (a class or its name), or of
    the one type that occurs as often as the plan's model has layers. ``kwargs`` go to
    ``PipelineModule``, except what the plan sets (see :func:`dsauto.runtime.pipeline.pipeline_module`).
    Under ``dsauto tune --script`` it cuts for the trial's plan, which :func:`initialize` then runs."""
    from dsauto.runtime.pipeline import pipeline_module as build

    plan = plan_of(config)
    if plan is None:
        raise DsautoError(f"{config if not isinstance(config, dict) else 'The config'} holds no "
                          f"{PLAN_KEY!r} plan to cut the pipeline by; pass the ds_config.json dsauto tune wrote.")
    return build(plan, layers, loss_fn=loss_fn, block_type=block_type, **kwargs)


def plan_of(config: str | os.PathLike[str] | dict[str, Any] | Plan | None) -> Plan | None:
    """The plan this run trains: under ``dsauto tune --script`` the trial's (the one
    :func:`initialize` then runs), else ``config`` itself when it is a plan, or the one in it (a
    ``ds_config.json`` path or its dict), or None when there is none. A script that builds its model
    from the plan (its pipeline, its model spec) asks this, not the file."""
    request = requested_trial()
    if request is not None:
        return hook.plan_from_config(request.config)
    if isinstance(config, Plan):
        return config
    resolved = hook.config_dict(None, config, None)
    return hook.plan_from_config(resolved) if resolved is not None else None


def install() -> None:
    """Routes ``deepspeed.initialize`` through :func:`initialize`, so that a plan's per-layer choices
    apply when Hugging Face's Trainer or accelerate build the engine (idempotent)."""
    import deepspeed

    if installed():
        return
    original = deepspeed.initialize

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
        return initialize(*args, **kwargs)

    setattr(routed, hook.ORIGINAL, original)
    deepspeed.initialize = routed


def uninstall() -> None:
    """Puts DeepSpeed's own ``deepspeed.initialize`` back (nothing when not installed)."""
    import deepspeed

    original = getattr(deepspeed.initialize, hook.ORIGINAL, None)
    if original is not None:
        deepspeed.initialize = original


def installed() -> bool:
    """Whether :func:`install` routes ``deepspeed.initialize`` through the hook."""
    import deepspeed

    return getattr(deepspeed.initialize, hook.ORIGINAL, None) is not None
