"""``dsauto.deepspeed.initialize``: ``deepspeed.initialize`` that also applies the plan in the config.

In an existing DeepSpeed script, replace ``deepspeed.initialize(...)`` by
``dsauto.deepspeed.initialize(...)``: same arguments, same return tuple
``(engine, optimizer, training_dataloader, lr_scheduler)``. When the config (``config``,
``config_params`` or ``args.deepspeed_config``) has a ``"dsauto"`` block, the plan's per-layer
choices are applied (see :mod:`dsauto.runtime.deepspeed`): which ZeRO-3 layer groups keep their
parameters resident, which blocks are checkpointed, which operators are split. A config without
the block is passed through untouched, and the call is exactly ``deepspeed.initialize``.

Under ``dsauto tune --script`` (``$DSAUTO_TRIAL`` set) the call runs the trial's config instead of
the script's and measures the steps that follow (see :mod:`dsauto.refine.trial_hook`).

The config itself reaches DeepSpeed as given: DeepSpeed reads only the top-level keys it knows
(deepspeed/runtime/config.py), so the ``"dsauto"`` block rides along unread.
"""

from __future__ import annotations

from typing import Any

import deepspeed
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from torch import nn

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
        return start_trial(request, forwarded, _initialize)
    return _initialize(forwarded)


def _initialize(forwarded: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize(**forwarded)``, applying the plan of the config it is given."""
    model, model_parameters, optimizer = forwarded["model"], forwarded["model_parameters"], forwarded["optimizer"]
    resolved = _config_dict(forwarded["args"], forwarded["config"], forwarded["config_params"])
    plan = hook.plan_from_config(resolved) if resolved is not None and model is not None else None
    if plan is None:
        return deepspeed.initialize(**forwarded)

    hook.warn_if_untested(deepspeed.__version__)
    hook.check_config(plan, resolved)
    applied = hook.prepare_model(plan, model)
    forwarded["model_parameters"] = hook.repoint_parameters(model_parameters, applied.replacements)
    hook.repoint_optimizer(optimizer, applied.replacements)
    engine, ds_optimizer, dataloader, scheduler = deepspeed.initialize(**forwarded)
    hook.check_engine(engine, plan)
    hook.apply_persistence(engine, applied)
    engine.dsauto_plan = applied
    return engine, ds_optimizer, dataloader, scheduler


def _config_dict(args: Any, config: Any, config_params: Any) -> dict[str, Any] | None:
    """The config as DeepSpeed will read it, found where ``deepspeed.initialize`` looks (without
    changing ``args``); None when there is none or it cannot be read (DeepSpeed then says why)."""
    found = config if config is not None else config_params
    for name in ("deepspeed_config", "deepscale_config"):
        if found is None and getattr(args, name, None) is not None:
            found = getattr(args, name)
    if found is None or isinstance(found, dict):
        return found
    # The same reader as deepspeed.initialize: a JSON/HJSON path, or a base64-encoded config.
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    try:
        loaded = load_ds_config(found)
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None
