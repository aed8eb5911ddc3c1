"""A transformer (GPT / LLaMA decoder or BERT-style encoder) whose modules follow the plan's layers.

The model is three parts in execution order, the same numbering as :class:`dsauto.plan.Plan`:
``embedding`` (layer 0), ``layers[0..L-1]`` (layers 1..L) and ``head`` (layer L+1: final norm,
LM head and cross-entropy). Its parameters are exactly those :func:`dsauto.spec.model.layer_groups`
counts, so measured and analytic costs describe the same network. Written in the style of nanoGPT:
one file, plain modules, fused QKV and (for SwiGLU) fused gate/up matrices as Megatron fuses them,
and RMSNorm and the Python tanh GeLUs computed as Hugging Face's modeling code computes them, which
is what DeepSpeed trains (the activations they keep are priced so: ``unfused_extra_widths``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsauto.models.moe import MoeMlp, feed_forward
from dsauto.spec.model import ModelSpec, rmsnorm_weight_in_fp32

# scaled_dot_product_attention takes enable_gqa from torch 2.5 on.
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _norm(model: ModelSpec, width: int | None = None) -> nn.Module:
    width = width or model.hidden_size
    if model.norm == "rmsnorm":
        return RMSNorm(width, model.norm_epsilon, weight_in_fp32=rmsnorm_weight_in_fp32(model))
    if model.layernorm_fp32:
        return LayerNormFp32(width, model.norm_epsilon)
    return nn.LayerNorm(width, eps=model.norm_epsilon, bias=model.norm_bias)


class LayerNormFp32(nn.Module):
    """LayerNorm without a bias as Hugging Face's CohereLayerNorm computes it (Command R): in fp32,
    the mean subtracted once for the variance and again to normalise, the weight applied in fp32,
    the result cast back; so it keeps what that keeps (``ModelSpec.layernorm_fp32``)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        upcast = x.float()
        mean = upcast.mean(-1, keepdim=True)
        variance = (upcast - mean).pow(2).mean(-1, keepdim=True)
        normed = (upcast - mean) * torch.rsqrt(variance + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm as Hugging Face's modeling code computes it, which is what DeepSpeed trains: in fp32,
    the result cast back to the input's dtype before the weight multiplies it (LlamaRMSNorm, and
    Mistral's, Qwen's, DeepSeek's alike) or after (``weight_in_fp32``: OLMo 2's, gpt-oss's; Gemma's, which
    scales by one plus the weight, keeps the same tensors). So it keeps what those keep for backward,
    on every device, where torch's own RMSNorm keeps other tensors on CPU (its fp32 decomposition)
    than on CUDA (a fused kernel). The cost model prices the same (``LayerGroup.
    unfused_extra_bytes_per_token``)."""

    def __init__(self, width: int, eps: float, weight_in_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps, self.weight_in_fp32 = eps, weight_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        upcast = x.float()
        normed = upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight.float() * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)


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


def _rope(x: torch.Tensor, base: float = 10000.0, percent: float = 1.0) -> torch.Tensor:
    """Rotary position embedding on the first ``percent`` of the head dimensions of ``x`` (b, heads,
    s, d), as GPT-NeoX rotates a quarter of them."""
    s, d = x.shape[-2], x.shape[-1]
    rotated = int(d * percent) // 2 * 2
    inv_freq = 1.0 / base ** (torch.arange(0, rotated, 2, device=x.device, dtype=torch.float32) / rotated)
    angles = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv_freq)
    out = _Rope.apply(x[..., :rotated], angles.cos().to(x.dtype), angles.sin().to(x.dtype))
    return out if rotated == d else torch.cat((out, x[..., rotated:]), dim=-1)


def _squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _activation(model: ModelSpec):
    if model.mlp == "swiglu":
        return F.silu
    if model.mlp == "relu":
        return F.relu
    if model.mlp == "relu2":
        return _squared_relu
    if model.gelu_formula == "gelu_new":
        return _gelu_new
    if model.gelu_formula == "gelu_fast":
        return _gelu_fast
    return functools.partial(F.gelu, approximate="tanh" if model.gelu_tanh else "none")


# The tanh GeLU as Hugging Face's NewGELUActivation and FastGELUActivation write it (GPT-2, Phi;
# GPT-NeoX-20B): Python operators, so autograd keeps what those keep (dsauto.spec.model.GELU_FORMULA_WIDTHS).
def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


class Embedding(nn.Module):
    """Token (and learned position, and for encoders token-type) embeddings."""

    def __init__(self, model: ModelSpec, vocab_size: int):
        super().__init__()
        h = model.hidden_size
        self.tokens = nn.Embedding(vocab_size, h)
        self.offset = model.position_offset
        self.positions = (nn.Embedding(model.max_position_embeddings + model.position_offset, h)
                          if model.position_embedding == "learned" else None)
        encoder = model.architecture == "encoder"
        self.token_types = nn.Embedding(model.type_vocab_size, h) if encoder and model.type_vocab_size else None
        self.norm = _norm(model) if encoder or model.embedding_norm else None
        self.scale = (math.sqrt(h) if model.embedding_scale else 1.0) * model.embedding_multiplier
        self.dropout = nn.Dropout(0.1 if model.dropout else 0.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens)
        if self.scale != 1.0:
            x = x * self.scale
        if self.positions is not None:
            x = x + self.positions(torch.arange(tokens.shape[1], device=tokens.device) + self.offset)
        if self.token_types is not None:
            x = x + self.token_types.weight[0]
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


class CoreAttention(nn.Module):
    """Rotary embedding and scaled dot-product attention of queries, keys and values laid out
    (batch, sequence, heads, head dim), returning the output in the same layout. A module of its
    own, with no parameters (but gpt-oss's sink per head), so that DeepSpeed-Ulysses can wrap it:
    its all-to-alls hand it the whole sequence for a share of the heads (``dsauto.runtime.deepspeed``),
    and the rotary positions are then those of the whole sequence."""

    def __init__(self, causal: bool, rope: bool, rotary_base: float, rotary_percent: float, dropout: float,
                 sinks: int = 0):
        super().__init__()
        self.causal, self.rope, self.dropout = causal, rope, dropout
        self.rotary_base, self.rotary_percent = rotary_base, rotary_percent
        # gpt-oss: a learned logit per head joins each query's softmax and attends to nothing (the
        # attention then runs with an explicit mask, not the fused causal kernel)
        self.sinks = nn.Parameter(torch.zeros(sinks)) if sinks else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.rope:
            q, k = _rope(q, self.rotary_base, self.rotary_percent), _rope(k, self.rotary_base, self.rotary_percent)
        gqa = {}
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each KV head serves a group of queries
            if _SDPA_GQA:  # the kernel broadcasts the KV heads, keeping no expanded copies
                gqa = {"enable_gqa": True}
            else:
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        dropout = self.dropout if self.training else 0.0
        if self.sinks is not None:
            return _sink_attention(q, k, v, self.sinks, self.causal, dropout, gqa).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=dropout, **gqa)
        return out.transpose(1, 2)


def _sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, causal: bool,
                    dropout: float, gqa: dict) -> torch.Tensor:
    """Attention whose softmax also holds one learned logit per head that attends to no value: a
    zero key and value are appended, and the mask adds the head's sink to that column's score."""
    b, heads, s, d = q.shape
    k = torch.cat((k, k.new_zeros(b, k.shape[1], 1, d)), dim=2)
    v = torch.cat((v, v.new_zeros(b, v.shape[1], 1, d)), dim=2)
    mask = q.new_zeros(heads, s, s + 1)
    if causal:
        mask[:, :, :s] = torch.full((s, s), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
    mask = mask + torch.cat((q.new_zeros(heads, 1, s), sinks.to(q.dtype).view(heads, 1, 1)), dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, **gqa)


class Block(nn.Module):
    """One transformer layer: attention and MLP with residual connections, normalised before each
    (pre-norm: GPT-2, LLaMA), after each residual add (post-norm: BERT), on each branch's output
    (OLMo 2), before and after each (4 norms: Gemma 2/3), or run side by side from one input
    (parallel attention: GPT-NeoX, Falcon).

    ``tp > 1`` builds the per-rank shard of a Megatron tensor-parallel layer (Shoeybi et al. 2019,
    Sec. 3): 1/tp of the heads and of the MLP width, full-width norms, without the all-reduces, so
    the profiler can time one rank's compute on one device.

    Not built, as they change neither the parameters nor (with fused attention) the measured cost
    much: ALiBi biases, sliding windows, attention soft-capping and score scaling, and layers
    without rotary positions (SmolLM3's NoPE layers rotate here too, and Llama 4's normalise their
    queries and keys), chunked attention and attention temperature tuning.

    ``moe=True`` builds an MoE layer of a mixture-of-experts model: its MLP is a
    :class:`dsauto.models.moe.MoeMlp` (router, routed experts, shared expert), DeepSpeed-MoE's with
    expert-parallel degree ``deepspeed_ep`` when that is given (see :mod:`dsauto.models.moe`).
    """

    def __init__(self, model: ModelSpec, tp: int = 1, moe: bool = False, deepspeed_ep: int | None = None):
        super().__init__()
        h = model.hidden_size
        qkv_bias, proj_bias, mlp_bias = model.biases
        self.heads, self.kv_heads = model.num_attention_heads // tp, model.kv_heads // tp
        self.head_dim = model.head_dim
        ffn = model.ffn_hidden_size // tp
        self.causal = model.architecture == "decoder"
        self.rope = model.position_embedding == "rope"
        self.rotary_base, self.rotary_percent = model.rotary_base, model.rotary_percent
        self.gated = model.gated_mlp
        self.act = _activation(model)
        self.glu_clamp = model.glu_clamp
        self.post_norm, self.output_norm = model.norm_position == "post", model.norm_position == "output"
        self.residual_scale = model.residual_multiplier
        self.parallel = model.parallel_attention
        p = 0.1 if model.dropout else 0.0
        self.attention_norm = _norm(model)
        self.qkv = nn.Linear(h, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=qkv_bias)
        # Per-head query/key norms (Qwen3), or over all of a rank's heads at once (OLMoE, OLMo 2)
        self.qk_full, self.qk_l2 = model.qk_norm_full_width, model.qk_l2_norm
        self.q_norm = _norm(model, self.head_dim * (self.heads if self.qk_full else 1)) if model.qk_norm else None
        self.k_norm = _norm(model, self.head_dim * (self.kv_heads if self.qk_full else 1)) if model.qk_norm else None
        self.proj = nn.Linear(self.heads * self.head_dim, h, bias=proj_bias)
        self.mlp_norm = _norm(model) if model.norms_per_layer > 1 else None  # one shared norm: Falcon-7B
        if moe:
            if tp > 1:
                raise ValueError("the reference MoE layer is built whole (tp=1); its experts are not split over TP")
            self.moe = MoeMlp(model, self.act, deepspeed_ep)
        else:
            self.moe = None
            self.mlp_in = nn.Linear(h, (2 if self.gated else 1) * ffn, bias=mlp_bias)
            self.mlp_out = nn.Linear(ffn, h, bias=mlp_bias)
        four = model.norms_per_layer == 4
        self.attention_out_norm = _norm(model) if four else None
        self.mlp_out_norm = _norm(model) if four else None
        self.attention_dropout, self.dropout = p, nn.Dropout(p)
        self.core_attention = CoreAttention(self.causal, self.rope, self.rotary_base, self.rotary_percent, p,
                                            sinks=self.heads if model.attention_sinks else 0)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        kv_width = self.kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, kv_width, kv_width], dim=-1)
        if self.q_norm is not None and self.qk_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.heads, self.head_dim)
        k = k.view(b, s, self.kv_heads, self.head_dim)
        v = v.view(b, s, self.kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_l2:  # Llama 4: parameter-free, per head
            q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        out = self.core_attention(q, k, v)
        out = self.proj(out.reshape(b, s, -1))
        return self.attention_out_norm(out) if self.attention_out_norm is not None else out

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            out = self.moe(x)
            return self.mlp_out_norm(out) if self.mlp_out_norm is not None else out
        out = feed_forward(x, self.mlp_in, self.mlp_out, self.act, self.gated, self.glu_clamp)
        return self.mlp_out_norm(out) if self.mlp_out_norm is not None else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.output_norm:  # OLMo 2: each branch's output normalised before its residual add
            x = x + self._branch(self.attention_norm(self.attention(x)))
            return x + self._branch(self.mlp_norm(self.mlp(x)))
        if self.post_norm:
            x = self.attention_norm(x + self._branch(self.attention(x)))
            return self.mlp_norm(x + self._branch(self.mlp(x)))
        if self.parallel:
            normed = self.attention_norm(x)
            mlp_input = self.mlp_norm(x) if self.mlp_norm is not None else normed
            return x + self._branch(self.attention(normed)) + self._branch(self.mlp(mlp_input))
        x = x + self._branch(self.attention(self.attention_norm(x)))
        return x + self._branch(self.mlp(self.mlp_norm(x)))

    def _branch(self, out: torch.Tensor) -> torch.Tensor:
        """A branch's output as its residual add takes it: dropped out, and scaled where the model
        scales it (Granite's residual_multiplier)."""
        out = self.dropout(out)
        return out if self.residual_scale == 1.0 else out * self.residual_scale


def _head_input_layers(model: ModelSpec) -> tuple[nn.Module | None, nn.Module | None]:
    """The head's layers before its LM-head matrix: the final norm (pre-norm models) and an
    encoder's dense + GeLU + norm transform."""
    h = model.hidden_size
    norm = _norm(model) if model.norm_position != "post" else None
    transform = nn.Sequential(nn.Linear(h, h), nn.GELU(), _norm(model)) if model.architecture == "encoder" else None
    return norm, transform


class Head(nn.Module):
    """Final norm (pre-norm models), (encoder: dense + GeLU + norm transform), LM head (with a bias
    over the vocabulary in encoders) and mean cross-entropy."""

    def __init__(self, model: ModelSpec, vocab_size: int, tied_weight: nn.Parameter | None):
        super().__init__()
        self.norm, self.transform = _head_input_layers(model)
        self.lm_head = nn.Linear(model.hidden_size, vocab_size, bias=model.architecture == "encoder" or model.head_bias)
        if tied_weight is not None:
            self.lm_head.weight = tied_weight
        self.softcap, self.scale = model.final_logit_softcap, model.logit_scale

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The input of the LM head matrix."""
        if self.norm is not None:
            x = self.norm(x)
        return self.transform(x) if self.transform is not None else x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits over the vocabulary (soft-capped where the model caps them)."""
        logits = self.lm_head(self.hidden(x))
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return logits_loss(self.logits(x), labels)


def logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the logits (in fp32) against the labels."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


class Logits(nn.Module):
    """The untied head without its loss: the last layer of a pipeline whose engine applies the loss
    (DeepSpeed's ``PipelineModule.loss_fn``, given :func:`logits_loss`)."""

    def __init__(self, model: ModelSpec, vocab_size: int):
        super().__init__()
        self.head = Head(model, vocab_size, tied_weight=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head.logits(x)


class HeadInput(nn.Module):
    """The head's layers before its LM-head matrix (the final norm; an encoder's transform): in a
    pipeline with tied embeddings, the layer before the tied output projection (:func:`tied_logits`)."""

    def __init__(self, model: ModelSpec):
        super().__init__()
        self.norm, self.transform = _head_input_layers(model)

    forward = Head.hidden


def tied_logits(softcap: float | None, scale: float = 1.0) -> Callable[[Embedding, torch.Tensor], torch.Tensor]:
    """The output projection through the token embedding's table, as DeepSpeed's ``TiedLayerSpec``
    calls it (``forward_fn(embedding, x)``), scaled and soft-capped where the model does so."""

    def project(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, embedding.tokens.weight)
        if scale != 1.0:
            logits = logits * scale
        return softcap * torch.tanh(logits / softcap) if softcap else logits

    return project


class ReferenceModel(nn.Module):
    """``embedding`` → ``layers`` → ``head``; ``forward(tokens, labels)`` returns the mean loss.

    The MoE layers of a mixture-of-experts model (``model.moe_layers()``) are MoE blocks, built with
    DeepSpeed-MoE of expert-parallel degree ``deepspeed_ep`` when that is given."""

    def __init__(self, model: ModelSpec, vocab_size: int | None = None, deepspeed_ep: int | None = None):
        super().__init__()
        self.spec = model
        vocab = vocab_size or model.padded_vocab_size(1)
        self.embedding = Embedding(model, vocab)
        moe_layers = set(model.moe_layers())
        self.layers = nn.ModuleList(Block(model, moe=i in moe_layers, deepspeed_ep=deepspeed_ep)
                                    for i in range(model.num_layers))
        self.head = Head(model, vocab, self.embedding.tokens.weight if model.tied_embeddings else None)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x, labels)


def init_weights(module: nn.Module, num_layers: int) -> None:
    """GPT-2 initialisation: N(0, 0.02), residual output projections scaled by 1/sqrt(2L)
    (Radford et al. 2019, Sec. 2.3)."""
    for name, param in module.named_parameters():
        if param.dim() >= 2:
            std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("proj.weight", "mlp_out.weight")) else 0.02
            nn.init.normal_(param, mean=0.0, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(param)


def build_model(model: ModelSpec, seed: int = 0, vocab_size: int | None = None,
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                deepspeed_ep: int | None = None) -> ReferenceModel:
    """The reference network for ``model`` with seeded random weights (same seed, same weights);
    ``deepspeed_ep``: build the MoE layers from DeepSpeed-MoE with that expert-parallel degree."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        net = ReferenceModel(model, vocab_size, deepspeed_ep)
        init_weights(net, model.num_layers)
    finally:
        torch.random.set_rng_state(generator_state)
    return net.to(device=device, dtype=dtype)
