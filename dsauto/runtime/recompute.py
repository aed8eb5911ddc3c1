"""Selective recomputation in the DeepSpeed hook: the parts of a transformer block that a plan names
(``LayerChoice.recompute_modules``, :data:`dsauto.plan.RECOMPUTE_MODULES`) keep less for backward
and run again inside it, layer by layer as the plan's runs say.

The modules are the ones Megatron-core recomputes under the same names (TransformerConfig.
recompute_modules; Korthikanti et al. 2022, Sec. 5), so the cost model prices them once for both
engines (dsauto.cost.terms, ``selective_saved_bytes_per_token``):

- ``core_attn``: the block's ``core_attention`` submodule (the reference model's
  :class:`dsauto.models.gpt.CoreAttention`: queries, keys and values in, attention output out) is
  checkpointed, keeping its inputs only. A Hugging Face block has no such module: its ``self_attn``
  holds the projections too, whose recomputation the plan does not price, and is refused.
- ``mlp``: the block's dense MLP, ``mlp`` (a submodule in Hugging Face blocks, a method calling
  ``mlp_in`` and ``mlp_out`` in the reference block), is checkpointed, keeping its input only. In
  an MoE layer ``mlp`` recomputes nothing, as in Megatron-core, whose ``mlp`` is the dense MLP and
  whose MoE layer is ``moe``; the cost model counts the dense MLP only (``mlp_act_bytes_per_token``).
- ``layernorm``: the two pre-norms' outputs (the inputs of the QKV and MLP matrices) are not kept:
  the matrix multiply after a norm saves a handle instead of the output, and the norm runs again
  (without autograd) when that multiply's backward asks for it. The norm itself keeps what it
  always keeps (its input). Megatron-core does the same with ``CheckpointWithoutOutput``
  (megatron/core/tensor_parallel/random.py). The handles are ``saved_tensors_hooks`` installed
  around the block's forward; a checkpointed ``mlp`` saves its input through them too, so
  ``layernorm`` and ``mlp`` together free both.

Checkpointing is PyTorch's non-reentrant ``torch.utils.checkpoint`` (:mod:`dsauto.runtime.
checkpointing`, as for whole blocks), which keeps the RNG state for dropout and works under ZeRO-3:
the recomputed submodules' hooks gather their parameters again. Recomputed values are bit-identical
to the first ones, so training is too.

Which names a block uses is data (:data:`SUBMODULES`, :data:`PRE_NORMS`); a block that lacks the
module a plan recomputes is refused in one sentence naming the module and the block's class, before
any block is changed.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dsauto.errors import DsautoError
from dsauto.plan import Plan
from dsauto.runtime.checkpointing import checkpoint_module, checkpointed
from dsauto.runtime.layers import ModelLayers

SUBMODULES: dict[str, str] = {
    "core_attn": "core_attention",  # dsauto.models.gpt.Block (and any block that names its attention core so)
    "mlp": "mlp",  # dsauto.models.gpt.Block.mlp, Hugging Face LlamaMLP, GPT2MLP, ...
}
"""The attribute of a block that each checkpointed module (``core_attn``, ``mlp``) is."""

PRE_NORMS: tuple[tuple[str, ...], ...] = (
    ("attention_norm", "mlp_norm"),  # dsauto.models.gpt.Block (mlp_norm None: one shared norm)
    ("input_layernorm", "pre_feedforward_layernorm"),  # Gemma 2/3 (post_attention_layernorm follows attention)
    ("input_layernorm", "post_attention_layernorm"),  # Llama, Mistral, Qwen, GPT-NeoX: the MLP's pre-norm second
    ("ln_1", "ln_2"),  # GPT-2
    ("ln_attn", "ln_mlp"),  # Falcon's new decoder (40B, 180B): one norm per parallel branch
    ("self_attn_layer_norm", "final_layer_norm"),  # OPT (do_layer_norm_before: pre-norm)
    ("input_layernorm",),  # one norm feeding attention and the MLP in parallel: Falcon-7B, Command R, Phi-2
    ("ln_1",),  # GPT-J's
)
"""The attributes of a block's pre-norms (attention's, the MLP's) that ``layernorm`` recomputes; the
first spelling whose attributes the block has all of is taken, one of a single norm only for a model
with one norm a layer (ModelSpec.norms_per_layer 1)."""

_NORMS_KEY = "_dsauto_norm_outputs"


def apply_selective_recompute(plan: Plan, layers: ModelLayers) -> dict[int, tuple[str, ...]]:
    """Makes every transformer layer recompute the modules the plan names for it; returns the flat
    layers (1..L) changed and their modules. Every block is checked before any is changed."""
    moe_blocks = set(plan.model.moe_layers())
    work: list[tuple[nn.Module, tuple[str, ...], list[Any]]] = []
    done: dict[int, tuple[str, ...]] = {}
    for modules, flat_layers in plan.selective_layers().items():
        for layer in flat_layers:
            block = layers.block(layer)
            moe = layer - 1 in moe_blocks
            targets = [_target(block, layer, name, plan, moe) for name in modules]
            work.append((block, modules, targets))
            done[layer] = modules
    for block, modules, targets in work:
        for name, target in zip(modules, targets, strict=True):
            if name == "layernorm":
                _drop_norm_outputs(block, target)
            elif isinstance(target, nn.Module):
                checkpoint_module(target)
            elif target is not None:
                setattr(block, SUBMODULES[name], checkpointed(target))
    return dict(sorted(done.items()))


def _target(block: nn.Module, layer: int, name: str, plan: Plan, moe: bool) -> Any:
    """What recomputing ``name`` wraps in ``block``: a module, a method, the pre-norms, or None (an
    MoE layer's ``mlp``)."""
    where = f"transformer layer {layer} ({type(block).__name__})"
    if name == "layernorm":
        if plan.model.norm_position != "pre":
            after = "each residual add" if plan.model.norm_position == "post" else "each branch"
            raise DsautoError(f"The plan recomputes the pre-norms (layernorm) but {plan.model.name} normalises "
                              f"after {after}, so {where} has no pre-norm outputs to drop; re-plan "
                              f"without layernorm in --recompute-modules.")
        for names in PRE_NORMS:
            if len(names) == 1 and plan.model.norms_per_layer != 1:
                continue  # a block with a norm per branch recomputes both, as priced
            found = [getattr(block, n, False) for n in names]  # None: no such norm (a shared one)
            norms = [m for m in found if isinstance(m, nn.Module)]
            if norms and all(m is None or isinstance(m, nn.Module) for m in found):
                return norms
        spellings = " or ".join("/".join(n) for n in PRE_NORMS)
        raise DsautoError(f"The plan recomputes the pre-norms (layernorm) in {where}, but the block has no "
                          f"pre-norm submodules dsauto knows ({spellings}); re-plan without layernorm in "
                          f"--recompute-modules.")
    if name == "mlp" and moe:
        return None
    if name not in SUBMODULES:  # moe_act, mla_up_proj, moe, shared_experts: Megatron-core's own modules
        raise DsautoError(f"The plan recomputes {name} in {where}, which only Megatron-core's own modules "
                          f"can; re-plan with --engine megatron or without {name} in --recompute-modules.")
    attribute = SUBMODULES[name]
    target = getattr(block, attribute, None)
    if isinstance(target, nn.Module):
        return target
    if name == "mlp" and callable(target) and getattr(target, "__self__", None) is block:
        return target  # the reference block's MLP is a method over its mlp_in and mlp_out
    hint = (" (a Hugging Face self_attn also holds the QKV and output projections, whose recomputation the "
            "plan does not price)" if name == "core_attn" else "")
    raise DsautoError(f"The plan recomputes {name} in {where}, but the block has no '{attribute}' submodule"
                      f"{hint}; re-plan without {name} in --recompute-modules, or name that submodule "
                      f"'{attribute}'.")


class _NormOutputs:
    """The pre-norm outputs of one forward of a block, which the tensors saved for backward that
    share their storage are replaced by a handle for: the norm runs again when backward unpacks one."""

    def __init__(self) -> None:
        self.outputs: dict[int, tuple[weakref.ref, Callable[[], torch.Tensor], int]] = {}

    def record(self, output: torch.Tensor, rerun: Callable[[], torch.Tensor]) -> None:
        # The storage, not the tensor: ZeRO-3's module hooks hand the consumer an alias of the norm's
        # output (PreBackwardFunctionForModule in deepspeed/runtime/zero/parameter_offload.py), and a
        # storage's Python object lives exactly as long as the storage.
        storage = output.untyped_storage()
        self.outputs[storage.data_ptr()] = (weakref.ref(storage), rerun, storage.nbytes())

    def pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        found = self.outputs.get(storage.data_ptr())
        # The output must still be alive: a freed one's address may hold a new tensor.
        if found is None or found[0]() is None or found[2] != storage.nbytes() or storage.nbytes() == 0:
            return tensor
        return _Recomputed(found[1], tensor.size(), tensor.stride(), tensor.storage_offset())

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor() if isinstance(packed, _Recomputed) else packed


class _Recomputed:
    """A dropped norm output as one saved tensor saw it (a view of it, maybe), rebuilt on demand;
    the handles of one output share its rebuilt copy."""

    def __init__(self, rerun: Callable[[], torch.Tensor], size: torch.Size, stride: tuple[int, ...], offset: int):
        self.rerun, self.size, self.stride, self.offset = rerun, size, stride, offset

    def tensor(self) -> torch.Tensor:
        return self.rerun().as_strided(self.size, self.stride, self.offset)


def _drop_norm_outputs(block: nn.Module, norms: list[nn.Module]) -> None:
    """Installs ``layernorm`` recomputation on ``block`` (see the module doc)."""
    if getattr(block, _NORMS_KEY, None) is not None:
        return
    state: dict[str, _NormOutputs | None] = {"outputs": None}
    for norm in norms:
        forward = norm.forward

        @functools.wraps(forward)
        def norm_forward(x: torch.Tensor, *args: Any, _forward=forward, _norm=norm, **kwargs: Any) -> torch.Tensor:
            out = _forward(x, *args, **kwargs)
            outputs = state["outputs"]
            if outputs is not None and isinstance(out, torch.Tensor):
                outputs.record(out, _rerun_once(_norm, x, args, kwargs))
            return out

        norm.forward = norm_forward
    block_forward = block.forward

    @functools.wraps(block_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return block_forward(*args, **kwargs)
        outputs = _NormOutputs()
        state["outputs"] = outputs
        try:
            with torch.autograd.graph.saved_tensors_hooks(outputs.pack, outputs.unpack):
                return block_forward(*args, **kwargs)
        finally:
            state["outputs"] = None

    block.forward = forward
    setattr(block, _NORMS_KEY, norms)


def _rerun_once(norm: nn.Module, x: torch.Tensor, args: tuple, kwargs: dict) -> Callable[[], torch.Tensor]:
    """The norm's output computed again without autograd, once for all the handles that ask for it
    (kept while any of them lives, i.e. until the last consumer's backward has run). The module is
    called, not its bare forward, so that ZeRO-3's hooks gather its weight for the call, as they do
    for a checkpointed module's recomputation."""
    cache: list[torch.Tensor] = []

    def rerun() -> torch.Tensor:
        if not cache:
            with torch.no_grad():
                cache.append(norm(x, *args, **kwargs))
        return cache[0]

    return rerun

