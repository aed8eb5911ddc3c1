"""The reference models as the layer list of DeepSpeed's ``PipelineModule``.

``LayerSpec``s, so that each pipeline rank builds only its own stage's layers: the embedding, the
transformer layers, and the head's logits, with the cross-entropy left to the engine's ``loss_fn``
(:func:`dsauto.models.gpt.logits_loss`). A model with tied embeddings gets DeepSpeed's
``TiedLayerSpec`` at both ends: the first stage's embedding and the last stage's output projection
share one table, which DeepSpeed builds on both stages and keeps in sync by all-reducing its
gradient between them (deepspeed/runtime/pipe/module.py, ``TiedLayerSpec``); the final norm is a
layer of its own before the projection.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from dsauto.errors import DsautoError
from dsauto.models.gpt import Block, Embedding, HeadInput, Logits, init_weights, tied_logits
from dsauto.spec.model import ModelSpec

TIED_KEY = "embedding"
"""The ``TiedLayerSpec`` key of the shared token table."""


@functools.cache
def initialized(layer: type[nn.Module]) -> type[nn.Module]:
    """``layer`` initialised as :func:`dsauto.models.build_model` initialises the whole model (GPT-2's
    scheme), under the same class name (the name the pipeline's block detection reads)."""

    class Initialized(layer):  # type: ignore[misc, valid-type]
        def __init__(self, model: ModelSpec, *args: Any) -> None:
            super().__init__(model, *args)
            init_weights(self, model.num_layers)

    Initialized.__name__ = Initialized.__qualname__ = layer.__name__
    return Initialized


def pipeline_layer_specs(model: ModelSpec, vocab_size: int) -> list[Any]:
    """The layer list of ``model`` for a ``PipelineModule`` (its blocks are the ``Block`` entries)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    embedding = initialized(Embedding)
    blocks = [LayerSpec(initialized(Block), model) for _ in range(model.num_layers)]
    if not model.tied_embeddings:
        return [LayerSpec(embedding, model, vocab_size), *blocks, LayerSpec(initialized(Logits), model, vocab_size)]
    if model.head_bias:
        raise DsautoError(f"{model.name} ties its LM head to the embedding and gives it a bias over the vocabulary, "
                          f"which dsauto's DeepSpeed pipeline layers do not build; plan with --pp 1 or "
                          f"--engine megatron.")
    table = ["tokens.weight"]
    return [TiedLayerSpec(TIED_KEY, embedding, model, vocab_size, tied_weight_attr=table), *blocks,
            LayerSpec(initialized(HeadInput), model),
            TiedLayerSpec(TIED_KEY, embedding, model, vocab_size, forward_fn=tied_logits(model.final_logit_softcap, model.logit_scale),
                          tied_weight_attr=table)]
