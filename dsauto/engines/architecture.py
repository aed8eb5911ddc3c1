"""What Megatron-core cannot build of a model's architecture.

Megatron-core's GPT layers are pre-norm, sequential (attention, then MLP), with one norm before each
branch, a final norm, rotary or learned positions and biases on all linear layers or on the QKV
projection alone (megatron/core/transformer/transformer_layer.py, models/gpt/gpt_model.py). A
Hugging Face family that differs in any of these is built by Megatron in its nearest form (the same
parameter shapes and cost, other numerics). Both the Megatron-LM emitter (as ``# Not expressed``
comments) and the Megatron-core plugin (as warnings) name each such detail, from this one list;
what only the command line cannot say (a softmax scale, a GeLU-gated MLP) is the emitter's own.
"""

from __future__ import annotations

from dsauto.spec.model import ModelSpec


def megatron_gaps(model: ModelSpec) -> list[str]:
    """The architecture details of ``model`` Megatron-core does not build, one clause each."""
    gaps = list(model.unmodelled)
    if model.position_embedding == "learned" and model.position_offset:
        gaps.append(f"the position table's {model.position_offset} rows before the first position "
                    f"(Hugging Face's offset); Megatron's table has {model.max_position_embeddings} rows")
    if model.position_embedding == "alibi":
        gaps.append("ALiBi attention biases (Megatron has no ALiBi); the model is built without positions")
    if model.position_embedding == "rope" and model.rotary_base_local:
        gaps.append(f"sliding-window layers use the rotary base {model.rotary_base_local:g} (and no scaling); "
                    f"Megatron uses one base for all layers")
    if model.rope_scaling and not model.rope_scaling_local and model.sliding_window:
        gaps.append(f"{model.rope_scaling} rope scaling in the global layers only (the sliding-window layers' "
                    f"rotary positions are not scaled); Megatron scales every layer's")
    _, proj_bias, mlp_bias = model.biases
    all_biased = add_bias_linear(model)
    if not all_biased and (proj_bias or mlp_bias):
        which = " and ".join(name for name, on in (("the attention output projection", proj_bias),
                                                   ("the MLP", mlp_bias)) if on)
        gaps.append(f"biases on {which} only (Megatron's biases are all linear layers or the QKV "
                    f"projection alone)")
    if model.attention_softcap:
        gaps.append(f"attention scores soft-capped at {model.attention_softcap:g} (tanh)")
    if model.parallel_attention:
        norms = f"{model.norms_per_layer} norm{'s' if model.norms_per_layer > 1 else ''}"
        gaps.append(f"attention and MLP in parallel on the same input ({norms}); Megatron's layers run "
                    f"them one after the other")
    if model.norm_position == "post":
        gaps.append("norms after each residual add (post-norm) and no final norm; Megatron's layers "
                    "normalise before attention and MLP and end with a final norm (the same parameters, "
                    "in other places)")
    if model.norm_position == "output":
        gaps.append("each branch's output normalised before its residual add and no norm before the "
                    "branches (OLMo 2); Megatron's layers normalise before attention and MLP (the same "
                    "parameters, in other places)")
    if model.norms_per_layer == 4:
        gaps.append("norms after attention and after the MLP as well (4 per layer)")
    if model.embedding_norm or (model.architecture == "encoder" and model.norm_position == "pre"):
        gaps.append("a norm after the embedding (Megatron's GPT and BERT embeddings have none)")
    if model.norm == "layernorm" and not model.norm_bias:
        gaps.append("LayerNorms without biases (Cohere); Megatron's LayerNorm has one (the same cost, "
                    "one more vector per norm)")
    if model.head_bias and model.architecture == "decoder":
        gaps.append(f"a bias over the {model.vocab_size}-word vocabulary on the LM head (Megatron's GPT "
                    f"output layer has none)")
    if model.embedding_scale:
        gaps.append("embeddings scaled by sqrt(hidden size)")
    if model.embedding_multiplier != 1.0:
        gaps.append(f"embeddings multiplied by {model.embedding_multiplier:g}")
    if model.residual_multiplier != 1.0:
        gaps.append(f"attention and MLP outputs multiplied by {model.residual_multiplier:g} before their "
                    f"residual adds")
    if model.logit_scale != 1.0:
        gaps.append(f"logits multiplied by {model.logit_scale:g}")
    if model.qk_l2_norm:
        gaps.append("queries and keys L2-normalised in the layers with rotary positions (Llama 4); "
                    "Megatron-core's layer spec takes qk_l2_norm=True for every layer")
    if model.attention_chunk:
        gaps.append(f"chunked attention ({model.attention_chunk}-token chunks) in the layers with rotary "
                    f"positions (Llama 4: Megatron-Bridge's own attention module, not Megatron-core's); "
                    f"Megatron attends causally over the whole sequence")
    if model.attention_temperature_tuning:
        gaps.append("the layers without rotary positions scale their queries with the position (Llama 4's "
                    "attention temperature tuning)")
    if model.no_rope_every and not no_rope_freq(model):
        # Megatron-core's no_rope_freq (--no-rope-freq N) needs the layers to divide by N
        # (transformer_config.py, TransformerConfig.__post_init__)
        gaps.append(f"every {_ordinal(model.no_rope_every)} layer without rotary positions (NoPE), "
                    f"which Megatron's --no-rope-freq takes only when it divides the {model.num_layers} "
                    f"layers; Megatron rotates in every layer")
    if model.final_logit_softcap:
        gaps.append(f"logits soft-capped at {model.final_logit_softcap:g} (tanh)")
    if model.qk_norm and model.qk_norm_full_width:
        gaps.append("query and key norms over all heads at once (OLMoE, OLMo 2); Megatron's --qk-layernorm "
                    "normalises each head")
    if model.moe_router_bias and not all_biased:
        gaps.append("a bias on the router's linear layer")
    if model.moe_expert_bias and not all_biased:
        gaps.append("biases on the experts' matrices only (Megatron's biases are all linear layers)")
    if model.architecture == "encoder" and model.type_vocab_size:
        gaps.append(f"the token-type embedding ({model.type_vocab_size} rows); Megatron's BERT has one "
                    f"only with the binary head")
    return gaps


def add_bias_linear(model: ModelSpec) -> bool:
    """Megatron-core's ``add_bias_linear`` for ``model`` (Megatron-LM's default; off with
    ``--disable-bias-linear``): every linear layer Megatron builds carries a bias, the QKV and output
    projections, the MLPs' matrices (a dense layer's, each expert's, the shared expert's) and the
    router's (megatron/core/transformer/moe/router.py, ``TopKRouter``: a bias under
    ``add_bias_linear``). True where the model has a bias on each of these it has: besides the models
    whose every linear layer does (``linear_bias``; of the MoE families only gpt-oss has biases, and it
    has no dense MLP), gpt-oss, whose attention, experts and router carry biases. A shared expert's
    biases are the MLP's (``mlp_bias``)."""
    if model.linear_bias:
        return True
    qkv_bias, proj_bias, mlp_bias = model.biases
    dense = len(model.moe_layers()) < model.num_layers
    mlps = (mlp_bias or not dense) and (mlp_bias or not model.shared_expert_ffn_hidden_size)
    experts = not model.moe or (model.moe_expert_bias and model.moe_router_bias)
    return qkv_bias and proj_bias and mlps and experts


def no_rope_freq(model: ModelSpec) -> int:
    """Megatron-core's ``no_rope_freq`` (``--no-rope-freq N``: every N-th layer without rotary
    positions) for ``model``, or 0 when it has no such layers or Megatron cannot state them (N must
    divide the layers: transformer_config.py, TransformerConfig.__post_init__)."""
    every = model.no_rope_every
    return every if every and not model.num_layers % every else 0


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
