"""A transformer (GPT / LLaMA decoder or BERT-style encoder) whose modules follow the plan's layers.

The model is three parts in execution order, the same numbering as :class:`dsauto.plan.Plan`:
``embedding`` (layer 0), ``layers[0..L-1]`` (layers 1..L) and ``head`` (layer L+1: final norm,
LM head and cross-entropy). Its parameters are exactly those :func:`dsauto.spec.model.layer_groups`
counts, so measured and analytic costs describe the same network. Written in the style of nanoGPT:
one file, plain modules, fused QKV and (for SwiGLU) fused gate/up matrices as Megatron fuses them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsauto.spec.model import ModelSpec

# scaled_dot_product_attention takes enable_gqa from torch 2.5 on.
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _norm(model: ModelSpec) -> nn.Module:
    if model.norm == "rmsnorm":
        return nn.RMSNorm(model.hidden_size, eps=1e-5)
    return nn.LayerNorm(model.hidden_size, eps=1e-5)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class _Rope(torch.autograd.Function):
    """Rotary position embedding (Su et al. 2021, Eq. 34). A rotation's gradient is the inverse
    rotation, so, like Megatron's fused RoPE kernel, it keeps nothing but the angles for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def _rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding on ``x`` of shape (b, heads, s, d)."""
    s, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv_freq)
    return _Rope.apply(x, angles.cos().to(x.dtype), angles.sin().to(x.dtype))


class Embedding(nn.Module):
    """Token (and learned position, and for encoders token-type) embeddings."""

    def __init__(self, model: ModelSpec, vocab_size: int):
        super().__init__()
        h = model.hidden_size
        self.tokens = nn.Embedding(vocab_size, h)
        self.positions = (nn.Embedding(model.max_position_embeddings, h)
                          if model.position_embedding == "learned" else None)
        encoder = model.architecture == "encoder"
        self.token_types = nn.Embedding(2, h) if encoder else None
        self.norm = _norm(model) if encoder else None
        self.dropout = nn.Dropout(0.1 if model.dropout else 0.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens)
        if self.positions is not None:
            x = x + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        if self.token_types is not None:
            x = x + self.token_types.weight[0]
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


class Block(nn.Module):
    """One pre-norm transformer layer: attention and MLP, each with a residual connection.

    ``tp > 1`` builds the per-rank shard of a Megatron tensor-parallel layer (Shoeybi et al. 2019,
    Sec. 3): 1/tp of the heads and of the MLP width, full-width norms, without the all-reduces, so
    the profiler can time one rank's compute on one device.
    """

    def __init__(self, model: ModelSpec, tp: int = 1):
        super().__init__()
        h, bias = model.hidden_size, model.linear_bias
        self.heads, self.kv_heads = model.num_attention_heads // tp, model.kv_heads // tp
        self.head_dim = model.head_dim
        ffn = model.ffn_hidden_size // tp
        self.causal = model.architecture == "decoder"
        self.rope = model.position_embedding == "rope"
        self.swiglu = model.mlp == "swiglu"
        p = 0.1 if model.dropout else 0.0
        self.attention_norm = _norm(model)
        self.qkv = nn.Linear(h, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=bias)
        self.proj = nn.Linear(self.heads * self.head_dim, h, bias=bias)
        self.mlp_norm = _norm(model)
        self.mlp_in = nn.Linear(h, (2 if self.swiglu else 1) * ffn, bias=bias)
        self.mlp_out = nn.Linear(ffn, h, bias=bias)
        self.attention_dropout, self.dropout = p, nn.Dropout(p)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        kv_width = self.kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, kv_width, kv_width], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = _rope(q), _rope(k)
        gqa = {}
        if self.kv_heads != self.heads:  # grouped-query attention: each KV head serves a group of queries
            if _SDPA_GQA:  # the kernel broadcasts the KV heads, keeping no expanded copies
                gqa = {"enable_gqa": True}
            else:
                k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
                v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                             dropout_p=self.attention_dropout if self.training else 0.0, **gqa)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.mlp_in(x)
        if self.swiglu:
            gate, up = inner.chunk(2, dim=-1)
            inner = F.silu(gate) * up
        else:
            inner = F.gelu(inner, approximate="tanh")
        return self.mlp_out(inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class Head(nn.Module):
    """Final norm, (encoder: dense + GeLU + norm transform), LM head and mean cross-entropy."""

    def __init__(self, model: ModelSpec, vocab_size: int, tied_weight: nn.Parameter | None):
        super().__init__()
        h = model.hidden_size
        self.norm = _norm(model)
        encoder = model.architecture == "encoder"
        self.transform = nn.Sequential(nn.Linear(h, h), nn.GELU(), _norm(model)) if encoder else None
        self.lm_head = nn.Linear(h, vocab_size, bias=False)
        if tied_weight is not None:
            self.lm_head.weight = tied_weight

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The input of the LM head matrix."""
        x = self.norm(x)
        return self.transform(x) if self.transform is not None else x

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.hidden(x))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


class ReferenceModel(nn.Module):
    """``embedding`` → ``layers`` → ``head``; ``forward(tokens, labels)`` returns the mean loss."""

    def __init__(self, model: ModelSpec, vocab_size: int | None = None):
        super().__init__()
        self.spec = model
        vocab = vocab_size or model.padded_vocab_size(1)
        self.embedding = Embedding(model, vocab)
        self.layers = nn.ModuleList(Block(model) for _ in range(model.num_layers))
        self.head = Head(model, vocab, self.embedding.tokens.weight if model.tied_embeddings else None)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x, labels)


def _init_weights(module: nn.Module, num_layers: int) -> None:
    """GPT-2 initialisation: N(0, 0.02), residual output projections scaled by 1/sqrt(2L)
    (Radford et al. 2019, Sec. 2.3)."""
    for name, param in module.named_parameters():
        if param.dim() >= 2:
            std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("proj.weight", "mlp_out.weight")) else 0.02
            nn.init.normal_(param, mean=0.0, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(param)


def build_model(model: ModelSpec, seed: int = 0, vocab_size: int | None = None,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> ReferenceModel:
    """The reference network for ``model`` with seeded random weights (same seed, same weights)."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        net = ReferenceModel(model, vocab_size)
        _init_weights(net, model.num_layers)
    finally:
        torch.random.set_rng_state(generator_state)
    return net.to(device=device, dtype=dtype)
