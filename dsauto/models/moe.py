"""The mixture-of-experts layer of the reference model: a router, top-k routed experts and an optional
shared expert, in place of a dense MLP (Shazeer et al. 2017; Lepikhin et al. 2021, GShard, Sec. 2.2).

Two implementations of the same parameters:

- dsauto's own (``deepspeed_ep=None``): dropless token choice, as Megatron-core routes by default
  (``moe_expert_capacity_factor`` None): each token goes to its top-k experts, each expert runs
  exactly the tokens routed to it, and the outputs are combined weighted by the router's
  probabilities. One process, every expert local; ZeRO (any stage) treats experts as parameters.
- DeepSpeed-MoE (``deepspeed_ep=ep``): the routed experts are a ``deepspeed.moe.layer.MoE`` with
  ``ep_size=ep``, which DeepSpeed's engine puts in expert-parallel groups and whose tokens move by
  all-to-all. Its gate (``TopKGate``) keeps DeepSpeed's defaults, capacity factor
  :data:`DEEPSPEED_CAPACITY_FACTOR` with token dropping: every expert gets a buffer of
  ``ceil(k x tokens / experts x capacity factor)`` slots (``_capacity`` in
  deepspeed/moe/sharded_moe.py), so every rank runs the same expert work whatever the routing.
  DeepSpeed does not run its MoE layer under ZeRO-3 (``_validate_zero3_moe_compatibility`` in
  deepspeed/runtime/engine.py).

The router's scores are a softmax over the experts in both (a ``sigmoid`` router, DeepSeek-V3's, has
the same parameters and cost and is built as a softmax); the load-balancing loss is not added to the
training loss; Llama 4's weighting of the expert's input (``moe_probs_on_input``) weights its
output here (the same cost). The router's bias (``moe_router_bias``, gpt-oss) is built in the own implementation;
DeepSpeed-MoE's gate has none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsauto.spec.hf import QUICK_GELU_ALPHA
from dsauto.spec.model import ModelSpec

DEEPSPEED_CAPACITY_FACTOR = 1.0
"""Capacity factor of DeepSpeed-MoE's gate in the reference model: DeepSpeed's default
(``deepspeed.moe.layer.MoE(capacity_factor=1.0)``), with its default token dropping."""


class Expert(nn.Module):
    """One feed-forward expert of width ``ffn`` (gated: fused gate/up matrix, as Megatron fuses it)
    with the activation function ``act``."""

    def __init__(self, model: ModelSpec, ffn: int, bias: bool, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        h = model.hidden_size
        self.gated = model.gated_mlp
        self.act = act
        self.glu_clamp = model.glu_clamp
        self.mlp_in = nn.Linear(h, (2 if self.gated else 1) * ffn, bias=bias)
        self.mlp_out = nn.Linear(ffn, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return feed_forward(x, self.mlp_in, self.mlp_out, self.act, self.gated, self.glu_clamp)


def feed_forward(x: torch.Tensor, mlp_in: nn.Module, mlp_out: nn.Module,
                 act: Callable[[torch.Tensor], torch.Tensor], gated: bool, glu_clamp: float = 0.0) -> torch.Tensor:
    """A feed-forward block: ``mlp_in``, the activation (on the gate half times the up half when
    ``gated``, the fused gate/up matrix's output; gpt-oss's clamped one with ``glu_clamp``),
    ``mlp_out``; a dense layer's MLP and an expert alike."""
    inner = mlp_in(x)
    if gated:
        gate, up = inner.chunk(2, dim=-1)
        inner = clamped_glu(gate, up, glu_clamp) if glu_clamp else act(gate) * up
    else:
        inner = act(inner)
    return mlp_out(inner)


def clamped_glu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation as transformers computes it (``GptOssExperts._apply_gate``): both
    halves clamped, the gate's ``x sigmoid(1.702 x)`` times the linear half plus one; so it keeps what
    that keeps (``dsauto.spec.model.unfused_extra_widths``)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * QUICK_GELU_ALPHA))


class MoeMlp(nn.Module):
    """Router, routed experts and shared expert of one MoE layer; ``forward(x)`` maps (b, s, h) to
    (b, s, h) like a dense MLP; ``act`` is the model's activation function."""

    def __init__(self, model: ModelSpec, act: Callable[[torch.Tensor], torch.Tensor], deepspeed_ep: int | None = None):
        super().__init__()
        h, experts, k = model.hidden_size, model.num_experts, model.moe_top_k
        self.top_k = k
        self.deepspeed_ep = deepspeed_ep
        expert = Expert(model, model.expert_ffn_hidden_size, model.moe_expert_bias, act)
        if deepspeed_ep is None:
            self.router = nn.Linear(h, experts, bias=model.moe_router_bias)
            self.experts = nn.ModuleList([expert] + [Expert(model, model.expert_ffn_hidden_size, model.moe_expert_bias, act)
                                                     for _ in range(experts - 1)])
            self.deepspeed_moe = None
        else:
            from deepspeed.moe.layer import MoE

            # min_capacity 0: the capacity follows the tokens alone; no second-expert sampling, so
            # top-2 routing is the plain top-2 of the scores.
            self.deepspeed_moe = MoE(h, expert, num_experts=experts, ep_size=deepspeed_ep, k=k,
                                     capacity_factor=DEEPSPEED_CAPACITY_FACTOR,
                                     eval_capacity_factor=DEEPSPEED_CAPACITY_FACTOR, min_capacity=0,
                                     top2_2nd_expert_sampling=False)
            self.router, self.experts = None, None
        fs = model.shared_expert_ffn_hidden_size
        self.shared = Expert(model, fs, False, act) if fs else None  # no biases (spec.model.block_parameters)
        self.shared_gate = nn.Linear(h, 1, bias=False) if fs and model.shared_expert_gate else None

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' combined output for the tokens ``x`` (n, h)."""
        if self.deepspeed_moe is not None:
            return self.deepspeed_moe(x)[0]
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        # Tokens sorted by expert (Megatron-core's permutation), each expert's slice run at once.
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_of = order // self.top_k
        outputs = torch.cat([expert(x_e) for expert, x_e in
                             zip(self.experts, x.index_select(0, token_of).split(counts))])
        weighted = outputs * weights.flatten().index_select(0, order).unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token_of, weighted)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        out = self.routed(tokens)
        if self.shared is not None:
            shared = self.shared(tokens)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(tokens))
            out = out + shared
        return out.view(shape)


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters of a reference model (both implementations)."""
    params = []
    for m in module.modules():
        if isinstance(m, MoeMlp):
            experts = m.experts if m.experts is not None else m.deepspeed_moe.deepspeed_moe.experts
            params.extend(experts.parameters())
    return params
