"""A DeepSpeed pipeline plan applied: the ``PipelineModule`` cut where the plan cuts it.

DeepSpeed's pipeline engine trains a ``PipelineModule`` (deepspeed/runtime/pipe/module.py): a flat
list of layers (``LayerSpec``s, modules or plain functions), of which each rank builds only its own
stage's. Its partition methods (``uniform``, ``parameters``, ``type:...``) balance counts or
parameters; a plan cuts where its pipeline DP found the step fastest under the memory limit
(``Plan.stage_layers``: transformer layers per stage, the embedding on the first stage and the head
on the last), which is often uneven (the last stage holds the head and its logits). So
:func:`pipeline_module` builds the module with the plan's cut: the transformer blocks of the list
(the entries of one type occurring L times, or ``block_type``) are dealt to the stages in the plan's
counts; what lies before the first block joins the first stage, and anything between or after blocks
stays with the block before it. The blocks the plan checkpoints are wrapped
(:func:`dsauto.runtime.checkpointing.checkpoint_module`) as the stage builds them, so DeepSpeed's
own uniform ``activation_checkpoint_interval`` stays 0.

What a DeepSpeed pipeline cannot take is refused before anything is built: a split head (the engine
applies ``loss_fn`` to the last layer's whole output, so the loss cannot be chunked; the search does
not split it for these plans), selective recomputation and DeepSpeed-MoE layers inside a
``PipelineModule``. ZeRO 2-3, tensor parallelism, interleaving and DeepSpeed-Ulysses never reach a
DeepSpeed pipeline plan (dsauto.engines.rules).

Tested with DeepSpeed 0.19.8; it overrides ``PipelineModule._partition_layers``, the one method that
sets the stage boundaries (``parts``) and this rank's slice of the list (``_set_bounds``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from dsauto.errors import DsautoError
from dsauto.plan import Plan
from dsauto.plan_io import plan_id
from dsauto.runtime.checkpointing import checkpoint_module

LAYOUT = "dsauto_layout"
"""Attribute of a ``PipelineModule`` built by :func:`pipeline_module`: its :class:`PipelineLayout`."""


@dataclass(frozen=True)
class PipelineLayout:
    """Where a plan's layers sit in a ``PipelineModule``'s layer list, and what this rank applied."""

    plan: Plan
    """The plan the module was cut for."""
    blocks: tuple[int, ...]
    """Index in the layer list of each transformer layer 1..L."""
    parts: tuple[int, ...]
    """DeepSpeed's stage boundaries: stage s builds list entries ``parts[s]`` to ``parts[s + 1] - 1``."""
    stage: int = 0
    """This rank's pipeline stage."""
    checkpointed: tuple[int, ...] = ()
    """Flat layers (1..L) this rank built and wrapped in activation checkpointing."""


def _type_name(entry: Any) -> str:
    """The class name of a layer-list entry (a LayerSpec's module type, a module's class, or a function)."""
    typename = getattr(entry, "typename", None)
    if isinstance(typename, type):
        return typename.__name__
    if isinstance(entry, nn.Module):
        return type(entry).__name__
    return getattr(entry, "__name__", type(entry).__name__)


def block_positions(plan: Plan, layers: Sequence[Any], block_type: type | str | None = None) -> tuple[int, ...]:
    """The list index of each transformer layer 1..L: the entries of ``block_type`` (a class or its
    name), or, when not given, of the one type that occurs exactly L times."""
    count = plan.model.num_layers
    names = [_type_name(entry) for entry in layers]
    if block_type is None:
        candidates = sorted(name for name, n in Counter(names).items() if n == count)
        if len(candidates) != 1:
            found = ", ".join(f"{name} x {n}" for name, n in Counter(names).most_common(4))
            raise DsautoError(
                f"The plan's model has {count} transformer layers, and {'no' if not candidates else 'more than one'} "
                f"type of the {len(layers)} pipeline layers occurs {count} times ({found}); name the block "
                f"class with block_type=.")
        wanted = candidates[0]
    else:
        wanted = block_type if isinstance(block_type, str) else block_type.__name__
    positions = tuple(i for i, name in enumerate(names) if name == wanted)
    if len(positions) != count:
        raise DsautoError(f"The pipeline layers hold {len(positions)} {wanted} entries but the plan's model "
                          f"{plan.model.name} has {count} transformer layers; plan the model that is trained.")
    return positions


def stage_parts(plan: Plan, blocks: Sequence[int], num_entries: int) -> tuple[int, ...]:
    """DeepSpeed's ``parts`` for the plan's cut: stage s starts at its first block (the first stage at
    the list's start) and the last stage ends at the list's end."""
    firsts, seen = [], 0
    for count in plan.stage_layers[:-1]:
        seen += count
        firsts.append(blocks[seen])
    return (0, *firsts, num_entries)


def check_pipeline_plan(plan: Plan) -> None:
    """Refuses a plan that DeepSpeed's pipeline engine cannot run as priced (see the module doc)."""
    if plan.engine != "deepspeed":
        raise DsautoError(f"This plan was made for {plan.engine}; train it with dsauto.megatron, or re-plan "
                          f"with --engine deepspeed.")
    if plan.pp == 1:
        raise DsautoError("This plan has no pipeline (pp=1); build the model as one module and pass it to "
                          "dsauto.deepspeed.initialize, or re-plan with --pp.")
    if plan.tp > 1 or plan.virtual_stages > 1 or plan.cp > 1:
        raise DsautoError(f"DeepSpeed's pipeline engine runs neither tensor parallelism, interleaved stages nor "
                          f"Ulysses, but this plan has tp={plan.tp}, {plan.virtual_stages} virtual stages and "
                          f"cp={plan.cp}; train it with dsauto.megatron or re-plan with --engine deepspeed.")
    head = plan.model.num_layers + 1
    if plan.layer_choice(head).split > 1:
        raise DsautoError(f"The plan computes the LM head's loss in {plan.layer_choice(head).split} chunks, but "
                          f"DeepSpeed's pipeline engine applies loss_fn to the last layer's whole output; "
                          f"re-plan with this dsauto, which does not split the head of a DeepSpeed pipeline.")
    if plan.selective_layers():
        raise DsautoError("The plan recomputes modules selectively, which dsauto applies to whole models only, "
                          "not to a PipelineModule's stages; re-plan with --recompute-modules none.")
    if plan.model.moe:
        raise DsautoError(f"{plan.model.name} has MoE layers, which dsauto does not place in a PipelineModule; "
                          f"re-plan with --pp 1, or with --engine megatron.")


def pipeline_module(plan: Plan, layers: Sequence[Any], loss_fn: Callable[..., Any] | None = None,
                    block_type: type | str | None = None, **kwargs: Any) -> nn.Module:
    """DeepSpeed's ``PipelineModule`` of ``layers`` cut into the plan's stages, with the plan's
    checkpointed blocks wrapped; ``kwargs`` go to ``PipelineModule`` (``topology``, ``seed_layers``,
    ...), but for ``num_stages``, ``partition_method`` and ``activation_checkpoint_interval``,
    which the plan sets. Call it on every rank after ``deepspeed.init_distributed()``."""
    from deepspeed.pipe import PipelineModule

    check_pipeline_plan(plan)
    owned = sorted({"num_stages", "partition_method"} & kwargs.keys())
    if kwargs.get("activation_checkpoint_interval"):
        owned.append("activation_checkpoint_interval")
    if owned:
        raise DsautoError(f"The plan sets {', '.join(owned)} (its {plan.pp} stages of {list(plan.stage_layers)} "
                          f"transformer layers, its checkpointed layers); leave {'them' if len(owned) > 1 else 'it'} out.")
    layers = list(layers)
    blocks = block_positions(plan, layers, block_type)
    parts = stage_parts(plan, blocks, len(layers))

    class PlannedPipelineModule(PipelineModule):
        """A ``PipelineModule`` whose stages are the plan's."""

        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = list(parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=parts[stage], stop=parts[stage + 1])

    module = PlannedPipelineModule(layers, num_stages=plan.pp, loss_fn=loss_fn, **kwargs)
    checkpointed = []
    for layer, index in enumerate(blocks, start=1):
        child = module._modules.get(str(index))  # DeepSpeed registers each built layer under its list index
        if child is not None and plan.layer_choice(layer).checkpoint:
            checkpoint_module(child)
            checkpointed.append(layer)
    setattr(module, LAYOUT, PipelineLayout(plan=plan, blocks=blocks, parts=parts, stage=module.stage_id,
                                           checkpointed=tuple(checkpointed)))
    return module


def check_pipeline_module(plan: Plan, model: Any) -> PipelineLayout:
    """The layout of ``model``, a ``PipelineModule`` built by :func:`pipeline_module` for ``plan``;
    refuses anything else for a pipeline plan."""
    layout = getattr(model, LAYOUT, None)
    if not isinstance(layout, PipelineLayout):
        raise DsautoError(
            f"The plan cuts the model into {plan.pp} pipeline stages of {list(plan.stage_layers)} transformer "
            f"layers, but {type(model).__name__} was not built for it; build it with "
            f"dsauto.deepspeed.pipeline_module(config, layers, loss_fn=...).")
    if plan_id(layout.plan) != plan_id(plan):
        raise DsautoError(f"The PipelineModule was cut for another plan ({list(layout.plan.stage_layers)} layers "
                          f"per stage) than the config's ({list(plan.stage_layers)}); build it from the same config.")
    return layout
