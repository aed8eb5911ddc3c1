"""The plan's flat layers found in a user's ``nn.Module``: the embedding, the blocks, the head.

A plan numbers layers in execution order: 0 is the embedding, 1..L the transformer blocks, L+1 the
head (final norm, LM head, loss). A model is mapped onto that numbering in one of two ways:

- the reference names (:class:`dsauto.models.ReferenceModel`): ``embedding``, ``layers`` (an
  ``nn.ModuleList`` of L blocks) and ``head``;
- otherwise (Hugging Face models among them: ``model.model.layers`` or ``transformer.h``, with
  ``lm_head``) the blocks are the longest ``nn.ModuleList`` whose children are all of one class, the
  embedding is every ``nn.Embedding`` outside the blocks together with the modules whose name says
  ``embed`` (BERT's ``embeddings`` with its norm, BLOOM's ``word_embeddings_layernorm``), except the
  model's output embedding (``get_output_embeddings()``: GPT-NeoX's ``embed_out`` is its LM head),
  and the head is every other parameter (final norm, LM head).

Each parameter belongs to the first layer that uses it in that order, so a tied LM head weight is the
embedding's, as :func:`dsauto.spec.model.layer_groups` counts it. A model that does not match the
plan (another block count, another shape, a layer the plan names that the model lacks) is refused
before anything is changed.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from torch import nn

from dsauto.errors import DsautoError, DsautoWarning
from dsauto.plan import Plan
from dsauto.spec.hf import HfConfigLike, model_from_hf_config
from dsauto.spec.model import ModelSpec, block_parameters

# The attribute names of dsauto.models.ReferenceModel.
EMBEDDING_NAME, BLOCKS_NAME, HEAD_NAME = "embedding", "layers", "head"


@dataclass(frozen=True)
class ModelLayers:
    """Where the plan's layers live in one model."""

    model: nn.Module
    """The whole model."""
    blocks: nn.ModuleList
    """The transformer blocks, layers 1..L in order."""
    blocks_name: str
    """Qualified name of ``blocks`` inside ``model`` (for messages)."""
    embedding: nn.Module | None
    """The embedding module (layer 0) when the model names one; else the ``nn.Embedding``s outside
    the blocks are layer 0."""
    head: nn.Module | None
    """The head module (layer L+1) when the model names one; else every parameter that is in neither
    the embedding nor a block is layer L+1."""

    @property
    def num_layers(self) -> int:
        """L, the number of transformer blocks."""
        return len(self.blocks)

    def block(self, layer: int) -> nn.Module:
        """The block of flat layer ``layer`` (1..L)."""
        return self.blocks[layer - 1]

    def embedding_modules(self) -> list[nn.Module]:
        """The modules whose parameters form layer 0."""
        if self.embedding is not None:
            return [self.embedding]
        inside = {id(m) for m in self.blocks.modules()}
        output = getattr(self.model, "get_output_embeddings", None)
        output = output() if callable(output) else None
        return [m for name, m in self.model.named_modules()
                if id(m) not in inside and m is not output
                and (isinstance(m, nn.Embedding) or "embed" in name.rsplit(".", 1)[-1].lower())
                and not any(sub is self.blocks for sub in m.modules())]

    def parameters_by_layer(self) -> list[list[nn.Parameter]]:
        """The model's parameters grouped by flat layer 0..L+1, each parameter once (its first layer).

        Read afresh on each call: operator splitting replaces parameters.
        """
        seen: set[int] = set()

        def take(params) -> list[nn.Parameter]:
            out = []
            for p in params:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
            return out

        layers = [take(p for m in self.embedding_modules() for p in m.parameters())]
        layers += [take(block.parameters()) for block in self.blocks]
        layers.append(take(self.model.parameters()))  # the rest: the head (and anything unnamed)
        return layers


def find_layers(model: nn.Module) -> ModelLayers:
    """Finds the embedding, the block list and the head of ``model``."""
    blocks = getattr(model, BLOCKS_NAME, None)
    if isinstance(blocks, nn.ModuleList):
        return ModelLayers(model=model, blocks=blocks, blocks_name=BLOCKS_NAME,
                           embedding=_module_or_none(model, EMBEDDING_NAME),
                           head=_module_or_none(model, HEAD_NAME))
    candidates = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1]
    if not candidates:
        raise DsautoError(
            f"{type(model).__name__} has no nn.ModuleList of identical blocks, so dsauto cannot find "
            f"the transformer layers the plan numbers 1..L; keep the blocks in an nn.ModuleList "
            f"(as model.{BLOCKS_NAME})."
        )
    name, blocks = max(candidates, key=lambda c: len(c[1]))
    return ModelLayers(model=model, blocks=blocks, blocks_name=name, embedding=None, head=None)


def _module_or_none(model: nn.Module, name: str) -> nn.Module | None:
    module = getattr(model, name, None)
    return module if isinstance(module, nn.Module) else None


BLOCK_PARAMETER_TOLERANCE = 0.05
"""How far the transformer blocks' parameters of a model without a spec or config may be from the
plan's (biases or norms the model adds or lacks) before the plan is refused."""


def _check_block_parameters(spec: ModelSpec, layers: ModelLayers, ep: int) -> None:
    """Refuses a model, described by no spec or config, whose transformer blocks hold another number
    of parameters than the plan's model: its shape is not the one the plan priced (a hidden size of
    1024 planned as 128 would run, its memory and time unpredicted). A parameter partitioned by
    ``deepspeed.zero.Init`` counts whole (``ds_numel``); a rank's DeepSpeed-MoE layers hold 1/ep of
    the routed experts (``deepspeed.moe.layer.MoE(ep_size=ep)``)."""
    blocks = layers.parameters_by_layer()[1:-1]
    held = sum(getattr(p, "ds_numel", p.numel()) for block in blocks for p in block)
    parts = block_parameters(spec)
    moe_layers = len(spec.moe_layers())
    elsewhere = moe_layers * parts.expert * (parts.num_experts - parts.num_experts // ep)  # other ranks' experts
    planned = parts.total(moe_layers, spec.num_layers) - elsewhere
    if abs(held - planned) > BLOCK_PARAMETER_TOLERANCE * planned:
        raise DsautoError(
            f"The model's {layers.num_layers} transformer blocks hold {held:,} parameters but the plan was made for "
            f"{planned:,} ({spec.name}), so its memory and time are not this model's; re-plan for this model or "
            f"build the model the plan describes."
        )


def check_plan_matches(plan: Plan, layers: ModelLayers) -> None:
    """Refuses a plan that does not describe ``layers``' model, naming what differs."""
    spec, count = plan.model, layers.num_layers
    if count != spec.num_layers:
        raise DsautoError(
            f"The plan is for {spec.num_layers} transformer layers ({spec.name}) but the model's "
            f"{layers.blocks_name} holds {count} blocks; re-plan for this model or build the model "
            f"the plan describes."
        )
    model_spec = getattr(layers.model, "spec", None)
    config = getattr(layers.model, "config", None)
    if model_spec is None and isinstance(config, HfConfigLike):  # a Hugging Face model: its config says
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DsautoWarning)  # keys the plan's reading already named
            model_spec = model_from_hf_config(config.to_dict(), f"the {type(layers.model).__name__}'s config")
    if isinstance(model_spec, ModelSpec):
        for field in dataclasses.fields(ModelSpec):
            ours, theirs = getattr(model_spec, field.name), getattr(spec, field.name)
            if field.name != "name" and ours != theirs:
                raise DsautoError(
                    f"The model's {field.name} is {ours!r} but the plan was made for {theirs!r} "
                    f"({spec.name}); re-plan for this model or build the model the plan describes."
                )
    expected = {0: "embedding", count + 1: "head"}
    for run in plan.layers:
        for layer in range(run.first, run.last + 1):
            want = expected.get(layer, spec.architecture)
            if run.group != want:
                raise DsautoError(
                    f"The plan names layers {run.first}..{run.last} {run.group!r}, but layer {layer} of "
                    f"this model is its {want!r} (0 = embedding, 1..{count} = {spec.architecture} "
                    f"blocks, {count + 1} = head); re-plan for this model."
                )
    if not layers.parameters_by_layer()[0]:
        raise DsautoError(
            f"The plan's layer 0 is an embedding, but {type(layers.model).__name__} has no "
            f"'{EMBEDDING_NAME}' module and no nn.Embedding outside its blocks; name the embedding "
            f"module '{EMBEDDING_NAME}'."
        )
    if model_spec is None:  # nothing describes the model: its blocks' size must be the plan's
        _check_block_parameters(spec, layers, plan.ep)
