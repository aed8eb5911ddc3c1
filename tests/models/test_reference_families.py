"""The reference model builds every family dsauto reads: its parameters are exactly the ones
:func:`dsauto.spec.model.layer_groups` counts, and it trains (forward and backward) on CPU."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from hf_configs import CONFIGS, DENSE  # tests/ is on sys.path through its conftest

from dsauto.models import build_model
from dsauto.spec.hf import model_from_hf_config
from dsauto.spec.model import ModelSpec


def small(name: str) -> ModelSpec:
    """The family's architecture at a size that trains in milliseconds: 2 layers, width 64."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)
    heads = 4
    kv = 1 if model.kv_heads == 1 else (heads if model.kv_heads == model.num_attention_heads else 2)
    return dataclasses.replace(
        model, num_layers=2, hidden_size=64, num_attention_heads=heads, num_kv_heads=0 if kv == heads else kv,
        ffn_hidden_size=96, vocab_size=100, max_position_embeddings=64,
        attention_head_dim=24 if model.attention_head_dim else 0,
        sliding_window=min(model.sliding_window, 8))


@pytest.mark.parametrize("name", DENSE)
def test_reference_parameters_are_the_counted_ones(name):
    model = small(name)
    with torch.device("meta"):
        net = build_model(model, vocab_size=model.vocab_size, device="meta")
    assert sum(p.numel() for p in net.parameters()) == model.num_parameters()


@pytest.mark.parametrize("name", DENSE)
def test_reference_trains(name):
    model = small(name)
    net = build_model(model, seed=1, vocab_size=model.vocab_size)
    tokens = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = net(tokens, tokens)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in net.parameters())


MOE_CONFIGS = ["glm-4.5-air", "granite-3.0-3b-a800m-base", "minimax-m2", "llama-4-maverick-text", "qwen3-30b-a3b",
               "mixtral-8x7b", "olmoe-1b-7b", "gpt-oss-20b", "qwen1.5-moe-a2.7b"]


def small_moe(name: str) -> ModelSpec:
    """A mixture of experts of the family at test size: 4 layers, 4 experts, the family's layer
    pattern, router and norms."""
    model = small(name)
    first_dense = min(model.moe_first_dense_layers, 1)
    return dataclasses.replace(
        model, num_layers=4, num_experts=4, moe_top_k=min(model.moe_top_k, 2),
        moe_ffn_hidden_size=32 if model.moe_ffn_hidden_size else 0, moe_first_dense_layers=first_dense,
        shared_expert_ffn_hidden_size=32 if model.shared_expert_ffn_hidden_size else 0,
        no_rope_every=min(model.no_rope_every, 4), global_attention_every=min(model.global_attention_every, 2))


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_reference_moe_families_hold_the_counted_parameters_and_train(name):
    model = small_moe(name)
    assert model.moe_layers()
    net = build_model(model, seed=1, vocab_size=model.vocab_size)
    assert sum(p.numel() for p in net.parameters()) == model.num_parameters()
    tokens = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = net(tokens, tokens)
    loss.backward()
    assert torch.isfinite(loss)


def test_sink_attention_is_a_softmax_with_one_more_logit_per_head():
    from dsauto.models.gpt import _sink_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    sinks = torch.randn(3)
    out = _sink_attention(q, k, v, sinks, causal=True, dropout=0.0, gqa={})
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    with_sink = torch.cat((scores, sinks.view(1, 3, 1, 1).expand(2, 3, 5, 1)), dim=-1)
    expected = torch.softmax(with_sink, dim=-1)[..., :5] @ v
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
