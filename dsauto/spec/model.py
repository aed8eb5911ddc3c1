"""Model descriptions: the architecture a user trains, and the per-layer cost descriptors derived from it.

A :class:`ModelSpec` holds the handful of numbers that fix a transformer's shape. The cost model never
looks at those numbers directly; it reads :class:`LayerGroup` descriptors (parameters, FLOPs and
activation bytes per token of one layer) that :func:`layer_groups` derives for a sequence length and a
training dtype. Adding a new architecture family means writing its descriptors, nothing else.

Activation bytes follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Section 4.1 (34·s·b·h + 5·a·s²·b bytes per GPT layer in 16-bit), generalised
here to grouped-query attention, SwiGLU MLPs, layers without dropout and any activation dtype.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from dsauto.spec.limits import MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH

Architecture = Literal["decoder", "encoder"]
Mlp = Literal["gelu", "relu", "relu2", "swiglu", "geglu"]
Norm = Literal["layernorm", "rmsnorm"]
NormPosition = Literal["pre", "post", "output"]
PositionEmbedding = Literal["learned", "rope", "alibi"]
RopeScaling = Literal["", "linear", "llama3", "yarn", "dynamic", "longrope"]
GeluFormula = Literal["", "gelu_new", "gelu_fast"]
LayerKind = Literal["embedding", "transformer", "head"]
MoeRouter = Literal["softmax", "sigmoid"]

# Megatron-LM pads the vocabulary to a multiple of this times the tensor-parallel degree
# (megatron/training/tokenizer: --make-vocab-size-divisible-by, default 128), so that the
# vocab-parallel embedding and LM head split evenly across TP ranks.
VOCAB_PAD_MULTIPLE = 128

MODEL_BOUNDS = {"num_layers": MAX_LAYERS, "hidden_size": MAX_WIDTH, "num_attention_heads": MAX_WIDTH,
                "ffn_hidden_size": MAX_WIDTH, "vocab_size": MAX_VOCAB, "max_position_embeddings": MAX_POSITIONS}
"""The largest value of each size field a model may have (see :mod:`dsauto.spec.limits`)."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a transformer, enough to count its parameters, FLOPs and activations."""

    name: str
    """Name printed in plans, e.g. ``llama2-7b``."""
    architecture: Architecture
    """``decoder`` (GPT / LLaMA, causal language model) or ``encoder`` (BERT, masked language model)."""
    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Query heads a."""
    ffn_hidden_size: int
    """Inner width of the MLP (per branch for SwiGLU)."""
    vocab_size: int
    """Tokenizer vocabulary size before any padding."""
    max_position_embeddings: int
    """Longest sequence the position embedding supports."""
    num_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means equal to ``num_attention_heads``."""
    mlp: Mlp = "gelu"
    """MLP type: ``gelu``, ``relu`` or ``relu2`` (squared ReLU: Nemotron, Megatron's ``--squared-relu``)
    (two matrices: up, activation, down), ``swiglu`` or ``geglu``
    (gated: gate and up matrices, SiLU or GeLU of the gate times up, down matrix)."""
    norm: Norm = "layernorm"
    """Normalisation: ``layernorm`` (weight, and a bias unless ``norm_bias`` is off) or ``rmsnorm``
    (weight only)."""
    position_embedding: PositionEmbedding = "learned"
    """``learned`` absolute positions (a parameter table), ``rope`` or ``alibi`` (no parameters)."""
    tied_embeddings: bool = True
    """Whether the LM head reuses the input embedding matrix."""
    linear_bias: bool = True
    """Whether every linear layer of a block carries a bias (GPT-2/3, BERT) or none but those
    switched on below (LLaMA)."""
    dropout: bool = True
    """Whether training applies dropout (its masks are kept for the backward pass)."""

    # Details of the families read from Hugging Face configs. The defaults are the GPT / LLaMA
    # shapes above, so a model that leaves them out is the model it always was.
    attention_head_dim: int = 0
    """Width of one attention head when it is not ``hidden_size / num_attention_heads`` (Gemma,
    Mistral-NeMo, Qwen3: Megatron's ``kv_channels``); 0 means that quotient."""
    qkv_bias: bool = False
    """The query/key/value projection carries biases even when ``linear_bias`` is off (Qwen2)."""
    proj_bias: bool = False
    """The attention output projection carries a bias even when ``linear_bias`` is off."""
    mlp_bias: bool = False
    """The MLP matrices carry biases even when ``linear_bias`` is off."""
    qk_norm: bool = False
    """Queries and keys are normalised per head before attention (Qwen3, Gemma 3): two norms of the
    head width per layer."""
    norms_per_layer: int = 2
    """Norms in one transformer layer: 2 (before attention and before the MLP, or after each in a
    post-norm layer), 1 (one norm shared by parallel attention and MLP, Falcon-7B) or 4 (before and
    after each, Gemma 2 and 3)."""
    norm_position: NormPosition = "pre"
    """``pre``: norms before attention and MLP and a final norm before the head (GPT-2, LLaMA);
    ``post``: norms after each residual add and no final norm (BERT, RoBERTa); ``output``: each
    branch's output normalised before its residual add, no norm before the branches, and a final
    norm (OLMo 2 and 3)."""
    norm_epsilon: float = 1e-5
    """Epsilon of every norm."""
    norm_weight_fp32: bool = False
    """The RMSNorm multiplies by its weight in fp32 before the cast back (OLMo 2's and 3's
    ``Olmo2RMSNorm``, gpt-oss's ``GptOssRMSNorm``; Gemma's, by one plus the weight, with
    ``norm_plus_one``) rather than after it (``LlamaRMSNorm``), which keeps the normalised value in
    fp32 (:func:`unfused_norm_bytes_per_element`)."""
    layernorm_fp32: bool = False
    """The LayerNorm is written out in Python operators in fp32 (Cohere's CohereLayerNorm: Command R,
    Command R7B), which keeps the centred input twice and the normalised value for backward, in
    fp32, where torch's kernel keeps the input (the model DeepSpeed trains;
    :func:`unfused_norm_bytes_per_element`)."""
    norm_plus_one: bool = False
    """Norms scale by (1 + weight), the weight starting at zero (Gemma; Megatron's
    ``--apply-layernorm-1p``)."""
    residual_post_norm: bool = False
    """The residual connection starts from the norm's output instead of its input (BLOOM's and
    Megatron's ``apply_residual_connection_post_layernorm``)."""
    parallel_attention: bool = False
    """Attention and MLP read the same input and their outputs are added to it together (GPT-NeoX's
    parallel residual, Falcon) instead of one after the other."""
    embedding_norm: bool = False
    """A norm right after the embedding in a decoder (BLOOM); encoders always have one."""
    embedding_scale: bool = False
    """Embeddings are multiplied by sqrt(hidden_size) (Gemma); costs nothing."""
    type_vocab_size: int = 2
    """Rows of an encoder's token-type embedding (BERT 2, RoBERTa 1); decoders have none."""
    position_offset: int = 0
    """Rows of the learned position table before the first position (OPT and RoBERTa: 2)."""
    gelu_tanh: bool = False
    """GeLU is computed with its tanh approximation (GPT-2's ``gelu_new``, Gemma's
    ``gelu_pytorch_tanh``) rather than exactly (BERT's ``gelu``)."""
    gelu_formula: GeluFormula = ""
    """The tanh GeLU written out in Python operators, as Hugging Face's ``gelu_new``
    (NewGELUActivation: GPT-2, Phi) and ``gelu_fast`` (FastGELUActivation: GPT-NeoX-20B) compute it, which
    keeps intermediate products for backward where torch's kernel keeps the input (the model
    DeepSpeed trains; :func:`unfused_extra_widths`); '' for torch's kernel (``gelu_pytorch_tanh``)."""
    rotary_base: float = 10000.0
    """Base (theta) of the rotary embedding's frequencies."""
    rotary_base_local: float = 0.0
    """Base of the rotary embedding of the sliding-window layers when it differs from
    ``rotary_base`` (Gemma 3); 0 means the same."""
    rotary_interleaved: bool = False
    """The rotary embedding rotates adjacent pairs of a head's dimensions (GPT-J's layout: GLM-4,
    Command R, ERNIE 4.5; Megatron's ``--rotary-interleaved``) instead of its two halves; the same cost."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that the rotary embedding rotates (GPT-NeoX: 0.25)."""
    rope_scaling: RopeScaling = ""
    """How rotary positions are scaled for long contexts (Hugging Face's ``rope_type``); empty for
    none."""
    rope_scaling_factor: float = 1.0
    """The scaling's ``factor``."""
    rope_scaling_params: tuple[tuple[str, float], ...] = ()
    """The scaling's other numeric parameters by name (``low_freq_factor``,
    ``original_max_position_embeddings``, ...), in the config's order."""
    rope_scaling_local: bool = True
    """The scaling applies to the sliding-window layers too; Gemma 3 and OLMo 3 scale only their
    global layers' rotary positions (transformers' per-layer-type ``rope_parameters``)."""
    sliding_window: int = 0
    """Tokens a sliding-window attention layer attends to (itself included); 0: no sliding window."""
    global_attention_every: int = 0
    """With a sliding window: every this-many-th layer (the 2nd, 4th, ... for 2) attends to the
    whole sequence and the others slide (Gemma 2: 2, Gemma 3: 6); 0: every layer slides."""
    attention_softcap: float = 0.0
    """Attention scores are soft-capped to ± this with tanh (Gemma 2); 0: not capped."""
    final_logit_softcap: float = 0.0
    """The LM head's logits are soft-capped to ± this with tanh (Gemma 2); 0: not capped."""
    attention_scale_dim: float = 0.0
    """Attention scores are scaled by 1 / sqrt(this) instead of 1 / sqrt(head width) (Gemma 2's
    ``query_pre_attn_scalar``); 0: the head width."""
    attention_sinks: bool = False
    """Each head has a learned sink logit added to its softmax (gpt-oss): one parameter per head."""
    glu_clamp: float = 0.0
    """gpt-oss's gated MLP: the gate's ``x sigmoid(1.702 x)`` times the linear half plus one, the gate
    clamped above and the linear half on both sides at this value (Megatron-LM's ``--quick-geglu
    --glu-linear-offset 1 --activation-func-clamp-value``); the shapes and cost of ``swiglu``. 0: a
    plain gated MLP."""
    qk_norm_full_width: bool = False
    """With ``qk_norm``: the query and key norms span all heads (OLMoE: widths a·d and kv·d)
    instead of one shared norm of the head width."""
    embedding_multiplier: float = 1.0
    """Token embeddings are multiplied by this (Granite's ``embedding_multiplier``); costs nothing."""
    residual_multiplier: float = 1.0
    """Each branch's output is multiplied by this before its residual add (Granite's
    ``residual_multiplier``); costs nothing."""
    logit_scale: float = 1.0
    """The LM head's logits are multiplied by this (Granite divides them by ``logits_scaling``);
    costs nothing."""
    norm_bias: bool = True
    """LayerNorms carry a bias (Cohere's have weights only); RMSNorm never does."""
    head_bias: bool = False
    """A decoder's LM head carries a bias over the vocabulary (Phi-2); an encoder's masked-LM head
    always does."""
    qk_l2_norm: bool = False
    """Queries and keys are L2-normalised (no parameters) in the layers with rotary positions (Llama 4)."""
    attention_chunk: int = 0
    """The layers with rotary positions attend within chunks of this many tokens, each query to the
    keys of its own chunk up to itself (Llama 4's chunked attention); 0: none."""
    attention_temperature_tuning: bool = False
    """The layers without rotary positions scale their queries by a factor growing with the position
    (Llama 4's ``attn_temperature_tuning``); costs nothing."""
    no_rope_every: int = 0
    """With rotary positions: every this-many-th layer (the 4th, 8th, ... for 4) attends without
    positions (SmolLM3's NoPE layers); 0: every layer rotates."""

    # Multi-head latent attention (DeepSeek-V2/V3, Megatron-core's ``--multi-latent-attention``):
    # queries and keys/values pass through low-rank latents. kv_lora_rank 0: ordinary attention.
    q_lora_rank: int = 0
    """Rank of the query latent (``q_a_proj`` then a norm then ``q_b_proj``); 0: one query projection."""
    kv_lora_rank: int = 0
    """Rank of the joint key/value latent; above 0 makes attention latent (MLA)."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key width with rotary embedding (the rotary key is shared by all heads)."""
    v_head_dim: int = 0
    """MLA: per-head value width."""

    # Mixture of experts (Mixtral, Qwen-MoE, DeepSeek, gpt-oss, OLMoE). num_experts 0: dense.
    num_experts: int = 0
    """Routed experts in each MoE layer; 0: a dense model (every MLP has ``ffn_hidden_size``)."""
    moe_top_k: int = 0
    """Routed experts each token passes through (top-k)."""
    moe_ffn_hidden_size: int = 0
    """Inner width of one routed expert (per branch when gated); 0: ``ffn_hidden_size``."""
    shared_expert_ffn_hidden_size: int = 0
    """Inner width of the shared expert(s) every token passes through, all together (DeepSeek:
    n_shared_experts x the expert width; Qwen2-MoE: its one shared expert; Megatron's
    ``--moe-shared-expert-intermediate-size``); 0: none."""
    shared_expert_gate: bool = False
    """A sigmoid gate (a linear layer of one output) scales the shared expert's output (Qwen2-MoE)."""
    moe_layer_freq: int = 1
    """Layer i (from 0) is an MoE layer when ``i % moe_layer_freq == moe_layer_phase`` and it is not
    one of the first ``moe_first_dense_layers`` (DeepSeek's and Megatron's convention)."""
    moe_layer_phase: int = 0
    """See ``moe_layer_freq``: Llama 4 Maverick's MoE layers are the odd ones (freq 2, phase 1)."""
    moe_first_dense_layers: int = 0
    """The first layers keep a dense MLP of ``ffn_hidden_size`` (DeepSeek's ``first_k_dense_replace``)."""
    moe_router: MoeRouter = "softmax"
    """Router scores: ``softmax`` over the experts then top-k (Mixtral, Qwen, OLMoE, gpt-oss), or
    ``sigmoid`` per expert (DeepSeek-V3, GLM-4.5, MiniMax-M2, Llama 4), with a load-balancing bias
    where ``moe_router_balancing_bias`` says so (a buffer, not a parameter)."""
    moe_router_balancing_bias: bool = True
    """With ``sigmoid`` routing: a per-expert bias added to the scores that choose the experts
    (DeepSeek-V3's aux-loss-free balancing, Megatron's ``--moe-router-enable-expert-bias``); Llama 4's
    router has none."""
    moe_router_pre_softmax: bool = False
    """With ``softmax`` routing: the chosen experts' weights are the softmax over all experts, not
    renormalised over the chosen (Hugging Face's ``norm_topk_prob`` false: Qwen2-MoE, DeepSeek-V2;
    Megatron's ``--moe-router-pre-softmax``); the same cost."""
    moe_router_topk_scaling: float = 0.0
    """The chosen experts' weights are scaled by this (DeepSeek's ``routed_scaling_factor``; Megatron's
    ``--moe-router-topk-scaling-factor``); 0: not scaled. The same cost."""
    moe_router_groups: int = 0
    """Group-limited routing: the experts form this many equal groups (DeepSeek-V3's ``n_group``;
    Megatron's ``--moe-router-num-groups``) and each token chooses its experts within the best
    ``moe_router_group_topk`` groups, ranked by the sum of their best experts' scores; 0: no groups."""
    moe_router_group_topk: int = 0
    """With ``moe_router_groups``: how many groups a token's experts come from (``topk_group``;
    Megatron's ``--moe-router-group-topk``)."""
    moe_probs_on_input: bool = False
    """The router's weight scales each expert's input instead of its output (Llama 4; Megatron's
    ``--moe-apply-probs-on-input``); the same cost."""
    moe_router_bias: bool = False
    """The router's linear layer has a bias (gpt-oss)."""
    moe_expert_bias: bool = False
    """The routed experts' matrices carry biases (gpt-oss)."""
    transformers_dense_experts: bool = False
    """transformers' module for the family runs every routed expert on every token, weighted by the
    router's scores (Llama 4's ``Llama4TextMoe``: the routed outputs of top-k routing, at num_experts /
    top-k times the expert work priced), which a plan for Hugging Face's Trainer cannot price."""
    mtp_layers: int = 0
    """Multi-token-prediction layers trained beside the model (DeepSeek-V3's and GLM-4.5's
    ``num_nextn_predict_layers``; Megatron-core's ``--mtp-num-layers``): each normalises the hidden
    state and the next token's embedding, projects the two (2h x h), runs one transformer layer of the
    stack's last layer's kind and a final norm, and adds a loss through the shared output layer, on the
    last pipeline stage (megatron/core/transformer/multi_token_prediction.py). Priced for Megatron-core
    plans only: transformers, which DeepSpeed plans train, does not build them. 0: none."""
    unmodelled: tuple[str, ...] = ()
    """Details of the model that change neither its parameters nor the work dsauto prices and that
    dsauto's Megatron-core flags and plugin do not build (a router's scaling and grouping, an
    activation's variant), one clause each, as read from its config: megatron_args.txt names each
    as not expressed (:func:`dsauto.engines.architecture.megatron_gaps`)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
            if getattr(self, name) > MODEL_BOUNDS[name]:  # beyond any real model (dsauto/spec/limits.py)
                raise ValueError(f"{name} must be at most {MODEL_BOUNDS[name]}, got {getattr(self, name)}")
        if self.num_kv_heads < 0:
            raise ValueError(f"num_kv_heads must be 0 (as many as attention heads) or positive, "
                             f"got {self.num_kv_heads}")
        if self.attention_head_dim < 0 or self.attention_head_dim > MAX_WIDTH:
            raise ValueError(f"attention_head_dim must be 0 (hidden_size / num_attention_heads) or "
                             f"positive and at most {MAX_WIDTH}, got {self.attention_head_dim}")
        # latent attention's heads take their widths from qk_nope/qk_rope/v_head_dim (GLM-4.7-Flash: 20 of 2048)
        if not self.attention_head_dim and not self.kv_lora_rank and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); give attention_head_dim"
            )
        if self.gelu_formula and not (self.gelu_tanh and self.mlp in ("gelu", "geglu")):
            raise ValueError(f"gelu_formula {self.gelu_formula} writes out the tanh GeLU; it needs mlp gelu or geglu "
                             f"and gelu_tanh, not mlp {self.mlp} with gelu_tanh {self.gelu_tanh}")
        if self.norm_weight_fp32 and self.norm != "rmsnorm":
            raise ValueError(f"norm_weight_fp32 describes an RMSNorm; it needs norm rmsnorm, not {self.norm}")
        if self.layernorm_fp32 and self.norm != "layernorm":
            raise ValueError(f"layernorm_fp32 computes a LayerNorm in fp32; it needs norm layernorm, not {self.norm}")
        if self.norms_per_layer not in (1, 2, 4):
            raise ValueError(f"norms_per_layer must be 1, 2 or 4, got {self.norms_per_layer}")
        if self.norms_per_layer == 1 and not self.parallel_attention:
            raise ValueError("norms_per_layer 1 needs parallel_attention (one norm feeds both branches)")
        for name in ("embedding_multiplier", "residual_multiplier", "logit_scale"):
            if not 0.0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number above 0, got {getattr(self, name)}")
        if self.no_rope_every and self.position_embedding != "rope":
            raise ValueError("no_rope_every needs rotary positions (position_embedding rope)")
        if self.norm_position == "output" and (self.norms_per_layer != 2 or self.parallel_attention):
            raise ValueError("norm_position output normalises each of the two branches' outputs: it needs "
                             "norms_per_layer 2 and no parallel_attention")
        if self.rotary_interleaved and (self.position_embedding != "rope" or self.latent_attention):
            raise ValueError("rotary_interleaved needs rotary positions and no latent attention (Megatron-core "
                             "refuses it with multi-latent attention)")
        if (self.qk_l2_norm or self.attention_chunk) and self.position_embedding != "rope":
            raise ValueError("qk_l2_norm and attention_chunk apply to the layers with rotary positions: they "
                             "need position_embedding rope")
        if self.attention_chunk and self.sliding_window:
            raise ValueError("attention_chunk and sliding_window are two kinds of local attention; give one")
        if not 0 <= self.mtp_layers <= MAX_LAYERS:
            raise ValueError(f"mtp_layers must be between 0 and {MAX_LAYERS}, got {self.mtp_layers}")
        if self.mtp_layers and self.architecture != "decoder":
            raise ValueError("mtp_layers predicts later tokens of a causal language model: it needs architecture "
                             "decoder")
        if self.mtp_layers and self.position_embedding != "rope":
            # megatron/training/arguments.py: MTP asserts position_embedding_type rope or none
            raise ValueError(f"mtp_layers needs rotary positions (position_embedding rope), as Megatron-LM runs "
                             f"multi-token prediction with no others, got {self.position_embedding}")
        if self.glu_clamp and (self.mlp != "swiglu" or not 0.0 < self.glu_clamp < float("inf")):
            raise ValueError(f"glu_clamp clamps a gated MLP's inputs (gpt-oss): it needs mlp swiglu and a finite "
                             f"value above 0, got mlp {self.mlp} and {self.glu_clamp}")
        for name in ("type_vocab_size", "position_offset", "sliding_window", "global_attention_every",
                     "no_rope_every", "attention_chunk"):
            if not 0 <= getattr(self, name) <= MAX_POSITIONS:
                raise ValueError(f"{name} must be between 0 and {MAX_POSITIONS}, got {getattr(self, name)}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be above 0 and at most 1, got {self.rotary_percent}")
        if not 0.0 < self.rope_scaling_factor < float("inf"):  # Megatron divides the positions by it
            raise ValueError(f"rope_scaling_factor must be a finite number above 0, got {self.rope_scaling_factor}")
        for name in ("norm_epsilon", "rotary_base", "rotary_base_local",
                     "attention_softcap", "final_logit_softcap", "attention_scale_dim"):
            if not 0.0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number of at least 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by num_kv_heads "
                f"({self.kv_heads})"
            )
        self._check_moe_and_latent_attention()

    def _check_moe_and_latent_attention(self) -> None:
        """The MoE and MLA fields: all zero (dense, ordinary attention) or a consistent set."""
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "moe_ffn_hidden_size", "shared_expert_ffn_hidden_size", "moe_first_dense_layers"):
            if not 0 <= getattr(self, name) <= MAX_WIDTH:
                raise ValueError(f"{name} must be between 0 and {MAX_WIDTH}, got {getattr(self, name)}")
        if self.kv_lora_rank and not (self.qk_nope_head_dim + self.qk_rope_head_dim and self.v_head_dim):
            raise ValueError("latent attention (kv_lora_rank > 0) needs qk_nope_head_dim + qk_rope_head_dim "
                             "and v_head_dim above 0")
        if self.q_lora_rank and not self.kv_lora_rank:
            raise ValueError("q_lora_rank needs latent attention: give kv_lora_rank too")
        if not 0 <= self.num_experts <= MAX_WIDTH:
            raise ValueError(f"num_experts must be between 0 (dense) and {MAX_WIDTH}, got {self.num_experts}")
        if self.num_experts and not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(f"moe_top_k must be between 1 and num_experts ({self.num_experts}), "
                             f"got {self.moe_top_k}")
        if self.moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq must be at least 1, got {self.moe_layer_freq}")
        if not 0 <= self.moe_layer_phase < self.moe_layer_freq:
            raise ValueError(f"moe_layer_phase must be between 0 and moe_layer_freq - 1 ({self.moe_layer_freq - 1}), "
                             f"got {self.moe_layer_phase}")
        if self.num_experts and not self.moe_layers():
            raise ValueError(f"no layer is an MoE layer: moe_first_dense_layers ({self.moe_first_dense_layers}) "
                             f"covers all {self.num_layers} layers")
        if self.moe_router_groups or self.moe_router_group_topk:
            if not (self.num_experts and self.moe_router_groups and self.num_experts % self.moe_router_groups == 0
                    and 1 <= self.moe_router_group_topk <= self.moe_router_groups
                    and self.moe_top_k % self.moe_router_group_topk == 0):
                raise ValueError(f"moe_router_groups ({self.moe_router_groups}) must divide the {self.num_experts} "
                                 f"experts and moe_router_group_topk ({self.moe_router_group_topk}) be between 1 and "
                                 f"it, dividing moe_top_k ({self.moe_top_k})")
        if self.moe_router_topk_scaling < 0:
            raise ValueError(f"moe_router_topk_scaling must be 0 (none) or positive, got {self.moe_router_topk_scaling}")
        moe_only = {"moe_top_k": self.moe_top_k, "moe_ffn_hidden_size": self.moe_ffn_hidden_size,
                    "shared_expert_ffn_hidden_size": self.shared_expert_ffn_hidden_size,
                    "moe_first_dense_layers": self.moe_first_dense_layers}
        stray = [f"{k}={v}" for k, v in moe_only.items() if v] + [
            k for k in ("shared_expert_gate", "moe_router_bias", "moe_expert_bias", "moe_probs_on_input",
                        "transformers_dense_experts",
                        "moe_router_pre_softmax", "moe_router_topk_scaling")
            if getattr(self, k)]
        if stray and not self.num_experts:
            raise ValueError(f"{', '.join(stray)} describe experts, but num_experts is 0 (a dense model)")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def norm_unit(self) -> int:
        """Parameters of a norm per element of its width: weight and bias, or the weight alone."""
        return 2 if self.norm == "layernorm" and self.norm_bias else 1

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP has gate and up matrices (SwiGLU, GeGLU)."""
        return self.mlp in ("swiglu", "geglu")

    @property
    def biases(self) -> tuple[bool, bool, bool]:
        """Whether the QKV projection, the attention output projection and the MLP matrices carry
        biases."""
        return (self.linear_bias or self.qkv_bias, self.linear_bias or self.proj_bias,
                self.linear_bias or self.mlp_bias)

    def window_slides(self, seq_len: int | None = None) -> bool:
        """Whether the sliding window leaves out keys of ``seq_len``-token sequences (any sequence when
        None): a window at least as long as the sequence attends to all of it, as full attention
        (Phi-3.5's 262,144-token window over 131,072 positions; Ministral's 32,768 at 32K)."""
        return bool(self.sliding_window) and (seq_len is None or self.sliding_window < seq_len)

    def sliding_layers(self) -> int:
        """How many transformer layers attend within the sliding window."""
        if not self.sliding_window:
            return 0
        if not self.global_attention_every:
            return self.num_layers
        return self.num_layers - self.num_layers // self.global_attention_every

    @property
    def learned_positions(self) -> bool:
        """Whether the model adds a learned position table, indexed by the position within its input."""
        return self.position_embedding == "learned"

    def rotary_layers(self) -> int:
        """How many transformer layers rotate their queries and keys (all but every ``no_rope_every``-th)."""
        return self.num_layers - (self.num_layers // self.no_rope_every if self.no_rope_every else 0)

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary padded as Megatron-LM pads it, so that it divides evenly across ``tp`` ranks."""
        multiple = VOCAB_PAD_MULTIPLE * tp
        return -(-self.vocab_size // multiple) * multiple

    @property
    def latent_attention(self) -> bool:
        """Whether attention is DeepSeek's multi-head latent attention."""
        return self.kv_lora_rank > 0

    @property
    def moe(self) -> bool:
        """Whether some layers are mixtures of experts."""
        return self.num_experts > 0

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Inner width of one routed expert."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def moe_layers(self) -> tuple[int, ...]:
        """Indices (from 0) of the MoE layers; none in a dense model."""
        if not self.moe:
            return ()
        return tuple(i for i in range(self.moe_first_dense_layers, self.num_layers)
                     if i % self.moe_layer_freq == self.moe_layer_phase)

    def num_parameters(self) -> int:
        """Total trainable parameters (unpadded vocabulary), every expert counted."""
        blocks = block_parameters(self)
        return self._edge_parameters() + blocks.total(len(self.moe_layers()), self.num_layers)

    def num_active_parameters(self, embedding: bool = True) -> int:
        """Parameters one token passes through: the top-k routed experts of each MoE layer instead of
        all of them. Publishers differ on the input embedding (one row of it is read per token):
        Mistral (12.9B of Mixtral-8x7B) and Qwen count it, OpenAI (3.6B of gpt-oss-20b) does not;
        ``embedding=False`` leaves it out. Equal to :meth:`num_parameters` for a dense model."""
        blocks = block_parameters(self)
        return (self._edge_parameters(embedding)
                + blocks.total(len(self.moe_layers()), self.num_layers, active=True))

    def _edge_parameters(self, embedding: bool = True) -> int:
        groups = layer_groups(self, seq_len=1, dtype_bytes=2, tp=1, pad_vocab=False)
        embedding = embedding or self.tied_embeddings  # a tied head reads the whole table
        return sum(g.params * g.count for g in groups if g.kind == "head" or (embedding and g.kind == "embedding"))

    def tp_problem(self, tp: int) -> str | None:
        """Why tensor parallelism of degree ``tp`` cannot split this model, or None if it can."""
        if self.num_attention_heads % tp:
            return f"{self.num_attention_heads} attention heads are not divisible by TP {tp}"
        if self.kv_heads % tp:
            return f"{self.kv_heads} key/value heads are not divisible by TP {tp}"
        if self.ffn_hidden_size % tp:
            return f"the MLP width {self.ffn_hidden_size} is not divisible by TP {tp}"
        return None


@dataclass(frozen=True)
class LayerGroup:
    """Cost descriptor of one layer of a run of identical layers, at a fixed sequence length and dtype.

    Byte counts are per token of a micro-batch and include the dtype; FLOPs are for the forward
    pass of the whole (unsplit) layer; the cost model divides by the tensor-parallel degree.
    """

    name: str
    """Name of the group: ``embedding``, ``decoder`` / ``encoder`` or ``head``."""
    kind: LayerKind
    """What the layer is: the ``embedding`` (first), a ``transformer`` layer or the ``head`` (last,
    with the loss). The cost model prices each kind's own terms: the head's split chunks its loss,
    ZeRO-3 gathers a transformer layer matrix by matrix, measured activations apply to transformer
    layers."""
    count: int
    """Number of identical consecutive layers in the group."""
    params: int
    """Trainable parameters of one layer (padded vocabulary for the embedding and head)."""
    tp_params: int
    """Of those, the parameters split across tensor-parallel ranks; the rest are replicated."""
    largest_op_params: int
    """Parameters of the largest single weight matrix (fused QKV, fused gate/up, LM head):
    the unit ZeRO-3 gathers at once and operator splitting divides."""
    matmul_flops_per_token: float
    """Forward FLOPs of the linear layers per token (2 per weight)."""
    attention_flops_per_token: float
    """Forward FLOPs of QK^T and attention-times-V per token (4·s·h; full square, as in
    Narayanan et al. 2021, Appendix)."""
    elementwise_bytes_per_token: float
    """Forward memory traffic per token of the bandwidth-bound operators on full-width tensors
    (norms, residual adds, dropout), which tensor parallelism replicates unless sequence
    parallelism splits them."""
    elementwise_tp_bytes_per_token: float
    """Forward memory traffic per token of the bandwidth-bound operators on tensor-parallel-split
    tensors (activation function, rotary embedding, loss softmax); the eager attention softmax
    is separate."""
    softmax_bytes_per_token: float
    """Forward memory traffic of an eager (non-fused) attention softmax per token; flash attention
    removes it."""
    act_tp_bytes_per_token: float
    """Activation bytes kept for backward that tensor parallelism splits (QKV, MLP inner)."""
    act_replicated_bytes_per_token: float
    """Activation bytes kept for backward that tensor parallelism replicates, unless sequence
    parallelism splits them too (norm inputs, dropout masks)."""
    attention_score_bytes_per_token: float
    """Bytes kept per token for the s×s attention scores of eager attention (softmax output, dropout
    mask and output); flash attention keeps none (Korthikanti et al. 2022, 5·a·s per token)."""
    checkpoint_bytes_per_token: float
    """Bytes kept per token when the layer is checkpointed: its input only."""
    tp_comm_bytes_per_token: float
    """Bytes per token all-reduced across the tensor-parallel group in the forward pass
    (the backward pass moves as much again)."""
    expert_block_params: float = 0.0
    """An MoE layer's routed experts, shared expert and router together: the unit ZeRO-3 gathers in a
    transformers model (Strategy.experts_gathered_whole); 0 without experts."""
    gemm_dim: int = 0
    """Smallest dimension of the layer's matrix multiplies before tensor-parallel splitting (the
    hidden size); sets how close to peak they run. 0 for layers without matrix multiplies."""
    head_dim: int = 0
    """Attention head dimension (the inner dimension of QK^T); 0 for layers without attention."""
    causal: bool = False
    """Causal attention: a fused kernel skips the masked half of the score matrix."""
    logits_bytes_per_token: float = 0.0
    """Head only: bytes per token of the logits and their fp32 softmax while the loss runs, split by
    TP; chunked (operator-split) loss divides it."""
    tp_collectives: float = 1.0
    """Collectives per pass that carry ``tp_comm_bytes_per_token`` between them, in equal shares: each
    pays the group's latency (a transformer layer's two, averaged over its layers when some are MoE
    layers; see :func:`dsauto.cost.terms.tp_comm_seconds`)."""
    tp_loss_collectives: int = 0
    """Head only: the all-reduces of one fp32 value per token that the vocabulary-parallel cross
    entropy runs in forward (:func:`dsauto.cost.terms.tp_loss_seconds`)."""
    attention_window_fraction: float = 1.0
    """Of the causal attention a fused kernel computes, the fraction sliding windows leave, averaged
    over the group's layers (1 without sliding windows). Eager attention computes the whole square
    whatever the window. The stack's block group averages its layers (the whole stack exact); a
    pipeline stage is priced with its own layers' (:func:`layer_group_per_layer`)."""
    kv_bytes_per_token: float = 0.0
    """Bytes per token of the layer's keys and values (before tensor parallelism splits the heads):
    what ring attention passes around the context-parallel group."""
    attention_io_bytes_per_token: float = 0.0
    """Bytes per token of the layer's queries, keys, values and attention output (before tensor
    parallelism splits the heads): what DeepSpeed-Ulysses' all-to-alls move."""
    query_bytes_per_token: float = 0.0
    """Bytes per token of the layer's queries (before tensor parallelism splits the heads); 0 for
    latent attention, whose queries and keys are shaped otherwise."""
    rotary: bool = False
    """Whether the layer rotates its queries and keys (rotary positions), which makes copies of them."""
    attention_dropout: bool = False
    """Whether dropout follows the attention softmax (eager attention keeps its mask and output)."""

    # Mixture of experts: zero for dense layers. The group's layers may mix dense and MoE layers
    # (DeepSeek's first dense layers); the per-token numbers then average over its layers.
    num_experts: int = 0
    """Routed experts of each MoE layer."""
    moe_top_k: int = 0
    """Routed experts each token passes through."""
    moe_layer_fraction: float = 0.0
    """Of the group's layers, the share that are MoE layers."""
    expert_params: float = 0.0
    """Of ``params``, the routed experts' (all of them, averaged over the group's layers): split over
    the expert-parallel and expert-tensor-parallel ranks, not over TP, and not in ``tp_params``."""
    expert_matmul_flops_per_token: float = 0.0
    """Of ``matmul_flops_per_token``, the top-k routed experts' (averaged over the layers)."""
    expert_gemm_dim: int = 0
    """Inner width of one routed expert: the small dimension of its grouped GEMM."""
    dispatch_bytes_per_token: float = 0.0
    """Bytes per token sent to its top-k experts (one direction; the combine sends as much back),
    averaged over the layers: what the expert-parallel all-to-all moves."""
    expert_act_bytes_per_token: float = 0.0
    """Of ``act_tp_bytes_per_token``, the routed experts' (the top-k copies of each token)."""

    # Selective recomputation (Megatron-core's ``recompute_modules``): the parts of the counts above
    # that recomputing one module frees, and what recomputing it costs (see cost.terms).
    norm_output_bytes_per_token: float = 0.0
    """Of ``act_replicated_bytes_per_token``, the pre-norms' outputs that the matrix multiplies after
    them keep (the QKV and MLP inputs): what recomputing the norms (``layernorm``) frees; 0 for
    post-norm layers, whose norms follow the branches."""
    mlp_act_bytes_per_token: float = 0.0
    """Of ``act_tp_bytes_per_token``, the dense MLP's inner activations (its first matrix's output,
    the activation function's output, the gate): what recomputing the MLP (``mlp``) frees."""
    mlp_matmul_flops_per_token: float = 0.0
    """Of ``matmul_flops_per_token``, the dense MLP's (averaged over the group's layers)."""
    mlp_out_matmul_flops_per_token: float = 0.0
    """Of ``mlp_matmul_flops_per_token``, the MLP output projection's: the layer's last matrix
    multiply."""
    mlp_elementwise_bytes_per_token: float = 0.0
    """Of ``elementwise_tp_bytes_per_token``, the dense MLP's activation function."""
    norm_elementwise_bytes_per_token: float = 0.0
    """Of ``elementwise_bytes_per_token``, the norms' reads and writes."""
    expert_act_output_bytes_per_token: float = 0.0
    """Of ``expert_act_bytes_per_token``, the routed experts' activation-function outputs (the
    second expert matrix's inputs), averaged over the layers: what recomputing ``moe_act`` frees."""
    expert_act_elementwise_bytes_per_token: float = 0.0
    """The routed experts' activation function's reads and writes (the first matrix's output in,
    the activation out), averaged over the layers: what recomputing ``moe_act`` re-runs."""
    mla_up_output_bytes_per_token: float = 0.0
    """Latent attention: the queries, keys and values its up projections make (all heads), what
    recomputing ``mla_up_proj`` frees; 0 for other attention."""
    mla_up_flops_per_token: float = 0.0
    """Latent attention: the forward FLOPs of its up projections (the query's from its latent, or its
    one projection from the hidden state, and the keys' and values' from theirs), what recomputing
    ``mla_up_proj`` re-runs; the rotary embedding's few bytes are not counted."""
    shared_expert_act_bytes_per_token: float = 0.0
    """Of ``act_tp_bytes_per_token``, the shared experts' inner activations, averaged over the layers:
    what recomputing ``shared_experts`` frees (``moe`` frees them with the routed experts' and the
    router's)."""
    router_act_bytes_per_token: float = 0.0
    """Of ``act_tp_bytes_per_token``, the router's fp32 logits and probabilities, averaged over the
    layers."""
    shared_expert_matmul_flops_per_token: float = 0.0
    """Of ``matmul_flops_per_token``, the shared experts' (averaged over the layers)."""
    router_matmul_flops_per_token: float = 0.0
    """Of ``matmul_flops_per_token``, the router's (and the shared experts' gate's)."""
    shared_expert_out_input_elements_per_token: float = 0.0
    """Of ``expert_out_input_elements_per_token``, the shared experts' output projection's inputs."""
    unfused_extra_bytes_per_token: float = 0.0
    """What the model DeepSpeed trains keeps beyond the fused-kernel count above that tensor
    parallelism would replicate, averaged over the layers: Hugging Face's modeling code, whose
    RMSNorms compute in fp32 (the hidden-width and latent norms here) and whose gated MLPs keep the
    activation function's output (:func:`unfused_extra_widths`); dsauto's reference layers compute
    the same. Megatron-core fuses them (its own terms below)."""
    unfused_extra_tp_bytes_per_token: float = 0.0
    """The same, of what tensor parallelism splits: the query and key norms and the MLP's."""
    unfused_mlp_extra_bytes_per_token: float = 0.0
    """Of ``unfused_extra_tp_bytes_per_token``, the dense MLP's: what recomputing ``mlp`` frees
    besides ``mlp_act_bytes_per_token`` under DeepSpeed."""
    unfused_expert_extra_bytes_per_token: float = 0.0
    """The same beyond ``expert_act_bytes_per_token``, of the routed experts' top-k copies at the
    mean load, averaged over the layers (the shared experts' is in ``unfused_extra_tp_bytes_per_token``)."""
    megatron_mlp_extra_bytes_per_token: float = 0.0
    """What Megatron-core's dense MLP keeps beyond ``mlp_act_bytes_per_token`` (negative: short of it),
    averaged over the layers, as its activation runs (:func:`megatron_activation_widths`). Measured on
    two CPU ranks (benchmarks/megatron_memory.py, dp2 geglu: a gated GeLU model): without it the peak
    came out 7.2% low."""
    megatron_shared_expert_extra_bytes_per_token: float = 0.0
    """The same for the shared experts (Megatron-core's SharedExpertMLP is an MLP), of
    ``shared_expert_act_bytes_per_token``'s width."""
    megatron_expert_extra_bytes_per_token: float = 0.0
    """What Megatron-core's routed experts keep beyond ``expert_act_bytes_per_token``'s inner
    activations, averaged over the layers, as their activation and its weighting by the router
    probability run (:func:`megatron_activation_widths`;
    :func:`dsauto.cost.terms.megatron_routed_copy_change_bytes_per_token`); with
    ``moe_probs_on_input``, also the unweighted input copy (h a copy)."""
    moe_probs_on_input: bool = False
    """The router probabilities weight a routed copy's input (Llama 4; ModelSpec.moe_probs_on_input),
    whose multiply keeps the unweighted copy, before the experts' activation."""
    activation_keeps_output: bool = False
    """The dense MLP's and shared experts' activation keeps its own output for backward (ReLU: torch's
    ``threshold_backward`` reads the result), so an FP8 copy of it kept by the output projection adds
    to it rather than replacing it. A routed copy's weighting makes a new tensor, which the FP8 copy
    does replace."""

    # Multi-token prediction (ModelSpec.mtp_layers): set on the head only.
    mtp_layers: int = 0
    """Head only: the multi-token-prediction layers that run beside it on the last pipeline stage of a
    Megatron-core plan, each :attr:`mtp_block` and then a loss through the head's own output weight."""
    mtp_block: LayerGroup | None = None
    """Head only, with ``mtp_layers``: one multi-token-prediction layer (its two input norms, the 2h x h
    projection, the transformer layer of the stack's last layer's kind and its final norm)."""
    mtp_embedding: LayerGroup | None = None
    """Head only, with ``mtp_layers``: the embedding lookup each prediction layer runs for the next
    tokens, and as its parameters the embedding a last pipeline stage allocates for it (GPTModel builds
    ``self.embedding`` where ``mtp_process``; megatron/core/models/gpt/gpt_model.py), kept equal to the
    first stage's like a tied output weight: the word table when it is not tied to the head (tied, the
    stage holds that copy already; the positions are rotary, ModelSpec.mtp_layers needs them)."""

    # FP8 training (Transformer Engine's linear layers; see cost.terms): elements per token, before
    # tensor parallelism, averaged over the group's layers.
    linear_input_elements_per_token: float = 0.0
    """The inputs of the layer's linear layers (each matrix's input width; a routed expert's once per
    top-k copy): what FP8 training quantizes."""
    attention_output_elements_per_token: float = 0.0
    """The attention output, the output projection's input."""
    expert_out_input_elements_per_token: float = 0.0
    """The routed (top-k copies) and shared experts' output projections' inputs."""

    @property
    def forward_flops_per_token(self) -> float:
        """Forward FLOPs per token of the whole layer: linear layers and attention."""
        return self.matmul_flops_per_token + self.attention_flops_per_token

    @property
    def unfused_bytes_per_token(self) -> float:
        """All that the model DeepSpeed trains keeps beyond the fused-kernel count, on one rank without
        tensor parallelism, the routed experts at their mean load (the ``unfused_*`` fields)."""
        return (self.unfused_extra_bytes_per_token + self.unfused_extra_tp_bytes_per_token
                + self.unfused_expert_extra_bytes_per_token)


def rmsnorm_weight_in_fp32(model: ModelSpec) -> bool:
    """Whether Hugging Face's RMSNorm of ``model`` multiplies by its weight in fp32 before the cast
    back (Gemma's ``GemmaRMSNorm``, by one plus the weight; :attr:`ModelSpec.norm_weight_fp32`: OLMo
    2's and 3's, gpt-oss's) rather than after it (``LlamaRMSNorm``: Llama, Mistral, Qwen, DeepSeek,
    EXAONE 4 and the rest)."""
    return model.norm_plus_one or model.norm_weight_fp32


def unfused_norm_bytes_per_element(model: ModelSpec, dtype_bytes: int) -> float:
    """What one of Hugging Face's norms keeps for backward beyond a fused norm (its input, and its
    output where a matrix multiply keeps it as its input), per element of its width; 0 for a
    LayerNorm that runs torch's kernel (its input and per-token statistics).

    Cohere's LayerNorm in fp32 (:attr:`ModelSpec.layernorm_fp32`) subtracts the mean twice, once for
    the variance and once to normalise, each difference kept by its square or its multiply, and
    multiplies by the weight in fp32, which keeps the normalised value: three fp32 copies where the
    count has the input, 12 bytes less the element's.

    ``LlamaRMSNorm`` casts the input to fp32 (``to(float32)``, which the square and the
    normalising multiply keep: the input itself in fp32), multiplies it by the reciprocal RMS and
    casts back, which the weight's multiply keeps: 4 bytes beyond the count in any dtype (16-bit:
    the fp32 copy and the normalised 16-bit value instead of the input; fp32: the normalised
    value). With the weight multiplied in fp32 (:func:`rmsnorm_weight_in_fp32`), the normalised
    value is kept in fp32: 8 bytes less the input's (16-bit), 4 (fp32). Measured against
    transformers' own layers (tests/spec/test_unfused_activations.py)."""
    if model.layernorm_fp32:
        return 12.0 - dtype_bytes
    if model.norm != "rmsnorm":
        return 0.0
    return 8.0 - dtype_bytes if rmsnorm_weight_in_fp32(model) else 4.0


def unfused_extra_widths(model: ModelSpec) -> tuple[float, float, float]:
    """(widths of norm that tensor parallelism replicates, widths of norm it splits, widths of an
    MLP's inner size) per token of one transformer layer whose activations Hugging Face's modeling
    code keeps beyond the fused-kernel count of :func:`layer_groups`: every norm of the layer (its
    pre- or post-norms of the hidden width and latent attention's latent norms; the query and key
    norms of their widths), each priced at :func:`unfused_norm_bytes_per_element`; and, of every MLP
    (the dense one, each routed copy's expert, the shared experts), in a gated one
    (``act_fn(gate_proj(x)) * up_proj(x)``: LlamaMLP, GemmaMLP, and transformers' grouped experts
    alike) the activation function's output, which the product keeps beside the gate's and the up
    projection's outputs, what a GeLU written out in Python keeps (:data:`GELU_FORMULA_WIDTHS`), and
    gpt-oss's clamped gate's three more (``glu_clamp``)."""
    replicated = model.norms_per_layer * model.hidden_size
    if model.latent_attention:
        replicated += model.q_lora_rank + model.kv_lora_rank
    split = (model.num_attention_heads + model.kv_heads) * model.head_dim if model.qk_norm else 0
    inner = (1 if model.gated_mlp else 0) + GELU_FORMULA_WIDTHS.get(model.gelu_formula, 0)
    if model.glu_clamp:
        # gpt-oss (GptOssExperts._apply_gate): the clamped gate, its sigmoid and the linear half plus
        # one are kept too, for the two products after them
        inner += 3
    return replicated, split, inner


GELU_FORMULA_WIDTHS = {"gelu_new": 3, "gelu_fast": 6}
"""Widths of the MLP's inner size that Hugging Face's Python tanh GeLU keeps beyond its input: of
``0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3)))`` (``gelu_new``) the tanh's output, which its
backward reads, and both factors of the last product; ``gelu_fast`` (``x * c * (1 + 0.044715 * x *
x)`` inside the tanh) also both factors of the product inside it and ``0.044715 * x``, a factor of
``x * x``'s product. Measured against transformers' activations
(tests/spec/test_unfused_activations.py)."""


def megatron_activation_widths(model: ModelSpec) -> tuple[int, int]:
    """How many widths of its inner size Megatron-core's (0.13 on) activation function keeps beyond
    the engine-neutral count (``inner`` in :func:`layer_groups`: 3 gated, 2 otherwise), in an MLP
    (dense or shared experts) and in a routed expert's copy, as transformer/mlp.py (MLP.forward) and
    transformer/moe/experts.py (``bias_act_func``) run it under the plugin's ``bias_activation_fusion``
    (on for SwiGLU alone; dsauto.runtime.megatron.transformer_config_kwargs). The routed copies are
    weighted by their router probability there, after the activation:

    - SwiGLU, fused (``bias_swiglu_impl``, ``weighted_bias_swiglu_impl``: the input kept, the output
      kept by the second matrix): none;
    - gpt-oss's clamped gate (``glu_clamp``), fused (``weighted_bias_quick_geglu_impl``) after a clamp
      of each half and their concatenation outside the fused function: the clamps keep the first
      matrix's output and the function the clamped copy, two more in a routed copy;
    - GeLU and squared ReLU, unfused: the activation keeps its input and the second matrix its
      output, as counted; a routed copy's weighting keeps the activation's output beside the weighted
      copy, one more;
    - ReLU keeps its output, not its input (the first matrix's output is freed): one fewer in an MLP,
      none more in a routed copy;
    - a gated GeLU (GeGLU), unfused (MLP.forward's ``glu``): the first matrix's output, the
      activation's, the linear half plus ``glu_linear_offset`` and the product, two more; a routed
      copy's weighting one more again.
    """
    if model.mlp == "swiglu":
        return 0, 2 if model.glu_clamp else 0
    if model.gated_mlp:
        return 2, 3
    if model.mlp == "relu":
        return -1, 0
    return 0, 1


def layer_groups(model: ModelSpec, seq_len: int, dtype_bytes: int, tp: int = 1,
                 pad_vocab: bool = True, moe_fraction: float | None = None,
                 local_attention: bool | None = None) -> tuple[LayerGroup, ...]:
    """The layer groups of ``model`` in execution order: embedding, the transformer stack, the head.
    ``moe_fraction`` prices the stack as if that share of its layers were MoE layers (0: its dense
    layers, 1: its MoE layers; :func:`layer_group_per_layer`); None: the model's own share.
    ``local_attention`` prices it as its sliding-window or chunked layers (True) or its layers that
    attend to the whole sequence (False); None: the average over its layers."""
    h, s, b = model.hidden_size, seq_len, dtype_bytes
    a, f = model.num_attention_heads, model.ffn_hidden_size
    qd, kvd = a * model.head_dim, model.kv_heads * model.head_dim  # query and key/value widths
    vocab = model.padded_vocab_size(tp) if pad_vocab else model.vocab_size
    norm_params = model.norm_unit * h
    mask = 1.0 if model.dropout else 0.0  # dropout masks are one byte per element
    gated = model.gated_mlp
    encoder, post_norm = model.architecture == "encoder", model.norm_position == "post"

    # Transformer layer: attention (fused QKV h·(q+2·kv) and the output projection, or latent
    # attention's down and up projections), then a dense MLP or a mixture of experts.
    parts = block_parameters(model)
    q_width, k_width, v_width, out_width = attention_widths(model)
    attention_matrices = attention_matrix_params(model)
    gm = 2 if gated else 1
    fe, fs, experts, top_k = model.expert_ffn_hidden_size, model.shared_expert_ffn_hidden_size, model.num_experts, model.moe_top_k
    if moe_fraction is None:
        moe_fraction = len(model.moe_layers()) / model.num_layers
    dense_fraction = 1.0 - moe_fraction
    mlp_in, mlp_out = gm * h * f, f * h
    expert_weights, shared_weights = gm * h * fe + fe * h, gm * h * fs + fs * h
    router_weights = experts * h + (h if model.shared_expert_gate else 0)
    ops = list(attention_matrices)
    if dense_fraction:
        ops += [mlp_in, mlp_out]
    if moe_fraction:
        ops += [gm * h * fe, fe * h, gm * h * fs, router_weights]
    # Per-layer numbers average the dense and the MoE layers of the stack (one block group; see
    # LayerGroup.moe_layer_fraction): the whole stack is exact; a pipeline stage's prediction takes
    # its own layers' kinds (layer_group_per_layer).
    mlp_weights = dense_fraction * (mlp_in + mlp_out) + moe_fraction * (top_k * expert_weights + shared_weights + router_weights)
    weights = sum(attention_matrices) + mlp_weights
    layer_params = parts.total(moe_fraction * model.num_layers, model.num_layers) / model.num_layers
    split_params = parts.attention_split + dense_fraction * parts.dense_mlp_split + moe_fraction * parts.shared_expert_split
    expert_params = moe_fraction * experts * parts.expert
    # Inputs the norms keep for backward: one per norm, except that parallel attention's two
    # pre-norms read the same tensor; the sandwich norms of 4-norm layers read the branch outputs.
    norm_inputs = model.norms_per_layer - (1 if model.parallel_attention and model.norms_per_layer == 2 else 0)
    branch_inputs = 1 if model.norms_per_layer == 1 else 2  # QKV and MLP inputs (one when shared)
    residual_adds = 1 if model.parallel_attention else 2
    # Kept for backward (Korthikanti et al. 2022, Sec. 4.1, generalised): Q and K for QK^T, V for
    # the attention-weighted sum, the attention output for the projection, and the MLP inner
    # activations (GeLU: its input and output; gated: gate, up and their product); normalised Q and
    # K keep their inputs too. A routed expert keeps the same for each of a token's top-k copies,
    # plus the dispatched copy of its input and its output before the weighted combine; the router
    # keeps its fp32 logits and probabilities (Megatron-core's MoELayer and TopKRouter).
    inner = 3 if gated else 2
    # Layers normalising queries and keys (each norm keeps its input): all with qk_norm, those with
    # rotary positions with Llama 4's parameter-free L2 norm
    qk_norm_share = 1.0 if model.qk_norm else (model.rotary_layers() / model.num_layers if model.qk_l2_norm else 0.0)
    shared_act, router_act = moe_fraction * inner * fs * b, moe_fraction * 2 * experts * 4
    megatron_mlp, megatron_routed = megatron_activation_widths(model)
    norm_widths, norm_tp_widths, mlp_widths = unfused_extra_widths(model)
    norm_extra = unfused_norm_bytes_per_element(model, b)
    expert_act = moe_fraction * top_k * (inner * fe * b + 2 * h * b) + shared_act + router_act
    act_tp = ((q_width + k_width + v_width + out_width) * b + dense_fraction * inner * f * b + expert_act + 4 * a
              + qk_norm_share * (qd + kvd) * b)
    latent = (2 * model.q_lora_rank + 2 * model.kv_lora_rank + model.qk_rope_head_dim) * b  # MLA latents and their norms
    act_repl = (norm_inputs + branch_inputs) * h * b + 2 * h * mask + latent  # norm and branch inputs, dropout masks
    scores = a * s * (b + mask * (1 + b))  # softmax output, dropout mask and dropout output
    elementwise = (
        model.norms_per_layer * 2 * h * b  # norms, read and write
        + residual_adds * 3 * h * b  # residual adds
        + mask * 2 * (2 * h * b + h)  # two dropouts
    )
    rope_width = (a + 1) * model.qk_rope_head_dim if model.latent_attention else qd + kvd
    elementwise_tp = (
        dense_fraction * inner * f * b  # activation function
        # the experts' activation functions and the permutation of the top-k copies to and from
        # expert order (read and write each way)
        + moe_fraction * (top_k * (inner * fe * b + 4 * h * b) + inner * fs * b)
        + (2 * rope_width * b * model.rotary_percent if model.position_embedding == "rope" else 0)
        + qk_norm_share * 2 * 2 * (qd + kvd) * b  # query/key norms, read and write
    )
    # Fused scale-mask-softmax reads and writes the scores once (Megatron's FusedScaleMaskSoftmax);
    # dropout reads them, writes its output and a one-byte mask; soft-capping (tanh) reads and
    # writes them once more.
    softmax = a * s * (2 * b + mask * (2 * b + 1) + (2 * b if model.attention_softcap else 0))
    # The linear layers' input widths: QKV (or latent attention's down projections and their up
    # projections' latents) and the output projection; the MLP's two matrices; each routed copy's
    # and the shared experts' two.
    if model.latent_attention:
        attention_inputs = 2 * h + model.q_lora_rank + model.kv_lora_rank + out_width
    else:
        attention_inputs = h + out_width
    expert_out_inputs = moe_fraction * (top_k * fe + fs)
    linear_inputs = (attention_inputs + dense_fraction * (h + f)
                     + moe_fraction * (top_k * h + (h if fs else 0)) + expert_out_inputs)
    tp_collectives = 2 - (0 if fs else moe_fraction)  # attention's and the (dense or shared experts') MLP's
    block = LayerGroup(
        name=model.architecture,
        kind="transformer",
        count=model.num_layers,
        params=round(layer_params),
        tp_params=round(split_params),
        largest_op_params=max(ops),
        expert_block_params=parts.moe_mlp() if moe_fraction else 0.0,
        matmul_flops_per_token=2.0 * weights,
        attention_flops_per_token=2.0 * s * (q_width + out_width),
        elementwise_bytes_per_token=elementwise,
        elementwise_tp_bytes_per_token=elementwise_tp,
        softmax_bytes_per_token=softmax,
        act_tp_bytes_per_token=act_tp,
        act_replicated_bytes_per_token=act_repl,
        attention_score_bytes_per_token=scores,
        checkpoint_bytes_per_token=h * b,
        # two all-reduces: after attention and after the MLP; an MoE layer's tokens go to their
        # experts from the sequence-parallel shard instead (the experts' own in cost.terms), but its
        # shared experts are a tensor-parallel MLP of their own (Megatron-core's SharedExpertMLP, whose
        # linear layers gather and reduce-scatter as a dense MLP's do without moe_shared_expert_overlap)
        tp_comm_bytes_per_token=tp_collectives * h * b,
        tp_collectives=tp_collectives,
        gemm_dim=h,
        head_dim=q_width // a,
        causal=model.architecture == "decoder",
        attention_window_fraction=attention_window_fraction(model, s, local_attention),
        kv_bytes_per_token=(k_width + v_width) * b,
        attention_io_bytes_per_token=(q_width + k_width + v_width + out_width) * b,
        query_bytes_per_token=0.0 if model.latent_attention else q_width * b,
        rotary=model.position_embedding == "rope" and model.rotary_layers() > 0,
        attention_dropout=model.dropout,
        num_experts=experts,
        moe_top_k=top_k,
        moe_layer_fraction=moe_fraction,
        expert_params=expert_params,
        expert_matmul_flops_per_token=2.0 * moe_fraction * top_k * expert_weights,
        expert_gemm_dim=fe if experts else 0,
        dispatch_bytes_per_token=moe_fraction * top_k * h * b,
        expert_act_bytes_per_token=moe_fraction * top_k * (inner * fe * b + 2 * h * b),
        norm_output_bytes_per_token=branch_inputs * h * b if model.norm_position == "pre" else 0.0,  # pre-norms' outputs
        mlp_act_bytes_per_token=dense_fraction * inner * f * b,
        mlp_matmul_flops_per_token=2.0 * dense_fraction * (mlp_in + mlp_out),
        mlp_out_matmul_flops_per_token=2.0 * dense_fraction * mlp_out,
        mlp_elementwise_bytes_per_token=dense_fraction * inner * f * b,
        norm_elementwise_bytes_per_token=model.norms_per_layer * 2 * h * b,
        expert_act_output_bytes_per_token=moe_fraction * top_k * fe * b,
        mla_up_output_bytes_per_token=(q_width + k_width + v_width) * b if model.latent_attention else 0.0,
        # the query's up (or one) projection and the keys' and values' up projection: the fourth and second
        # matrices from the end of attention_matrix_params, with or without a query latent
        mla_up_flops_per_token=2.0 * (attention_matrices[-4] + attention_matrices[-2]) if model.latent_attention else 0.0,
        expert_act_elementwise_bytes_per_token=moe_fraction * top_k * inner * fe * b,
        shared_expert_act_bytes_per_token=shared_act,
        router_act_bytes_per_token=router_act,
        shared_expert_matmul_flops_per_token=2.0 * moe_fraction * shared_weights,
        router_matmul_flops_per_token=2.0 * moe_fraction * router_weights,
        shared_expert_out_input_elements_per_token=moe_fraction * fs,
        linear_input_elements_per_token=linear_inputs,
        attention_output_elements_per_token=out_width,
        expert_out_input_elements_per_token=expert_out_inputs,
        # where the probabilities weight the input (Llama 4: moe_apply_probs_on_input), the multiply
        # keeps the unweighted copy beside the weighted one (transformer/moe/experts.py)
        megatron_expert_extra_bytes_per_token=moe_fraction * top_k * (
            megatron_routed * fe + (h if model.moe_probs_on_input else 0)) * b,
        moe_probs_on_input=model.moe_probs_on_input and moe_fraction > 0,
        # and the shared experts' output, which their sigmoid gate's product keeps (Qwen2-MoE's
        # shared_expert_gate, in transformers' Qwen2MoeSparseMoeBlock and the reference layer alike)
        unfused_extra_bytes_per_token=norm_widths * norm_extra + (
            moe_fraction * h * b if model.shared_expert_gate and fs else 0.0),
        unfused_extra_tp_bytes_per_token=(norm_tp_widths * norm_extra
                                          + mlp_widths * (dense_fraction * f + moe_fraction * fs) * b),
        unfused_mlp_extra_bytes_per_token=mlp_widths * dense_fraction * f * b,
        unfused_expert_extra_bytes_per_token=mlp_widths * moe_fraction * top_k * fe * b,
        megatron_mlp_extra_bytes_per_token=dense_fraction * megatron_mlp * f * b,
        megatron_shared_expert_extra_bytes_per_token=moe_fraction * megatron_mlp * fs * b,
        activation_keeps_output=model.mlp == "relu",
    )

    positions = (model.max_position_embeddings + model.position_offset) * h if model.position_embedding == "learned" else 0
    token_types = model.type_vocab_size * h if encoder else 0
    embedding_norm = encoder or model.embedding_norm
    embedding = LayerGroup(
        name="embedding",
        kind="embedding",
        count=1,
        params=vocab * h + positions + token_types + (norm_params if embedding_norm else 0),
        tp_params=vocab * h,
        largest_op_params=vocab * h,
        matmul_flops_per_token=0.0,
        attention_flops_per_token=0.0,
        elementwise_bytes_per_token=3 * h * b + mask * (2 * h * b + h),
        elementwise_tp_bytes_per_token=0.0,
        softmax_bytes_per_token=0.0,
        act_tp_bytes_per_token=0.0,
        act_replicated_bytes_per_token=mask * h,
        attention_score_bytes_per_token=0.0,
        checkpoint_bytes_per_token=0.0,
        tp_comm_bytes_per_token=h * b,  # vocab-parallel lookup ends in one all-reduce
        unfused_extra_bytes_per_token=h * norm_extra if embedding_norm else 0.0,
    )

    # Head: final norm (pre-norm models), (encoder: dense + norm transform), LM head (with a bias
    # over the vocabulary in encoders: BERT's and Megatron's masked-LM heads), cross-entropy.
    final_norm = 0 if post_norm else norm_params
    transform = (h * h + h + norm_params) if encoder else 0
    head_weights = (0 if model.tied_embeddings else vocab * h) + (vocab if encoder or model.head_bias else 0)
    head = LayerGroup(
        name="head",
        kind="head",
        count=1,
        params=final_norm + transform + head_weights,
        tp_params=head_weights,
        largest_op_params=vocab * h,
        matmul_flops_per_token=2.0 * vocab * h + 2.0 * (h * h if transform else 0),
        attention_flops_per_token=0.0,
        elementwise_bytes_per_token=2 * h * b,
        # fp32 softmax and loss over the logits; soft-capping reads and writes them once more
        elementwise_tp_bytes_per_token=(3 + (2 if model.final_logit_softcap else 0)) * vocab * 4,
        softmax_bytes_per_token=0.0,
        act_tp_bytes_per_token=0.0,
        act_replicated_bytes_per_token=2 * h * b + (2 * h * b if transform else 0),
        # the final norm and the transform's (dsauto.profile.layers.head_hidden_bytes measures them)
        unfused_extra_bytes_per_token=((0 if post_norm else h) + (h if transform else 0)) * norm_extra,
        attention_score_bytes_per_token=0.0,
        checkpoint_bytes_per_token=h * b,
        tp_comm_bytes_per_token=h * b,  # gradient of the column-parallel head's input (backward)
        tp_loss_collectives=3,  # the maximum logit, the target's logit and the sum of exponentials
        gemm_dim=h,
        # Backward of the loss holds the saved fp32 log-softmax, its gradient and the logits' gradient
        # (measured: 1.5x two fp32 logits tensors, benchmarks/results/hook_memory.md), the last in
        # fp32 too: the loss runs on an fp32 copy of the logits (dsauto.models.gpt.Head:
        # ``logits.float()``), whose gradient log_softmax's backward makes before the cast back
        # (measured in bf16 on two CPU ranks: three 8 MiB fp32 tensors at 512 tokens x 4096,
        # benchmarks/accuracy.py --plans variants). Soft-capped logits (Gemma 2 and 3) keep the
        # tanh's output in the training dtype besides, which its backward reads (transformers'
        # Gemma2ForCausalLM and the reference head alike; measured: tests/spec/test_unfused_activations.py).
        logits_bytes_per_token=vocab * 3 * 4 + (vocab * b if model.final_logit_softcap else 0),
    )
    if model.mtp_layers:
        head = dataclasses.replace(head, mtp_layers=model.mtp_layers,
                                   mtp_block=_mtp_block(model, block, seq_len, dtype_bytes, tp, pad_vocab),
                                   mtp_embedding=dataclasses.replace(  # rotary positions: no table
                                       embedding, params=0 if model.tied_embeddings else vocab * h,
                                       tp_params=0 if model.tied_embeddings else vocab * h))
    return embedding, block, head


def _mtp_block(model: ModelSpec, block: LayerGroup, seq_len: int, dtype_bytes: int, tp: int,
               pad_vocab: bool) -> LayerGroup:
    """One multi-token-prediction layer as Megatron-core's MultiTokenPredictionLayer runs it
    (megatron/core/transformer/multi_token_prediction.py): ``enorm`` and ``hnorm`` normalise the next
    tokens' embedding and the hidden state, ``eh_proj`` (a column-parallel 2h x h linear layer without
    bias) projects their concatenation, then one transformer layer of the stack's last layer's kind
    (``get_gpt_mtp_block_spec`` takes the decoder's last layer spec: an MoE layer in DeepSeek-V3)
    and ``final_layernorm``. Its tensor-parallel traffic adds the projection's input gradient (2h) and
    the lookup's result (h), as two more collectives."""
    h, b = model.hidden_size, dtype_bytes
    last = layer_kinds(model, seq_len)[-1]
    if last != (None, None):  # the stack mixes kinds: the MTP layer is of the last layer's
        block = layer_groups(dataclasses.replace(model, mtp_layers=0), seq_len, dtype_bytes, tp, pad_vocab,
                             moe_fraction=last[0], local_attention=last[1])[1]
    projection = 2 * h * h
    return dataclasses.replace(
        block, name="mtp", count=1,
        params=block.params + projection + 3 * model.norm_unit * h,
        tp_params=block.tp_params + projection,
        largest_op_params=max(block.largest_op_params, projection),
        matmul_flops_per_token=block.matmul_flops_per_token + 2.0 * projection,
        elementwise_bytes_per_token=block.elementwise_bytes_per_token + 3 * 2 * h * b + 2 * 2 * h * b,
        act_replicated_bytes_per_token=block.act_replicated_bytes_per_token + 5 * h * b,
        tp_comm_bytes_per_token=block.tp_comm_bytes_per_token + 3 * h * b,
        tp_collectives=block.tp_collectives + 2,
        linear_input_elements_per_token=block.linear_input_elements_per_token + 2 * h,
    )


def in_own_words(message: str, names: Mapping[str, str]) -> str:
    """``message`` (a ModelSpec validation error) with each field name in ``names`` replaced by what
    the user wrote for it: a config key, a launch flag."""
    return re.sub(r"\b[a-z_]+\b", lambda m: names.get(m.group(0), m.group(0)), message)


def layer_group_per_layer(model: ModelSpec, groups: Sequence[LayerGroup], seq_len: int, dtype_bytes: int,
                          tp: int = 1) -> list[LayerGroup]:
    """The group of each layer in flat numbering (0 the embedding, 1..L the transformer layers, L + 1
    the head) for pricing a pipeline stage: ``groups`` (:func:`layer_groups`), except that in a model
    whose layers are of several kinds each transformer layer takes its own kind's group, where the
    stack's block group averages them: dense and MoE layers (DeepSeek's first dense layers, Llama 4's
    alternate ones), and layers attending within a window or chunk and to the whole sequence (Gemma
    3's five local layers to one global, Llama 4's chunked layers). A stage holding more or fewer of
    one kind than the average then holds and computes what its own layers do."""
    embedding, block, head = groups
    kinds = layer_kinds(model, seq_len)
    if len(set(kinds)) == 1:
        return [embedding, *[block] * model.num_layers, head]
    blocks = {key: layer_groups(model, seq_len, dtype_bytes, tp, moe_fraction=key[0], local_attention=key[1])[1]
              for key in set(kinds)}
    return [embedding, *[blocks[key] for key in kinds], head]


def layer_kinds(model: ModelSpec, seq_len: int) -> list[tuple[float | None, bool | None]]:
    """Each transformer layer's kind over ``seq_len``-token sequences, as :func:`layer_groups`
    prices it (``moe_fraction``, ``local_attention``): None where the model's layers are all alike
    in that respect, so a model of one kind has one key."""
    moe, local = set(model.moe_layers()), set(local_attention_layers(model, seq_len))
    mixed_moe, mixed_local = (0 < len(kind) < model.num_layers for kind in (moe, local))
    return [(float(i in moe) if mixed_moe else None, i in local if mixed_local else None)
            for i in range(model.num_layers)]


def mixed_layer_kinds(model: ModelSpec, seq_len: int) -> bool:
    """Whether :func:`layer_group_per_layer` prices the transformer layers of ``model`` in more than one
    kind (dense and MoE, or local and global attention) over ``seq_len``-token sequences."""
    return len(set(layer_kinds(model, seq_len))) > 1


def local_attention_layers(model: ModelSpec, seq_len: int) -> list[int]:
    """The transformer layers (numbered from 0) whose attention leaves out keys of ``seq_len``-token
    sequences: the sliding-window layers (all but every ``global_attention_every``-th) when the window
    is shorter than the sequence, and the chunked layers (those with rotary positions) when the chunk
    is."""
    layers = range(model.num_layers)
    if model.attention_chunk:
        if model.attention_chunk >= seq_len:
            return []
        every = model.no_rope_every
        return [i for i in layers if not every or (i + 1) % every]
    if not model.window_slides(seq_len):
        return []
    every = model.global_attention_every
    return [i for i in layers if not every or (i + 1) % every]


@dataclass(frozen=True)
class BlockParameters:
    """Parameters of one transformer layer by part (exact integers)."""

    attention: int
    """Attention with its biases and latent norms, and the layer's norms: in every layer."""
    attention_split: int
    """Of ``attention``, what tensor parallelism splits."""
    dense_mlp: int
    """The dense MLP with its biases (the layers that are not MoE)."""
    dense_mlp_split: int
    """Of ``dense_mlp``, what tensor parallelism splits."""
    expert: int
    """One routed expert with its biases."""
    shared_expert: int
    """The shared experts together, with their gate."""
    shared_expert_split: int
    """Of ``shared_expert``, what tensor parallelism splits."""
    router: int
    """The router's linear layer."""
    num_experts: int
    top_k: int

    def moe_mlp(self, active: bool = False) -> int:
        """An MoE layer's MLP part: every routed expert, or (``active``) the top-k a token passes through."""
        return (self.top_k if active else self.num_experts) * self.expert + self.shared_expert + self.router

    def total(self, moe_layers: int, layers: int, active: bool = False) -> int:
        """Parameters of ``layers`` layers of which ``moe_layers`` are MoE layers."""
        return layers * self.attention + (layers - moe_layers) * self.dense_mlp + moe_layers * self.moe_mlp(active)


def attention_widths(model: ModelSpec) -> tuple[int, int, int, int]:
    """Widths (all heads) of the queries, keys, values and attention output of one layer."""
    a = model.num_attention_heads
    if model.latent_attention:
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        return a * qk, a * qk, a * model.v_head_dim, a * model.v_head_dim
    qd, kvd = a * model.head_dim, model.kv_heads * model.head_dim
    return qd, kvd, kvd, qd


def attention_matrix_params(model: ModelSpec) -> tuple[int, ...]:
    """The attention's weight matrices: fused QKV and the output projection; with latent attention
    (DeepSeek-V2 Sec. 2.1, transformers' DeepseekV3Attention) the query down and up projections (or
    one query projection), the joint key/value down projection with the shared rotary key, the
    key/value up projection, and the output projection."""
    h = model.hidden_size
    q, k, v, out = attention_widths(model)
    if not model.latent_attention:
        return h * (q + k + v), out * h
    ql, kvl, a = model.q_lora_rank, model.kv_lora_rank, model.num_attention_heads
    query = (h * ql, ql * q) if ql else (h * q,)
    return (*query, h * (kvl + model.qk_rope_head_dim), kvl * a * (model.qk_nope_head_dim + model.v_head_dim), out * h)


def block_parameters(model: ModelSpec) -> BlockParameters:
    """The parameters of one transformer layer of ``model``, by part."""
    h, f = model.hidden_size, model.ffn_hidden_size
    norm_unit = model.norm_unit
    qkv_bias, proj_bias, mlp_bias = model.biases
    q, k, v, _ = attention_widths(model)
    matrices = attention_matrix_params(model)
    if model.latent_attention:  # the down projections are replicated over TP (Megatron's MLA)
        ql = model.q_lora_rank
        replicated_matrices = (h * ql if ql else 0) + h * (model.kv_lora_rank + model.qk_rope_head_dim)
        latent_norms = norm_unit * (ql + model.kv_lora_rank)
    else:
        replicated_matrices, latent_norms = 0, 0
    # Per-head query/key norms share one weight (and bias) of the head width (Qwen3's q_norm,
    # k_norm); OLMoE's span every head.
    if model.qk_norm:
        qk_norm = norm_unit * ((q + k) if model.qk_norm_full_width else 2 * model.head_dim)
    else:
        qk_norm = 0
    attention_split = sum(matrices) - replicated_matrices + (q + k + v if qkv_bias else 0)
    attention = (attention_split + replicated_matrices + (h if proj_bias else 0) + latent_norms + qk_norm
                 + model.norms_per_layer * norm_unit * h + (model.num_attention_heads if model.attention_sinks else 0))
    gm = 2 if model.gated_mlp else 1
    dense_split = gm * h * f + f * h + (gm * f if mlp_bias else 0)
    fe, fs = model.expert_ffn_hidden_size, model.shared_expert_ffn_hidden_size
    shared_split = gm * h * fs + fs * h
    return BlockParameters(
        attention=attention, attention_split=attention_split,
        dense_mlp=dense_split + (h if mlp_bias else 0), dense_mlp_split=dense_split,
        expert=gm * h * fe + fe * h + (gm * fe + h if model.moe_expert_bias else 0),
        shared_expert=shared_split + (h if model.shared_expert_gate else 0), shared_expert_split=shared_split,
        router=model.num_experts * h + (model.num_experts if model.moe_router_bias else 0),
        num_experts=model.num_experts, top_k=model.moe_top_k,
    )


def attention_window_fraction(model: ModelSpec, seq_len: int, local: bool | None = None) -> float:
    """Of the causal attention over ``seq_len`` tokens, the fraction a fused sliding-window kernel
    computes: query i attends to min(i, window) keys instead of i. Chunked attention (Llama 4)
    computes one causal triangle per chunk in its layers with rotary positions. ``local``: the
    fraction of a layer that slides or chunks (True), of one that attends to the whole sequence
    (False, 1), or (None) the average over the layers (:func:`local_attention_layers`)."""
    if local is False:
        return 1.0
    full = seq_len * (seq_len + 1) / 2
    if model.attention_chunk:
        whole, rest = divmod(seq_len, model.attention_chunk)
        part = (whole * model.attention_chunk * (model.attention_chunk + 1) / 2 + rest * (rest + 1) / 2) / full
    else:
        window = model.sliding_window
        part = (window * (window + 1) / 2 + (seq_len - window) * window) / full
    if local:
        return part if model.attention_chunk or model.window_slides(seq_len) else 1.0
    count = len(local_attention_layers(model, seq_len))
    return (count * part + (model.num_layers - count)) / model.num_layers
