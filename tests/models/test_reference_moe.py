"""The reference MoE layer: exactly the parameters :func:`dsauto.spec.model.layer_groups` counts (own
and DeepSpeed-MoE implementations), dropless top-k routing as defined (checked token by token), and a
model with dense and MoE layers trains on CPU."""

from __future__ import annotations

import torch

from dsauto.models import build_model
from dsauto.models.moe import MoeMlp, expert_parameters
from dsauto.spec.model import ModelSpec

MOE = ModelSpec(name="moe-tiny", architecture="decoder", num_layers=3, hidden_size=64, num_attention_heads=4,
                ffn_hidden_size=128, vocab_size=100, max_position_embeddings=64, mlp="swiglu", norm="rmsnorm",
                position_embedding="rope", linear_bias=False, dropout=False, tied_embeddings=False,
                num_experts=4, moe_top_k=2, moe_ffn_hidden_size=48, shared_expert_ffn_hidden_size=32,
                shared_expert_gate=True, moe_first_dense_layers=1, moe_expert_bias=True)


def test_reference_moe_parameters_are_the_counted_ones():
    for deepspeed_ep in (None, 1):
        net = build_model(MOE, vocab_size=MOE.vocab_size, deepspeed_ep=deepspeed_ep)
        assert sum(p.numel() for p in net.parameters()) == MOE.num_parameters()
        assert [layer.moe is not None for layer in net.layers] == [False, True, True]  # first layer dense
        experts = sum(p.numel() for p in expert_parameters(net))
        assert experts == 2 * MOE.num_experts * (2 * 64 * 48 + 48 * 64 + 2 * 48 + 64)


def test_dropless_routing_sends_each_token_to_its_top_k_experts():
    torch.manual_seed(0)
    layer = MoeMlp(MOE, torch.nn.functional.silu)
    x = torch.randn(2, 5, 64)
    out = layer(x)
    expected = []
    for token in x.reshape(-1, 64):
        probs = torch.softmax(layer.router(token), -1)
        weights, chosen = probs.topk(2)
        weights = weights / weights.sum()
        routed = sum(w * layer.experts[int(e)](token) for w, e in zip(weights, chosen))
        shared = layer.shared(token) * torch.sigmoid(layer.shared_gate(token))
        expected.append(routed + shared)
    torch.testing.assert_close(out, torch.stack(expected).view(2, 5, 64), rtol=1e-5, atol=1e-6)


def test_reference_moe_trains():
    for deepspeed_ep in (None, 1):
        net = build_model(MOE, seed=1, vocab_size=MOE.vocab_size, deepspeed_ep=deepspeed_ep)
        tokens = torch.randint(0, MOE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = net(tokens, tokens)
        loss.backward()
        assert torch.isfinite(loss)
        assert all(p.grad is not None for p in net.parameters())
