"""Activation checkpointing of exactly the blocks a plan names.

A checkpointed block keeps only its input for backward and runs its forward again inside backward
(Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"); the cost model charges one more
forward and keeps ``checkpoint_bytes_per_token`` (the block input) instead of its activations.

PyTorch's non-reentrant checkpoint (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``)
is used: it works with inputs that do not require grad, keeps the RNG state for dropout, and works
under ZeRO-3, whose module hooks gather the block's parameters again when the recomputation calls
its submodules (deepspeed/runtime/zero/partitioned_param_coordinator.py tracks such recompute
fetches in ``ds_recompute_parameters`` and releases them after the block's backward).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_MARK = "_dsauto_checkpointed"


def checkpoint_module(module: nn.Module) -> None:
    """Makes ``module``'s forward keep only its inputs and recompute in backward (idempotent).

    The module keeps its class, its hooks and its parameter names: only the instance's ``forward``
    is shadowed, so ``nn.Module.__call__`` and the hooks DeepSpeed registers still run around it.
    """
    if getattr(module, _MARK, False):
        return
    module.forward = checkpointed(module.forward)
    setattr(module, _MARK, True)


def checkpointed(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` keeping only its inputs for backward and run again inside backward (a module's
    ``forward``, or a block's method that calls submodules, like the reference block's ``mlp``)."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)  # evaluation: nothing is kept for backward anyway
        return checkpoint(function, *args, use_reentrant=False, **kwargs)

    return run


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`checkpoint_module` wrapped ``module``."""
    return getattr(module, _MARK, False)
