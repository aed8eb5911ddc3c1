"""The Megatron-LM arguments of a plan (``megatron_args.txt``).

Engine spellings live here. Flag names are Megatron-LM's (megatron/training/arguments.py and the
dataclass fields it turns into flags); emitted arguments were checked with Megatron-LM's own
``parse_args`` and ``validate_args`` at commit d98e8a6 (August 2026). What the flags cannot say
exactly (checkpointing that is not a per-stage prefix, checkpointing or splitting of the embedding
and head, operator splitting, per-group ZeRO-3 residency) is listed in ``# `` comment lines; the
dsauto hook applies it from the plan.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from dsauto.describe import layer_span, layers_text, runs_text
from dsauto.emit.ds_config import dtype_bytes
from dsauto.engines.architecture import add_bias_linear, megatron_gaps, no_rope_freq
from dsauto.engines.megatron import (
    ATTENTION_BACKEND,
    FSDP_STRATEGY,
    LAUNCH_ENVIRONMENT,
    LAUNCH_VOCABULARY,
    PLANNED_FOR,
    block_recompute_layers,
    ddp_bucket_size,
    degree_flags,
    max_connections,
    pipeline_layout,
    qk_layernorm,
    selective_recompute_modules,
    softmax_fusion_setting,
)
from dsauto.engines.rules import clamped_gate_refusal
from dsauto.plan import Plan
from dsauto.plan_io import MEGATRON_ARGS_NAME, PLAN_ID_COMMENT, plan_id
from dsauto.spec.model import VOCAB_PAD_MULTIPLE, ModelSpec

COMMENT = "# "
"""Prefix of the lines that explain rather than set something."""

def megatron_args(plan: Plan, file_name: str = MEGATRON_ARGS_NAME) -> list[str]:
    """``plan`` as Megatron-LM arguments, one per line.

    Each line is a flag, a flag and its value separated by one space, or a comment starting with
    ``# `` that says what the flags do not express. The lines are shell words: a value a shell would
    read otherwise (the layout's ``|`` and ``*``, an expert pattern's parentheses) is quoted, and a
    comment says so and how to pass them from the file the lines are written to (``file_name``).
    """
    dtype_bytes(plan)  # refuses a dtype that neither engine knows
    lines = _parallelism(plan)
    lines += _model_shape(plan)
    lines += _batch_and_precision(plan)
    lines += _data_parallel(plan)
    lines += _pipeline_layout(plan.stage_layers, plan.virtual_stages, plan.model.mtp_layers, plan.chunk_layout)
    lines += _recompute(plan)
    lines += _hook_only(plan)
    quoted = [_shell_words(line) for line in lines]
    header = _header(plan)
    if quoted != lines:
        header.append(f"{COMMENT}Shell words, values quoted where a shell would read them otherwise: in bash, "
                      f"eval \"ARGS=($(grep -v '^#' {shlex.quote(file_name)}))\" and pass \"${{ARGS[@]}}\" to the training "
                      f"script.")
    return header + quoted


def _shell_words(line: str) -> str:
    """A flag line with its value (each word of a list flag's) quoted as a shell needs it."""
    if line.startswith(COMMENT):
        return line
    flag, _, value = line.partition(" ")
    if not value:
        return line
    words = value.split(" ") if line.startswith(LIST_FLAGS) else [value]
    return " ".join([flag, *(shlex.quote(word) for word in words)])


def megatron_argv(plan: Plan) -> list[str]:
    """``plan``'s Megatron-LM arguments as an argv list (flags and values as separate items)."""
    return [token for line in megatron_args(plan) if not line.startswith(COMMENT) for token in shlex.split(line)]


LIST_FLAGS = ("--recompute-modules ",)
"""Flags whose value is a list of words, one argument each (argparse ``nargs="*"``)."""


def write_megatron_args(plan: Plan, path: Path | str) -> Path:
    """Writes :func:`megatron_args` to ``path``, one flag (with its value) per line."""
    path = Path(path)
    path.write_text("\n".join(megatron_args(plan, path.name)) + "\n")
    return path


def _header(plan: Plan) -> list[str]:
    lines = [
        f"{COMMENT}{PLANNED_FOR} {plan.model.name} on {plan.nodes} x "
        f"{plan.gpus_per_node} {plan.hardware}.",
        f"{COMMENT}Launch {plan.world_size} ranks: data parallel {plan.dp} = world size "
        f"{plan.world_size} / (tp {plan.tp} x pp {plan.pp}{f' x cp {plan.cp}' if plan.cp > 1 else ''}).",
        PLAN_ID_COMMENT + plan_id(plan),  # ties the file to the other artifacts of its set
    ]
    if plan.engine != "megatron":
        lines.append(f"{COMMENT}Not the priced run: this plan is priced for {plan.engine} (ds_config.json); these "
                     f"flags run its degrees and choices on Megatron-core, whose memory and time differ (fp32 main "
                     f"gradients, its own buffers and overlap): plan with --engine megatron for a launch priced as "
                     f"Megatron-core runs it.")
    if need := max_connections(plan):
        lines.append(f"{COMMENT}{LAUNCH_ENVIRONMENT} {need.setting()}, for {need.why}.")
    if setting := softmax_fusion_setting(plan):
        lines.append(f"{COMMENT}{LAUNCH_ENVIRONMENT} {setting}, for the unfused attention's fp32 softmax the plan "
                     f"prices (Transformer Engine's layers fuse it otherwise, keeping 16 bits).")
    if plan.model.architecture == "encoder":
        lines.append(f"{COMMENT}Encoder (masked language) model: use these with Megatron-LM's "
                     f"pretrain_bert.py.")
    return lines


def _parallelism(plan: Plan) -> list[str]:
    lines = degree_flags(plan.dims, experts=plan.model.moe)
    if plan.sequence_parallel:
        lines.append("--sequence-parallel")
    if plan.tp_comm_overlap:
        lines.append("--tp-comm-overlap")  # Transformer Engine's userbuffers; needs --sequence-parallel
    if plan.cp > 1:
        lines.append(f"--cp-comm-type {plan.cp_comm_type}")  # Transformer Engine's exchange of the shards
    if plan.expert_a2a_overlap:
        lines.append("--overlap-moe-expert-parallel-comm")  # the combined 1F1B schedule
    return lines


def _model_shape(plan: Plan) -> list[str]:
    model = plan.model
    lines = [
        f"--num-layers {model.num_layers}",
        f"--hidden-size {model.hidden_size}",
        f"--ffn-hidden-size {model.ffn_hidden_size}",
        f"--num-attention-heads {model.num_attention_heads}",
    ]
    if model.attention_head_dim:
        lines.append(f"--kv-channels {model.attention_head_dim}")  # Megatron's default: hidden / heads
    if model.kv_heads != model.num_attention_heads:
        lines += ["--group-query-attention", f"--num-query-groups {model.kv_heads}"]
    # validate_args asserts max_position_embeddings >= seq_length; rotary positions have no table, so
    # a plan that extends the context (dsauto.api.default_seq_len warns of it) sizes them to its sequence.
    lines.append(f"--max-position-embeddings {max(model.max_position_embeddings, plan.seq_len)}")
    lines += _positions(model)
    lines += _attention(model, plan.seq_len)
    lines += _norms(model)
    lines += _mlp(model)
    lines += _experts(model, plan.expert_dispatcher)
    if plan.expert_load_balanced:
        lines.append("--moe-router-force-load-balancing")  # a benchmarking option, emitted only when pinned
    if plan.expert_capacity_factor is not None:  # token dropping, emitted only when pinned
        lines.append(f"--moe-expert-capacity-factor {plan.expert_capacity_factor:g}")
        if plan.expert_pad_to_capacity:
            lines.append("--moe-pad-expert-input-to-capacity")
    if not model.tied_embeddings:
        lines.append("--untie-embeddings-and-output-weights")
    if model.mtp_layers:  # on the last pipeline stage (mtp_on_this_rank), at Megatron's loss scale 0.1
        lines.append(f"--mtp-num-layers {model.mtp_layers}")
    if not model.dropout:
        lines += ["--hidden-dropout 0.0", "--attention-dropout 0.0"]  # Megatron's defaults are 0.1
    if model.architecture == "encoder":
        # The masked-LM head only: Megatron's next-sentence head (pooler and binary classifier)
        # is not part of the planned model, and with it the token-type embedding goes too.
        lines.append("--bert-no-binary-head")
    lines += [f"{COMMENT}Not expressed: {gap}." for gap in megatron_gaps(model)]
    lines += [
        f"{COMMENT}{LAUNCH_VOCABULARY} {model.vocab_size} tokens from the tokenizer, padded to "
        f"{plan.padded_vocab_size} (a multiple of {VOCAB_PAD_MULTIPLE} x tp {plan.tp}).",
        f"--make-vocab-size-divisible-by {VOCAB_PAD_MULTIPLE}",
    ]
    return lines


# Megatron-core's llama3 rope scaling has these parameters fixed (RotaryEmbedding._apply_scaling in
# megatron/core/models/common/embeddings/rotary_pos_embedding.py); only the factor is a flag.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}
# Hugging Face's YaRN parameters that Megatron-LM has flags for (megatron/training/argument_utils.py,
# _apply_yarn_config_from_args).
_YARN_FLAGS = {"original_max_position_embeddings": "--yarn-original-max-position-embeddings",
               "beta_fast": "--yarn-beta-fast", "beta_slow": "--yarn-beta-slow", "mscale": "--mscale",
               "mscale_all_dim": "--mscale-all-dim"}


def _positions(model: ModelSpec) -> list[str]:
    """Position embedding: learned table, rotary (base, fraction, scaling) or none (ALiBi)."""
    if model.position_embedding == "learned":
        return ["--position-embedding-type learned_absolute"]
    if model.position_embedding == "alibi":
        return ["--position-embedding-type none"]  # ALiBi: a gap (engines/architecture.py)
    params = dict(model.rope_scaling_params)
    if model.latent_attention:
        return _latent_positions(model, params)
    kind = "yarn" if model.rope_scaling == "yarn" else "rope"
    lines = [f"--position-embedding-type {kind}"]
    if model.rotary_base.is_integer():  # Megatron-LM reads --rotary-base as a whole number
        lines.append(f"--rotary-base {int(model.rotary_base)}")
    else:
        lines.append(f"{COMMENT}Not expressed: the rotary base {model.rotary_base} (Megatron-LM takes a "
                     f"whole number).")
    if model.rotary_percent < 1.0:
        lines.append(f"--rotary-percent {model.rotary_percent:g}")
    if model.rotary_interleaved:
        lines.append("--rotary-interleaved")  # adjacent pairs rotate (GPT-J's layout)
    if every := no_rope_freq(model):
        lines.append(f"--no-rope-freq {every}")  # every N-th layer without positions
    scaling, factor = model.rope_scaling, model.rope_scaling_factor
    if scaling == "llama3":
        lines += ["--use-rope-scaling", f"--rope-scaling-factor {factor:g}"]
        differ = {k: v for k, v in params.items() if _LLAMA3_FIXED.get(k) != v}
        if differ:
            lines.append(f"{COMMENT}Not expressed: llama3 rope scaling with {_pairs(differ)} (Megatron-core "
                         f"fixes {_pairs(_LLAMA3_FIXED)}).")
    elif scaling == "linear" and factor.is_integer():
        lines.append(f"--rotary-seq-len-interpolation-factor {int(factor)}")
    elif scaling == "yarn":
        lines.append(f"--rotary-scaling-factor {factor:g}")
        original = params.pop("original_max_position_embeddings", model.max_position_embeddings)
        lines.append(f"--yarn-original-max-position-embeddings {int(original)}")
        lines += [f"{_YARN_FLAGS[k]} {v:g}" for k, v in params.items() if k in _YARN_FLAGS]
        rest = {k: v for k, v in params.items() if k not in _YARN_FLAGS}
        if rest:
            lines.append(f"{COMMENT}Not expressed: YaRN's {_pairs(rest)}.")
    elif scaling == "longrope":  # per-dimension short and long factors, no single factor
        original = params.get("original_max_position_embeddings")
        span = f"from {int(original)} to {model.max_position_embeddings} positions, " if original else ""
        lines.append(f"{COMMENT}Not expressed: longrope rope scaling ({span}a short and a long factor per rotary "
                     f"dimension); Megatron-LM has llama3, linear (whole factors) and YaRN scaling.")
    elif scaling:
        lines.append(f"{COMMENT}Not expressed: {scaling} rope scaling (factor {factor:g}"
                     f"{', ' + _pairs(params) if params else ''}); Megatron-LM has llama3, linear "
                     f"(whole factors) and YaRN scaling.")
    return lines


# Latent attention's YaRN parameters that Megatron-LM has no flag for, at MLATransformerConfig's defaults
# (megatron/core/transformer/transformer_config.py): original_max_position_embeddings, beta_fast, beta_slow.
_MLA_YARN_FIXED = {"original_max_position_embeddings": 4096.0, "beta_fast": 32.0, "beta_slow": 1.0}


def _latent_positions(model: ModelSpec, params: dict[str, float]) -> list[str]:
    """Latent attention's rotary positions: MLA builds its own rotary embedding, YaRN or plain by
    ``--rope-type``, under ``--position-embedding-type rope`` (GPTModel builds a model-wide one for
    ``rope`` only without latent attention, and for ``yarn`` always, which would be a second; and
    Megatron-LM's multi-token prediction asserts rope or none). YaRN's factor and mscales are flags
    MLATransformerConfig reads by name; its other parameters are fixed at the config's defaults."""
    lines = ["--position-embedding-type rope", f"--rope-type {'yarn' if model.rope_scaling == 'yarn' else 'rope'}"]
    if model.rope_scaling != "yarn":
        # MLATransformerConfig refuses Megatron-LM's default rope fusion without YaRN ("apply_rope_fusion for
        # MLA only works with YARN RoPE", megatron/core/transformer/transformer_config.py)
        lines.append("--no-rope-fusion")
    if model.rotary_base.is_integer():
        lines.append(f"--rotary-base {int(model.rotary_base)}")
    else:
        lines.append(f"{COMMENT}Not expressed: the rotary base {model.rotary_base} (Megatron-LM takes a "
                     f"whole number).")
    if model.rope_scaling == "yarn":
        lines.append(f"--rotary-scaling-factor {model.rope_scaling_factor:g}")
        lines += [f"{_YARN_FLAGS[k]} {params[k]:g}" for k in ("mscale", "mscale_all_dim") if k in params]
        differ = {k: v for k, v in params.items() if k in _MLA_YARN_FIXED and _MLA_YARN_FIXED[k] != v}
        rest = {k: v for k, v in params.items() if k not in _MLA_YARN_FIXED and k not in ("mscale", "mscale_all_dim")}
        if differ or rest:
            lines.append(f"{COMMENT}Not expressed: YaRN's {_pairs({**differ, **rest})} (latent attention takes "
                         f"{_pairs(_MLA_YARN_FIXED)}).")
    elif model.rope_scaling:
        lines.append(f"{COMMENT}Not expressed: {model.rope_scaling} rope scaling; latent attention has YaRN's.")
    return lines


def _attention(model: ModelSpec, seq_len: int) -> list[str]:
    """Biases of the projections, query/key norms, sliding windows (one that slides over ``seq_len``-token
    sequences: :meth:`ModelSpec.window_slides`), score scaling and capping."""
    qkv_bias, _, _ = model.biases
    lines = []
    if not add_bias_linear(model):
        lines.append("--disable-bias-linear")
        if qkv_bias:
            lines.append("--add-qkv-bias")
    if qk_layernorm(model):
        # of the --normalization kind, over the head width (with latent attention: the latent norms)
        lines.append("--qk-layernorm")
    if model.latent_attention:
        # Megatron-core's MLA (MLATransformerConfig): qk_head_dim is the part without rotary
        # embedding, qk_pos_emb_head_dim the rotary part; no --q-lora-rank: one query projection.
        lines += ["--multi-latent-attention", f"--kv-lora-rank {model.kv_lora_rank}",
                  f"--qk-head-dim {model.qk_nope_head_dim}", f"--qk-pos-emb-head-dim {model.qk_rope_head_dim}",
                  f"--v-head-dim {model.v_head_dim}"]
        if model.q_lora_rank:
            lines.append(f"--q-lora-rank {model.q_lora_rank}")
    if model.window_slides(seq_len):
        # Hugging Face's window counts the query's own token; Megatron's (left, right) does not.
        lines.append(f"--window-size {model.sliding_window - 1},0")
        if model.global_attention_every:
            lines.append(f"--window-attn-skip-freq {model.global_attention_every}")
    if model.attention_sinks:
        # a learned logit per head joins each softmax (megatron/core/transformer/dot_product_attention.py;
        # Transformer Engine 2.8 on, in cuDNN's fused attention: extensions/transformer_engine.py)
        lines.append("--softmax-type learnable")
    if model.attention_scale_dim:
        lines.append(f"{COMMENT}Not expressed: attention scores scaled by 1/sqrt({model.attention_scale_dim:g}) "
                     f"instead of 1/sqrt(head width {model.head_dim}) (TransformerConfig.softmax_scale "
                     f"has no flag).")
    return lines


def _norms(model: ModelSpec) -> list[str]:
    lines = [
        "--normalization " + ("RMSNorm" if model.norm == "rmsnorm" else "LayerNorm"),
        f"--norm-epsilon {model.norm_epsilon:g}",
    ]
    if model.norm_plus_one:
        lines.append("--apply-layernorm-1p")  # scale by (1 + weight), the weight starting at zero
    if model.residual_post_norm:
        lines.append("--apply-residual-connection-post-layernorm")
    return lines


def _mlp(model: ModelSpec) -> list[str]:
    """The MLP's activation. Megatron-core computes GeLU exactly (F.gelu), except in its fused
    bias-GeLU kernel (on by default when linear layers have biases), which uses the tanh
    approximation (megatron/core/transformer/mlp.py, fusions/fused_bias_gelu.py)."""
    _, _, mlp_bias = model.biases
    if model.glu_clamp:
        # gpt-oss: x sigmoid(1.702 x) of the gate times the linear half + 1, both clamped (Megatron-LM's
        # argument_utils.py turns --quick-geglu into quick_gelu with a gated linear unit; the other two
        # are TransformerConfig's glu_linear_offset and activation_func_clamp_value)
        flags = ["--quick-geglu", "--glu-linear-offset 1", f"--activation-func-clamp-value {model.glu_clamp:g}"]
        if why := clamped_gate_refusal("megatron", model):
            # only a DeepSpeed plan gets here (the search refuses Megatron-core's): its flags still launch
            flags += ["--no-bias-gelu-fusion", f"{COMMENT}Unfused: {why}."]
        return flags
    if model.mlp == "swiglu":
        return ["--swiglu"]  # --ffn-hidden-size is then the width of each branch, as in ModelSpec
    if model.mlp == "geglu":
        return ["--quick-geglu",
                f"{COMMENT}Not expressed: the MLP is GeGLU ({_gelu(model)}); Megatron-LM's only GeLU-gated "
                f"MLP flag is --quick-geglu (x*sigmoid(1.702x)), the same shapes and cost."]
    if model.mlp == "relu2":
        return ["--squared-relu"]
    if model.mlp == "relu":
        return [f"{COMMENT}Not expressed: ReLU in the MLP (Megatron-LM has GeLU, squared ReLU and gated "
                f"units); Megatron's default GeLU has the same shapes and cost."]
    fused_tanh = model.linear_bias and mlp_bias  # Megatron fuses bias and GeLU when it has biases
    if fused_tanh and not model.gelu_tanh:
        return ["--no-bias-gelu-fusion"]  # the exact GeLU, as the model computes it
    if not fused_tanh and model.gelu_tanh:
        return [f"{COMMENT}Not expressed: GeLU's tanh approximation without biases (Megatron-core "
                f"then computes GeLU exactly)."]
    return []


def _experts(model: ModelSpec, dispatcher: str = "alltoall") -> list[str]:
    """The mixture of experts (megatron/core/transformer/transformer_config.py, the ``moe_*``
    fields): experts, top-k, widths, which layers, the router, the grouped GEMM and the dispatcher
    the plan is priced with (Megatron's default dispatcher is ``allgather``): ``alltoall``, or
    ``flex`` with the DeepEP backend."""
    if not model.moe:
        return []
    lines = [f"--num-experts {model.num_experts}", f"--moe-router-topk {model.moe_top_k}",
             f"--moe-ffn-hidden-size {model.expert_ffn_hidden_size}"]
    if model.shared_expert_ffn_hidden_size:
        lines.append(f"--moe-shared-expert-intermediate-size {model.shared_expert_ffn_hidden_size}")
        if model.shared_expert_gate:
            lines.append("--moe-shared-expert-gate")
    layers = model.moe_layers()
    if len(layers) < model.num_layers:
        # A pattern is a Python list expression Megatron-LM evaluates (moe_freq_type): runs of 0
        # (dense) and 1 (MoE).
        flags = [1 if i in layers else 0 for i in range(model.num_layers)]
        period = next(n for n in range(1, len(flags) + 1) if len(flags) % n == 0
                      and flags == flags[:n] * (len(flags) // n))
        if 1 < period <= 4:  # Llama 4 Maverick's alternation: ([0,1]*24)
            lines.append(f"--moe-layer-freq ([{','.join(map(str, flags[:period]))}]*{len(flags) // period})")
        else:
            runs: list[tuple[int, int]] = []
            for flag in flags:
                if runs and runs[-1][0] == flag:
                    runs[-1] = (flag, runs[-1][1] + 1)
                else:
                    runs.append((flag, 1))
            lines.append("--moe-layer-freq (" + "+".join(f"[{flag}]*{count}" for flag, count in runs) + ")")
    if model.moe_router == "sigmoid":
        # DeepSeek-V3's routing: sigmoid scores, balanced by a per-expert bias instead of a loss
        lines.append("--moe-router-score-function sigmoid")
        if model.moe_router_balancing_bias:
            lines.append("--moe-router-enable-expert-bias")
    if model.moe_router_pre_softmax:
        lines.append("--moe-router-pre-softmax")  # the softmax over all experts, not renormalised over the chosen
    if model.moe_router_topk_scaling:
        lines.append(f"--moe-router-topk-scaling-factor {model.moe_router_topk_scaling:g}")
    if model.moe_router_groups:  # DeepSeek-V3's node-limited routing
        lines += [f"--moe-router-num-groups {model.moe_router_groups}",
                  f"--moe-router-group-topk {model.moe_router_group_topk}"]
    if model.moe_probs_on_input:
        lines.append("--moe-apply-probs-on-input")  # Llama 4: the router's weight scales the expert's input
    lines.append("--moe-grouped-gemm")
    if dispatcher == "deepep":
        lines += ["--moe-token-dispatcher-type flex", "--moe-flex-dispatcher-backend deepep"]
    else:
        lines.append("--moe-token-dispatcher-type alltoall")
    return lines


def _gelu(model: ModelSpec) -> str:
    return "GeLU, tanh approximation" if model.gelu_tanh else "exact GeLU"


def _pairs(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in values.items())


def _batch_and_precision(plan: Plan) -> list[str]:
    # Megatron derives the number of micro-batches as global / (micro x dp), the plan's grad_accum.
    lines = [
        f"--seq-length {plan.seq_len}",
        f"--micro-batch-size {plan.micro_batch}",
        f"--global-batch-size {plan.global_batch}",
    ]
    if plan.dtype in ("bf16", "fp16"):
        lines.append(f"--{plan.dtype}")
    if not plan.grad_reduce_in_fp32:
        lines.append("--grad-reduce-in-bf16")
    if plan.precision_aware_optimizer is not None:
        # Transformer Engine's FusedAdam: the moments in this dtype, the fp32 main weights as the bits
        # the bf16 weights lack (store_param_remainders, Megatron-core's default from TE 2.1).
        moments = plan.precision_aware_optimizer
        lines += ["--use-precision-aware-optimizer", f"--exp-avg-dtype {moments}", f"--exp-avg-sq-dtype {moments}"]
    if plan.fp8:
        # Transformer Engine's FP8 linear layers: E4M3 in forward, E5M2 for the gradients, scaled
        # by the recipe the plan is priced with.
        lines += ["--fp8-format hybrid", f"--fp8-recipe {plan.fp8_recipe}"]
        if plan.fp8_param_gather:
            lines.append("--fp8-param-gather")  # FP8 weights, gathered at one byte a parameter
    # --use-flash-attn is still defined but no longer read by Megatron-LM; the backend flag is.
    # Fused attention keeps no s x s scores, as the plan's memory prediction assumes; "unfused" is
    # the eager softmax whose scores the plan counts. "fused" is cuDNN's kernel (Transformer
    # Engine's FusedAttention), "flash" FlashAttention: the kernel the plan's time is priced with,
    # named rather than left to Transformer Engine's "auto".
    backend = ATTENTION_BACKEND[plan.attention_kernel] if plan.flash_attention else "unfused"
    lines.append("--attention-backend " + backend)
    if not plan.flash_attention and plan.dtype != "fp32" and plan.attention_softmax_in_fp32:
        # The unfused softmax as priced and as dsauto's plugin runs it: on an fp32 copy of the scores,
        # its fp32 output kept. Megatron-LM's defaults keep 16 bits (the flag is opt-in, and its fused
        # masked-softmax kernel, on by default, keeps 16 bits where the shapes allow it).
        lines += ["--attention-softmax-in-fp32", "--no-masked-softmax-fusion"]
    return lines


def _data_parallel(plan: Plan) -> list[str]:
    lines = []
    if plan.zero_stage >= 1:
        lines.append("--use-distributed-optimizer")
    if plan.dist_opt_instances > 1:
        # The partial distributed optimizer (its instances shard the optimizer state inside themselves).
        lines.append(f"--num-distributed-optimizer-instances {plan.dist_opt_instances}")
    if plan.zero_stage in FSDP_STRATEGY:
        lines += [
            "--use-megatron-fsdp",
            f"--data-parallel-sharding-strategy {FSDP_STRATEGY[plan.zero_stage]}",
            "--ckpt-format fsdp_dtensor",  # Megatron-LM's validate_args requires it with Megatron-FSDP
        ]
    if plan.overlap_grad_reduce:
        lines.append("--overlap-grad-reduce")
    if plan.gathers_params_overlapped:
        lines.append("--overlap-param-gather")
    lines += optimizer_offload_flags(plan)
    lines.append(f"--ddp-bucket-size {ddp_bucket_size(plan)}")
    return lines


def optimizer_offload_flags(plan: Plan) -> list[str]:
    """Megatron-LM's flags for the plan's optimizer offload: all of the optimizer on the host
    (``--optimizer-offload-fraction 1``), its copies overlapped with the CPU's update, and the
    precision-aware optimizer that Megatron-LM's validate_args requires with CPU offload (the hybrid
    device optimizer reuses its code path: megatron/core/optimizer/optimizer_config.py)."""
    if plan.offload == "none":
        return []
    return ["--optimizer-cpu-offload", "--optimizer-offload-fraction 1.0", "--overlap-cpu-optimizer-d2h-h2d",
            "--use-precision-aware-optimizer"]


def _pipeline_layout(stage_layers: tuple[int, ...], virtual_stages: int = 1, mtp_layers: int = 0,
                     chunks: tuple[int, ...] | None = None) -> list[str]:
    """Flags placing the plan's layers per stage (and per virtual stage, which the layout string's
    chunk count sets); none when Megatron's even split already does."""
    layout = pipeline_layout(stage_layers, virtual_stages, mtp_layers, chunks)
    if layout.layout is not None:
        return [f"--pipeline-model-parallel-layout {layout.layout}"]
    if layout.first_stage_layers is not None:
        return [f"--decoder-first-pipeline-num-layers {layout.first_stage_layers}",
                f"--decoder-last-pipeline-num-layers {layout.last_stage_layers}"]
    return []


def _recompute(plan: Plan) -> list[str]:
    modules = selective_recompute_modules(plan)
    if modules is None:
        what = "; ".join(f"{'+'.join(m)} in {layers_text(layers)}" for m, layers in plan.selective_layers().items())
        return [f"{COMMENT}Not expressed: selective recomputation of {what} is not the same modules in every "
                f"transformer layer without whole-layer checkpointing, which is all Megatron's single "
                f"--recompute-granularity can say; the dsauto hook applies the nearest setting."]
    if modules:
        return ["--recompute-granularity selective", "--recompute-modules " + " ".join(modules)]
    n = block_recompute_layers(plan)
    if n is None:
        return [
            f"{COMMENT}Not expressed: activation checkpointing of transformer "
            f"{layers_text(plan.checkpointed_layers())} is not the first N layers of every stage, which is "
            f"all --recompute-method block can say; the dsauto hook checkpoints exactly these layers.",
        ]
    if n == 0:
        return []
    return ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {n}"]


def _hook_only(plan: Plan) -> list[str]:
    """Comments for the plan's choices that no Megatron flag expresses."""
    lines = []
    ends = [run for run in plan.layers if run.checkpoint and run.group in ("embedding", "head")]
    if ends:
        lines.append(f"{COMMENT}Not expressed: checkpointing of the {_groups(ends)} (Megatron's "
                     f"recompute flags cover transformer layers only); the dsauto hook applies it.")
    split = [run for run in plan.layers if run.split > 1]
    if split:
        what = ", ".join(f"{layer_span(run.first, run.last)} ({run.group}) in {run.split} slices" for run in split)
        lines.append(f"{COMMENT}Not expressed: operator splitting of {what}; the dsauto hook "
                     f"splits these operators.")
    kept = [run for run in plan.layers if not run.shard_params]
    if plan.zero_stage == 3 and kept:
        lines.append(
            f"{COMMENT}Not expressed: ZeRO-3 keeps the parameters of {runs_text(kept)} resident on "
            f"every data-parallel rank and shards the rest; Megatron-FSDP's optim_grads_params "
            f"shards all of them, and the dsauto hook keeps these resident."
        )
    return lines


def _groups(runs: list) -> str:
    names = list(dict.fromkeys(run.group for run in runs))
    return " and ".join(names)
