"""Hugging Face ``config.json`` as a ModelSpec: one table row per model family.

Each family in :data:`FAMILIES` says how its config spells a ModelSpec:

- ``keys``: the config keys of the shape's whole numbers (layers, width, heads, MLP width,
  vocabulary, positions), with the older spellings the config class still accepts (GPT-2's
  ``n_layer``, BLOOM's ``n_embed``);
- ``fixed``: the choices the family makes whatever the config says (RMSNorm, a gated MLP, ...);
- ``defaults``: the values of the family's config class in transformers, for keys a config.json
  leaves out;
- ``readers``: small functions, shared between families, that read the optional keys (rotary
  embedding, biases, sliding window, soft-capping, ...) into ModelSpec fields;
- ``expected``: keys whose other values describe an architecture dsauto does not model; such a
  value is refused with one sentence naming the key;
- ``ignored``: the family's keys that change neither the cost nor the emitted flags.

Every key a reader reads is marked; a key that nothing marks and that is not one of the generic keys
every config carries (token ids, dtype, generation settings) is named in a :class:`DsautoWarning`,
since dsauto cannot tell whether it changes the architecture; in a mixture of experts (Mixtral,
Qwen2/Qwen3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss) such a key is an error instead, since it could
move or resize the experts. Other mixtures of experts and encoder-decoder models are refused,
naming the keys that make them so.

Both spellings of the rotary settings are read: config.json files on the Hub (``rope_theta``,
``rope_scaling``, ``partial_rotary_factor``, ``rotary_pct``) and transformers 5's
``rope_parameters`` (``config.to_dict()`` of a config object), with its per-layer-type form.

Parameter counts are exact: ``tests/spec/test_hf_families.py`` builds each family's transformers
model from the same config on the meta device and compares, and checks the published totals of
public configs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from dsauto.errors import DsautoError, DsautoWarning
from dsauto.serde import from_dict
from dsauto.spec.model import ModelSpec, in_own_words

MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
            "num_experts_per_tok", "experts_per_token", "n_shared_experts",
            "shared_expert_intermediate_size", "moe_num_experts", "ffn_config")
"""Keys that make a config a mixture of experts when they hold a value (not null, not 0)."""

MOE_TYPES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss",
                       "olmoe", "dbrx", "jamba", "granitemoe", "granitemoeshared", "phimoe", "jetmoe", "llama4",
                       "llama4_text", "qwen3_next", "glm4_moe", "minimax", "minimax_m2", "ernie4_5_moe"})
"""Families that are mixtures of experts whatever their keys say."""

GENERIC_KEYS = frozenset({
    # PretrainedConfig's own attributes and what the Hub adds to every config.json
    "_name_or_path", "name_or_path", "architectures", "model_type", "transformers_version", "dtype",
    "torch_dtype", "auto_map", "_commit_hash", "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "problem_type", "id2label", "label2id",
    "num_labels", "finetuning_task", "task_specific_params", "tokenizer_class", "prefix",
    "chunk_size_feed_forward", "pruned_heads", "initializer_range", "initializer_factor", "init_std",
    "classifier_dropout", "gradient_checkpointing", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "unk_token_id", "decoder_start_token_id", "cache_implementation",
    "is_encoder_decoder", "tie_encoder_decoder", "use_return_dict", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size",  # families with cross-attention check these (``expected``)
    # generation settings
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})
"""Keys any config may carry that change neither the cost nor the emitted flags."""

_ROPE_SCALINGS = {"linear", "llama3", "yarn", "dynamic", "longrope"}
_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True}
"""Hugging Face activation names of GeLU -> whether they use the tanh approximation."""
_SILU = {"silu", "swish"}


@runtime_checkable
class HfConfigLike(Protocol):
    """A ``transformers`` config object (``PretrainedConfig``), without importing transformers."""

    model_type: str

    def to_dict(self) -> dict[str, Any]: ...


class Config:
    """One Hugging Face config being read: its values, its family's defaults, and the keys read."""

    def __init__(self, data: Mapping[str, Any], where: str, model_type: str, defaults: Mapping[str, Any]):
        self.data, self.where, self.model_type, self.defaults = data, where, model_type, defaults
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        """The config's value of ``key`` (null counts as absent), else the family's default, else
        ``default``; marks ``key`` read."""
        self.read.add(key)
        value = self.data.get(key)
        if value is None:
            value = self.defaults.get(key, default)
        return value

    def given(self, key: str) -> bool:
        """Whether the config itself gives ``key`` a value (marks it read)."""
        self.read.add(key)
        return self.data.get(key) is not None

    def whole(self, key: str, default: Any = None) -> int | None:
        value = self.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise self.error(f"{key} must be a whole number, got {value!r}")
        return value

    def number(self, key: str, default: float | None = None) -> float | None:
        value = self.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise self.error(f"{key} must be a number, got {value!r}")
        return None if value is None else float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(f"{key} must be true or false, got {value!r}")
        return value

    def error(self, what: str) -> DsautoError:
        return DsautoError(f"{self.where}: {what}.")

    def unsupported(self, what: str) -> DsautoError:
        return DsautoError(f"{self.where} is a {self.model_type} model with {what}, which dsauto does "
                           f"not model yet; remove it from the config or write a dsauto model YAML.")


Reader = Callable[[Config, dict[str, Any]], None]
"""Reads some optional keys of a config into ModelSpec fields (the dict being built)."""


@dataclass(frozen=True)
class Family:
    """How one family of Hugging Face configs spells a ModelSpec."""

    keys: Mapping[str, tuple[str, ...]]
    """ModelSpec field -> its config keys, the first given one wins (required unless a default)."""
    fixed: Mapping[str, Any]
    """ModelSpec fields the family fixes."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Config key -> the family's config-class default, for keys a config leaves out."""
    readers: tuple[Reader, ...] = ()
    """Readers of the family's optional keys, in order."""
    expected: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    """Config key -> (the value dsauto models, what another value would mean)."""
    ignored: frozenset[str] = frozenset()
    """The family's keys that change neither cost nor flags."""
    optional: frozenset[str] = frozenset()
    """Shape fields a reader fills when the config leaves them out (GPT-2's ``n_inner: null``)."""


# --- readers shared between families ---------------------------------------------------------------


def read_kv_heads(key: str = "num_key_value_heads") -> Reader:
    def read(cfg: Config, spec: dict[str, Any]) -> None:
        kv = cfg.whole(key)
        if kv is not None and kv <= 0:  # ModelSpec's 0 means one per head; the config's would build no heads
            raise cfg.error(f"{key} must be a positive number of key/value heads, got {kv}")
        spec["num_kv_heads"] = 0 if kv in (None, spec["num_attention_heads"]) else kv
    return read


def read_head_dim(cfg: Config, spec: dict[str, Any]) -> None:
    """``head_dim`` when it is not hidden / heads (Gemma, Mistral-NeMo, Qwen3)."""
    head_dim = cfg.whole("head_dim")
    if head_dim is not None and head_dim * spec["num_attention_heads"] != spec["hidden_size"]:
        spec["attention_head_dim"] = head_dim


def read_tied(cfg: Config, spec: dict[str, Any]) -> None:
    # Passed through as given: ModelSpec's reader names a value that is not true or false.
    spec["tied_embeddings"] = cfg.get("tie_word_embeddings")


def read_norm_epsilon(*keys: str) -> Reader:
    def read(cfg: Config, spec: dict[str, Any]) -> None:
        for key in keys:
            value = cfg.number(key)
            if value is not None:
                spec["norm_epsilon"] = value
                return
    return read


def read_dropout(*keys: str) -> Reader:
    """Dropout is on when any of these probabilities is above zero."""
    def read(cfg: Config, spec: dict[str, Any]) -> None:
        probabilities = [cfg.number(key) or 0.0 for key in keys]  # every key read, none skipped
        spec["dropout"] = any(p > 0 for p in probabilities)
    return read


def read_biases(**switches: tuple[str, ...]) -> Reader:
    """Config flag -> the biases it switches on: ``qkv``, ``proj``, ``mlp``."""
    def read(cfg: Config, spec: dict[str, Any]) -> None:
        on = {kind for key, kinds in switches.items() if cfg.flag(key) for kind in kinds}
        set_biases(spec, on)
    return read


def set_biases(spec: dict[str, Any], on: set[str]) -> None:
    """Sets ModelSpec's bias fields for the biases in ``on`` (of ``qkv``, ``proj``, ``mlp``)."""
    spec["linear_bias"] = on >= {"qkv", "proj", "mlp"}
    if not spec["linear_bias"]:
        spec.update(qkv_bias="qkv" in on, proj_bias="proj" in on, mlp_bias="mlp" in on)


def read_activation(key: str, gated: bool) -> Reader:
    """The MLP's activation: SiLU, GeLU (exact or tanh) or ReLU, gated or not by family."""
    def read(cfg: Config, spec: dict[str, Any]) -> None:
        name = cfg.get(key)
        if name in _SILU and gated:
            spec["mlp"] = "swiglu"
        elif name in _GELU:
            spec["mlp"] = "geglu" if gated else "gelu"
            spec["gelu_tanh"] = _GELU[name]
            if name in ("gelu_new", "gelu_fast"):  # NewGELUActivation, FastGELUActivation: Python operators
                spec["gelu_formula"] = name
        elif name in ("relu", "relu2") and not gated:
            spec["mlp"] = name
        else:
            known = sorted((_SILU if gated else {"relu", "relu2"}) | set(_GELU))
            raise cfg.error(f"{key} {name!r} is not an activation dsauto knows for a "
                            f"{'gated ' if gated else ''}{cfg.model_type} MLP; use one of {', '.join(known)}")
    return read


QUERY_SCALING = "llama_4_scaling_beta"
"""Ministral 3's query scaling with the position, a key of its rope parameters that is no rotation's."""


def read_rope(cfg: Config, spec: dict[str, Any]) -> None:
    """Rotary base, partial rotary and scaling, in either spelling (see the module doc)."""
    params, local_base = cfg.get("rope_parameters"), None
    local_scaled = None  # the family's choice (Family.fixed), unless the parameters are per layer type
    if isinstance(params, Mapping) and isinstance(params.get("full_attention"), Mapping):
        local = params.get("sliding_attention") or {}
        params = params["full_attention"]  # per layer type (Gemma 3): the global layers' settings
        local_base = local.get("rope_theta") if isinstance(local, Mapping) else None
        local_scaled = isinstance(local, Mapping) and (local.get("rope_type") or "default") != "default"
    if params is not None and not isinstance(params, Mapping):
        raise cfg.error(f"rope_parameters must be a mapping, got {params!r}")
    params = dict(params or {})
    base = cfg.number("rope_theta", cfg.number("rotary_emb_base"))
    base = params.pop("rope_theta", base)
    if base is not None:
        spec["rotary_base"] = float(base)
    if local_base is not None and float(local_base) != spec.get("rotary_base", 10000.0):
        spec["rotary_base_local"] = float(local_base)
    percent = cfg.number("partial_rotary_factor", cfg.number("rotary_pct"))
    percent = params.pop("partial_rotary_factor", percent)
    if percent is not None:
        spec["rotary_percent"] = float(percent)
    scaling = cfg.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise cfg.error(f"rope_scaling must be a mapping or null, got {scaling!r}")
    scaling = {**params, **(scaling or {})}
    scaling.pop(QUERY_SCALING, None)  # not the rotation's: read_ministral3's
    spelled = "rope_type" if scaling.get("rope_type") else "type"
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if cfg.model_type == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # transformers' Phi3Config reads its older 'su' and 'yarn' as longrope
    if kind == "default":
        return
    if kind not in _ROPE_SCALINGS:
        raise cfg.unsupported(f"rope scaling {kind!r} (rope_scaling.{spelled})")
    factor = scaling.pop("factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):  # its bounds: ModelSpec's
        raise cfg.error(f"rope_scaling.factor must be a number, got {factor!r}")
    spec["rope_scaling"] = kind
    if local_scaled is not None:
        spec["rope_scaling_local"] = local_scaled
    spec["rope_scaling_factor"] = float(factor)
    spec["rope_scaling_params"] = [[name, float(value)] for name, value in scaling.items()
                                   if isinstance(value, (int, float)) and not isinstance(value, bool)]


def read_sliding_window(cfg: Config, spec: dict[str, Any]) -> None:
    """The window and which layers slide: every layer, or all but every N-th (``layer_types``,
    Gemma's ``sliding_window_pattern``, Qwen's ``use_sliding_window`` / ``max_window_layers``)."""
    window = cfg.whole("sliding_window")
    if cfg.given("use_sliding_window") and not cfg.flag("use_sliding_window"):
        window = None
    cfg.read.add("sliding_window_size")  # Gemma 2's copy of sliding_window
    layers = spec["num_layers"]
    types = cfg.get("layer_types")
    pattern = cfg.whole("sliding_window_pattern", cfg.whole("_sliding_window_pattern"))
    first_global = cfg.whole("max_window_layers") if cfg.given("use_sliding_window") else None
    if types is not None:
        sliding = sliding_layer_types(cfg, types, layers)
    else:
        if pattern:
            sliding = [(i + 1) % pattern != 0 for i in range(layers)]
        elif first_global is not None:  # Qwen: the layers from max_window_layers on slide
            sliding = [i >= first_global for i in range(layers)]
        else:
            sliding = [True] * layers
    set_window(cfg, spec, window, sliding)


def sliding_layer_types(cfg: Config, types: Any, layers: int) -> list[bool]:
    """Which layers slide, from ``layer_types`` (sliding_attention or full_attention per layer)."""
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise cfg.error(f"layer_types must name {layers} layers as sliding_attention or full_attention, "
                        f"got {types!r}")
    return [kind == "sliding_attention" for kind in types]


def every_nth_off(flags: list[bool] | list[int]) -> int:
    """N when ``flags`` is off at every N-th layer (the N-th, 2N-th, ...) and on at the others, else 0."""
    return next((n for n in range(1, len(flags) + 1)
                 if all(bool(f) == ((i + 1) % n != 0) for i, f in enumerate(flags))), 0)


def set_window(cfg: Config, spec: dict[str, Any], window: int | None, sliding: list[bool]) -> None:
    """Sets the sliding window of the layers in ``sliding``: all of them, or all but every N-th (a
    window at least as long as a plan's sequence slides over nothing: ModelSpec.window_slides)."""
    if not window or not any(sliding):
        return
    spec["sliding_window"] = window
    if all(sliding):
        return
    every = every_nth_off(sliding)
    if not every:
        pattern = "".join("S" if s else "F" for s in sliding)
        raise cfg.unsupported(f"sliding-window layers (S) in a pattern other than all of them or all but every "
                              f"N-th (layer_types {pattern})")
    spec["global_attention_every"] = every


def read_exaone4(cfg: Config, spec: dict[str, Any]) -> None:
    """EXAONE 4.0's hybrid attention: sliding-window layers in the pattern ``sliding_window_pattern``
    (every N-th layer global, or a string such as ``LLLG``) or ``layer_types``; its global layers
    then attend without rotary positions (Exaone4Attention)."""
    layers = spec["num_layers"]
    # a null window is no window (not the config class's default)
    null_window = "sliding_window" in cfg.data and cfg.data["sliding_window"] is None
    window = None if null_window else cfg.whole("sliding_window")
    cfg.read.add("sliding_window")
    types, pattern = cfg.get("layer_types"), cfg.get("sliding_window_pattern")
    if types is not None:
        sliding = sliding_layer_types(cfg, types, layers)
    elif window is None:
        sliding = [False] * layers
    elif isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        sliding = [pattern[i % len(pattern)] == "L" for i in range(layers)]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    else:
        raise cfg.error(f"sliding_window_pattern must be a whole number or a string of L and G, got {pattern!r}")
    set_window(cfg, spec, window, sliding)
    if spec.get("global_attention_every"):
        spec["no_rope_every"] = spec["global_attention_every"]
    elif window and not all(sliding):
        spec["no_rope_every"] = 1  # every layer global: none rotates


def read_softcaps(cfg: Config, spec: dict[str, Any]) -> None:
    spec["attention_softcap"] = cfg.number("attn_logit_softcapping") or 0.0
    spec["final_logit_softcap"] = cfg.number("final_logit_softcapping") or 0.0


def read_query_scale(cfg: Config, spec: dict[str, Any]) -> None:
    """Gemma 2/3 scale queries by 1/sqrt(query_pre_attn_scalar); the head width is the usual."""
    scalar = cfg.number("query_pre_attn_scalar")
    head_dim = spec.get("attention_head_dim") or spec["hidden_size"] // spec["num_attention_heads"]
    if scalar is not None and scalar != head_dim:
        spec["attention_scale_dim"] = scalar


def read_bidirectional(cfg: Config, spec: dict[str, Any]) -> None:
    if cfg.get("use_bidirectional_attention"):
        raise cfg.unsupported("bidirectional attention (use_bidirectional_attention)")


def read_experts(*expert_keys: str, width: str | None = "moe_intermediate_size") -> Reader:
    """Routed experts: how many (the first of ``expert_keys`` given), the top-k (``num_experts_per_tok``,
    gpt-oss's ``experts_per_token`` too) and one expert's inner width (``width``; None: the MLP's)."""
    def read(cfg: Config, spec: dict[str, Any]) -> None:
        experts = next((cfg.whole(k) for k in expert_keys if cfg.given(k)), None)
        if experts is None:
            experts = next((cfg.whole(k) for k in expert_keys if cfg.get(k) is not None), None)
        if not experts:
            raise cfg.error(f"a {cfg.model_type} config must give its number of experts ({' or '.join(expert_keys)})")
        top_k = {key: cfg.whole(key) for key in ("num_experts_per_tok", "experts_per_token") if cfg.get(key) is not None}
        if not top_k or len(set(top_k.values())) > 1:
            raise cfg.error(f"a {cfg.model_type} config must give the experts per token once "
                            f"(num_experts_per_tok), got {top_k or 'none'}")
        spec["num_experts"], spec["moe_top_k"] = experts, next(iter(top_k.values()))
        if width is not None:
            spec["moe_ffn_hidden_size"] = cfg.whole(width)
    return read


def read_qwen_moe(cfg: Config, spec: dict[str, Any]) -> None:
    """Qwen-MoE's layer pattern (``decoder_sparse_step``, ``mlp_only_layers``) and Qwen2-MoE's gated
    shared expert."""
    step = cfg.whole("decoder_sparse_step", 1)
    if step != 1:  # Qwen counts (i + 1) % step, Megatron i % freq: only every layer is the same
        raise cfg.unsupported(f"an MoE layer every {step} layers (decoder_sparse_step={step})")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or sorted(dense) != list(range(len(dense))):
        raise cfg.unsupported(f"dense layers {dense!r} that are not the first ones (mlp_only_layers)")
    if dense:
        spec["moe_first_dense_layers"] = len(dense)
    shared = cfg.whole("shared_expert_intermediate_size") if cfg.model_type == "qwen2_moe" else 0
    if shared:
        spec["shared_expert_ffn_hidden_size"], spec["shared_expert_gate"] = shared, True


def read_deepseek(cfg: Config, spec: dict[str, Any]) -> None:
    """DeepSeek-V2/V3: latent attention, shared experts, the first dense layers, the router."""
    for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        spec[name] = cfg.whole(name) or 0  # q_lora_rank null: one query projection (V2-Lite)
    if not spec["kv_lora_rank"]:
        raise cfg.error("kv_lora_rank must be above 0 (DeepSeek's latent attention)")
    # transformers 5 writes head_dim (= qk_rope_head_dim) and qk_head_dim; latent attention's
    # widths are the five above
    cfg.read.update({"head_dim", "qk_head_dim"})
    spec.pop("attention_head_dim", None)
    spec["shared_expert_ffn_hidden_size"] = (cfg.whole("n_shared_experts") or 0) * spec["moe_ffn_hidden_size"]
    spec["moe_first_dense_layers"] = cfg.whole("first_k_dense_replace", 0)
    spec["moe_layer_freq"] = cfg.whole("moe_layer_freq", 1)
    scoring = cfg.get("scoring_func", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise cfg.unsupported(f"router scoring {scoring!r} (scoring_func)")
    spec["moe_router"] = scoring
    spec["num_kv_heads"] = 0  # latent attention: every head has its own keys and values


def add_unmodelled(spec: dict[str, Any], *what: str) -> None:
    """Adds clauses to what the model does that dsauto does not build (``ModelSpec.unmodelled``)."""
    spec["unmodelled"] = (*spec.get("unmodelled", ()), *what)


def read_mlp_layer_types(cfg: Config, spec: dict[str, Any]) -> None:
    """GLM-4.7-Flash's ``mlp_layer_types`` (dense or sparse per layer; Glm4MoeLiteConfig's default: the
    first dense, the rest sparse), read as the first dense layers and MoE layers after them, the
    pattern Megatron states; another is refused."""
    layers = spec["num_layers"]
    types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    dense = next((i for i, kind in enumerate(types) if kind != "dense"), len(types))
    if (not isinstance(types, list) or len(types) != layers or not set(types) <= {"dense", "sparse"}
            or any(kind != "sparse" for kind in types[dense:])):
        raise cfg.unsupported(f"MLP layer types {types!r} other than dense layers first, then sparse ones "
                              f"(mlp_layer_types)")
    spec["moe_first_dense_layers"] = dense


def read_ernie_moe(cfg: Config, spec: dict[str, Any]) -> None:
    """ERNIE 4.5's experts (transformers' Ernie4_5_MoeSparseMoeBlock): ``moe_num_experts`` routed, the
    top ``moe_k`` of softmax scores, ``moe_num_shared_experts`` shared ones of the expert width; the
    MoE layers from ``moe_layer_start_index`` to ``moe_layer_end_index`` (-1: the last) where
    ``(i + 1) % moe_layer_interval == 0`` (Ernie4_5_MoeDecoderLayer), the others dense. Its router
    chooses the experts from the scores plus a per-expert correction bias (``moe_statics``), which
    Megatron-core takes with sigmoid scores only: named as not built (the same work)."""
    experts, top_k, width = cfg.whole("moe_num_experts"), cfg.whole("moe_k"), cfg.whole("moe_intermediate_size")
    if not experts or not top_k or not width:
        raise cfg.error(f"an ernie4_5_moe config must give moe_num_experts, moe_k and moe_intermediate_size above "
                        f"0, got {experts}, {top_k} and {width}")
    layers, interval = spec["num_layers"], cfg.whole("moe_layer_interval", 1)
    start, end = cfg.whole("moe_layer_start_index", 0), cfg.whole("moe_layer_end_index", -1)
    if interval < 1 or not 0 <= start < layers:
        raise cfg.error(f"moe_layer_interval must be at least 1 and moe_layer_start_index a layer, got {interval} "
                        f"and {start}")
    if end not in (-1, layers - 1):
        raise cfg.unsupported(f"dense layers after the last MoE layer (moe_layer_end_index={end} of {layers} layers)")
    spec.update(num_experts=experts, moe_top_k=top_k, moe_ffn_hidden_size=width,
                shared_expert_ffn_hidden_size=cfg.whole("moe_num_shared_experts", 0) * width,
                moe_layer_freq=interval, moe_layer_phase=(interval - 1) % interval, moe_first_dense_layers=start)
    add_unmodelled(spec, "a per-expert correction bias added to the softmax scores that choose the experts "
                         "(moe_statics; Megatron-core's --moe-router-enable-expert-bias needs sigmoid scores)")


# --- readers of one family ---------------------------------------------------------------------------


def read_gpt2(cfg: Config, spec: dict[str, Any]) -> None:
    if spec.get("ffn_hidden_size") is None:
        spec["ffn_hidden_size"] = 4 * spec["hidden_size"]  # GPT2MLP: n_inner or 4 * n_embd


def read_falcon(cfg: Config, spec: dict[str, Any]) -> None:
    """Falcon: multi-query (7B) or grouped (new_decoder_architecture: 40B, 180B) attention,
    parallel attention with one or two norms, ALiBi or rotary positions."""
    new = cfg.flag("new_decoder_architecture")
    multi_query = cfg.flag("multi_query", True)  # read either way: the new architecture ignores it
    heads = spec["num_attention_heads"]
    kv = cfg.whole("num_kv_heads", cfg.whole("n_head_kv"))
    if new:
        kv = kv or heads
    elif multi_query:
        kv = 1
    else:
        kv = heads
    spec["num_kv_heads"] = 0 if kv == heads else kv
    if spec.get("ffn_hidden_size") is None:
        spec["ffn_hidden_size"] = 4 * spec["hidden_size"]
    parallel = cfg.flag("parallel_attn", True)
    norms = cfg.whole("num_ln_in_parallel_attn") or (2 if new else 1)
    spec["parallel_attention"] = parallel or new
    spec["norms_per_layer"] = norms if spec["parallel_attention"] else 2
    set_biases(spec, {"qkv", "proj", "mlp"} if cfg.flag("bias") else set())
    if cfg.flag("alibi"):
        spec["position_embedding"] = "alibi"


def read_bloom(cfg: Config, spec: dict[str, Any]) -> None:
    """BLOOM: ALiBi (no position limit; its training length caps sequences), a norm after the
    embedding, the MLP four times the width (BloomMLP ignores n_inner)."""
    spec["ffn_hidden_size"] = 4 * spec["hidden_size"]
    cfg.read.add("n_inner")
    spec["max_position_embeddings"] = cfg.whole("seq_length", 2048)
    spec["residual_post_norm"] = cfg.flag("apply_residual_connection_post_layernorm")


def read_gpt_neox(cfg: Config, spec: dict[str, Any]) -> None:
    attention = cfg.flag("attention_bias", True)
    set_biases(spec, {"mlp"} | ({"qkv", "proj"} if attention else set()))
    spec["parallel_attention"] = cfg.flag("use_parallel_residual", True)


def read_opt(cfg: Config, spec: dict[str, Any]) -> None:
    """OPT: learned positions with two rows of offset; post-norm layers (OPT-350m) have no final
    norm; a word-embedding width other than the hidden size needs projections dsauto lacks."""
    if cfg.whole("word_embed_proj_dim", spec["hidden_size"]) != spec["hidden_size"]:
        raise cfg.unsupported(f"word_embed_proj_dim {cfg.get('word_embed_proj_dim')} unlike hidden_size "
                              f"{spec['hidden_size']} (projections in and out of the embedding)")
    if not cfg.flag("do_layer_norm_before", True):
        spec["norm_position"] = "post"
    elif cfg.flag("_remove_final_layer_norm"):
        raise cfg.unsupported("no final layer norm (_remove_final_layer_norm)")
    if cfg.flag("enable_bias", True):
        set_biases(spec, {"qkv", "proj", "mlp"})
    else:
        set_biases(spec, set())
    spec["position_offset"] = 2  # OPTLearnedPositionalEmbedding's offset


def read_bert(cfg: Config, spec: dict[str, Any]) -> None:
    """BERT / RoBERTa: post-norm layers, token types, absolute positions; RoBERTa's position table
    starts after the padding index, so its config counts pad_token_id + 1 rows more."""
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise cfg.unsupported(f"position_embedding_type {cfg.get('position_embedding_type')!r}")
    spec["type_vocab_size"] = cfg.whole("type_vocab_size", 2)
    if cfg.model_type in ("roberta", "xlm-roberta"):
        offset = (cfg.whole("pad_token_id", 1) or 0) + 1
        spec["max_position_embeddings"] -= offset
        spec["position_offset"] = offset


def read_gemma(cfg: Config, spec: dict[str, Any]) -> None:
    """Gemma's fixed traits; transformers reads ``hidden_act: gelu`` as the tanh GeLU (Gemma's
    config class says so), and Gemma 2/3 name the activation ``hidden_activation``."""
    key = "hidden_activation" if cfg.model_type != "gemma" else "hidden_act"
    name = cfg.get(key)
    if name not in _GELU:
        raise cfg.error(f"{key} {name!r} is not a GeLU, which Gemma's MLP uses")
    spec["mlp"], spec["gelu_tanh"] = "geglu", True
    cfg.read.add("hidden_act")  # Gemma 2/3 carry both names; hidden_activation is the one used
    set_biases(spec, {"qkv", "proj"} if cfg.flag("attention_bias") else set())


def read_gemma3(cfg: Config, spec: dict[str, Any]) -> None:
    local = cfg.number("rope_local_base_freq")
    if local is not None and local != spec.get("rotary_base", 10000.0):
        spec["rotary_base_local"] = local


def read_qwen(cfg: Config, spec: dict[str, Any]) -> None:
    if cfg.get("use_mrope"):
        raise cfg.unsupported("multimodal rotary positions (use_mrope)")


def read_granite(cfg: Config, spec: dict[str, Any]) -> None:
    """Granite's multipliers: of the embeddings, of each branch before its residual add, of the
    attention scores (instead of 1/sqrt(head width)) and the divisor of the logits."""
    spec["embedding_multiplier"] = cfg.number("embedding_multiplier", 1.0)
    spec["residual_multiplier"] = cfg.number("residual_multiplier", 1.0)
    divisor = cfg.number("logits_scaling", 1.0)
    scale = cfg.number("attention_multiplier", 1.0)
    for key, value in (("embedding_multiplier", spec["embedding_multiplier"]),
                       ("residual_multiplier", spec["residual_multiplier"]), ("logits_scaling", divisor),
                       ("attention_multiplier", scale)):
        if value <= 0:
            raise cfg.error(f"{key} must be above 0, got {value!r}")
    spec["logit_scale"] = 1.0 / divisor
    head_dim = spec.get("attention_head_dim") or spec["hidden_size"] // spec["num_attention_heads"]
    if scale != head_dim ** -0.5:  # the scores are scaled by attention_multiplier = 1/sqrt(scale dim)
        spec["attention_scale_dim"] = scale ** -2


def read_granite_shared(cfg: Config, spec: dict[str, Any]) -> None:
    """GraniteMoeShared's shared expert (a gated MLP of ``shared_intermediate_size``, no gate scalar)."""
    spec["shared_expert_ffn_hidden_size"] = cfg.whole("shared_intermediate_size", 0)


def read_glm4_moe(cfg: Config, spec: dict[str, Any]) -> None:
    """GLM-4.5: DeepSeek-V3's experts (:func:`read_sigmoid_experts`) under grouped-query attention with
    optional per-head query/key norms."""
    read_sigmoid_experts(cfg, spec)
    spec["qk_norm"] = cfg.flag("use_qk_norm")


def read_sigmoid_experts(cfg: Config, spec: dict[str, Any]) -> None:
    """DeepSeek-V3's experts as GLM-4.5 and dots.llm1 spell them: ``n_shared_experts`` shared ones of
    the expert width, the first ``first_k_dense_replace`` layers dense, sigmoid routing with a
    load-balancing bias buffer."""
    spec["shared_expert_ffn_hidden_size"] = (cfg.whole("n_shared_experts") or 0) * spec["moe_ffn_hidden_size"]
    spec["moe_first_dense_layers"] = cfg.whole("first_k_dense_replace", 0)
    spec["moe_router"] = "sigmoid"


def read_dots1(cfg: Config, spec: dict[str, Any]) -> None:
    """dots.llm1: GLM-4.5's experts (:func:`read_sigmoid_experts`) under Qwen3's attention with per-head
    query/key norms, its sliding layers those from ``max_window_layers`` on where ``sliding_window`` is
    set (Dots1Config, without Qwen's ``use_sliding_window``), unless ``layer_types`` names them."""
    read_sigmoid_experts(cfg, spec)
    window, layers = cfg.whole("sliding_window"), spec["num_layers"]
    types = cfg.get("layer_types")
    first = cfg.whole("max_window_layers", layers)
    sliding = (sliding_layer_types(cfg, types, layers) if types is not None else
               [window is not None and i >= first for i in range(layers)])
    set_window(cfg, spec, window, sliding)


def read_ministral3(cfg: Config, spec: dict[str, Any]) -> None:
    """Ministral 3: Mistral's layers whose queries are scaled by 1 + beta log(1 + floor(position /
    original context)) in every layer (``rope_parameters.llama_4_scaling_beta``; transformers'
    Ministral3Attention), which Megatron-core does not build: named (an elementwise multiply); read_rope
    leaves it out of the YaRN parameters it sits beside."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = params.get(QUERY_SCALING, 0.0) if isinstance(params, Mapping) else 0.0
    if beta:
        add_unmodelled(spec, f"every layer's queries scaled by 1 + {beta:g} log(1 + floor(position / original "
                             f"context)) (llama_4_scaling_beta), an elementwise multiply")


def read_mtp(cfg: Config, spec: dict[str, Any]) -> None:
    """DeepSeek-V3's and GLM-4.5's multi-token-prediction layers (``num_nextn_predict_layers``), which
    Megatron-Bridge builds as Megatron-core's ``mtp_num_layers`` (deepseek_v3_bridge.py, glm45_bridge.py)
    and transformers does not build: priced for Megatron-core plans only (ModelSpec.mtp_layers)."""
    spec["mtp_layers"] = cfg.whole("num_nextn_predict_layers", 0) or 0


def read_cohere(cfg: Config, spec: dict[str, Any]) -> None:
    """Command R: the logits multiplied by ``logit_scale``; Command R+'s query/key LayerNorms hold one
    weight per head (``use_qk_norm``), which dsauto does not model."""
    scale = cfg.number("logit_scale", 0.0625)
    if scale is None or scale <= 0:
        raise cfg.error(f"logit_scale must be above 0, got {scale!r}")
    spec["logit_scale"] = scale
    if cfg.flag("use_qk_norm"):
        raise cfg.unsupported("query/key LayerNorms with a weight per head (use_qk_norm)")


def read_cohere2(cfg: Config, spec: dict[str, Any]) -> None:
    """Command R7B: three sliding layers of four, the fourth (global) one without rotary positions,
    and the head width fixed to hidden / heads (Cohere2Config)."""
    given, width = cfg.whole("head_dim"), spec["hidden_size"] // spec["num_attention_heads"]
    if given is not None and given != width:
        raise cfg.unsupported(f"head_dim {given}, which Cohere2Config replaces by hidden_size / "
                              f"num_attention_heads = {width}")
    if spec.get("global_attention_every"):
        spec["no_rope_every"] = spec["global_attention_every"]


def read_phi(cfg: Config, spec: dict[str, Any]) -> None:
    """Phi-1/1.5/2: per-head query/key LayerNorms when ``qk_layernorm`` is set."""
    spec["qk_norm"] = cfg.flag("qk_layernorm")


def read_minimax_m2(cfg: Config, spec: dict[str, Any]) -> None:
    """MiniMax-M2: the rotary width as ``rotary_dim`` (of the head's), every layer full attention
    (``attn_type_list`` 1; MiniMax-01's lightning-attention layers are 0)."""
    rotary = cfg.whole("rotary_dim")
    head_dim = spec.get("attention_head_dim") or spec["hidden_size"] // spec["num_attention_heads"]
    if rotary is not None:
        if not 0 < rotary <= head_dim:
            raise cfg.error(f"rotary_dim must be above 0 and at most the head width {head_dim}, got {rotary}")
        spec["rotary_percent"] = rotary / head_dim
    kinds = cfg.get("attn_type_list")
    if kinds is not None and (not isinstance(kinds, list) or set(kinds) != {1}):
        raise cfg.unsupported("layers other than full attention (attn_type_list other than all 1)")


def read_llama4(cfg: Config, spec: dict[str, Any]) -> None:
    """Llama 4's text model: a shared expert beside the routed ones (both of ``intermediate_size``;
    the dense layers' MLP is ``intermediate_size_mlp``), the MoE layers every
    ``interleave_moe_layer_step``-th (or ``moe_layers``), top-k sigmoid routing without a balancing
    bias whose weight scales the expert's input, and in the layers with rotary positions chunked
    attention (``attention_chunk_size``) and parameter-free query/key norms (``use_qk_norm``)."""
    spec["shared_expert_ffn_hidden_size"] = spec["moe_ffn_hidden_size"]
    # transformers' Llama4TextMoe repeats every token for every expert (models/llama4/modeling_llama4.py)
    spec.update(moe_router="sigmoid", moe_router_balancing_bias=False, moe_probs_on_input=True,
                transformers_dense_experts=True)
    layers = spec["num_layers"]
    step = cfg.whole("interleave_moe_layer_step", 1)
    if not step or step < 1:
        raise cfg.error(f"interleave_moe_layer_step must be at least 1, got {step!r}")
    moe = cfg.get("moe_layers")
    if moe is None:
        moe = list(range(step - 1, layers, step))
    if not isinstance(moe, list) or not moe or sorted(set(moe)) != moe or not set(moe) <= set(range(layers)):
        raise cfg.error(f"moe_layers must list layers between 0 and {layers - 1} in order, got {moe!r}")
    found = next(((first, freq, freq_phase) for freq in range(1, layers + 1) for freq_phase in range(freq)
                  for first in (0, moe[0])
                  if moe == [i for i in range(first, layers) if i % freq == freq_phase]), None)
    if found is None:
        raise cfg.unsupported(f"MoE layers {moe} that are not every N-th layer (moe_layers)")
    spec["moe_first_dense_layers"], spec["moe_layer_freq"], spec["moe_layer_phase"] = found
    spec["qk_l2_norm"] = cfg.flag("use_qk_norm", True)
    spec["attention_temperature_tuning"] = cfg.flag("attn_temperature_tuning", True)
    cfg.read.update({"floor_scale", "attn_scale"})  # the temperature's constants (numerics)
    chunk = cfg.whole("attention_chunk_size")
    rotating = [(i + 1) % spec["no_rope_every"] != 0 if spec.get("no_rope_every") else True for i in range(layers)]
    types = cfg.get("layer_types")
    if types is not None:
        chunked = [kind == "chunked_attention" for kind in types]
        if len(types) != layers or not set(types) <= {"chunked_attention", "full_attention"} or \
                chunked != [bool(chunk) and r for r in rotating]:
            raise cfg.unsupported(f"layer_types {types!r} other than chunked attention in the layers with "
                                  f"rotary positions")
    if chunk:
        spec["attention_chunk"] = chunk


def read_kv_channels(cfg: Config, spec: dict[str, Any]) -> None:
    """Older Nemotron configs give the head width as ``kv_channels`` (Megatron's name), which
    transformers does not read: it must be the width transformers uses."""
    given = cfg.whole("kv_channels")
    width = spec.get("attention_head_dim") or spec["hidden_size"] // spec["num_attention_heads"]
    if given is not None and given != width:
        raise cfg.unsupported(f"kv_channels {given}, which transformers ignores (its head width is {width}); "
                              f"give head_dim {given} instead")


def read_bigcode(cfg: Config, spec: dict[str, Any]) -> None:
    """GPTBigCode (StarCoder, SantaCoder): GPT-2 with multi-query attention (one key/value head)."""
    heads = spec["num_attention_heads"]
    kv = 1 if cfg.flag("multi_query", True) else heads
    given = cfg.whole("num_key_value_heads")  # transformers 5's to_dict() spells it out
    if given is not None and given != kv:
        raise cfg.error(f"num_key_value_heads {given} disagrees with multi_query ({kv} key/value heads)")
    spec["num_kv_heads"] = 0 if kv == heads else kv


def read_no_rope(cfg: Config, spec: dict[str, Any]) -> None:
    """SmolLM3's layers without rotary positions: ``no_rope_layers`` (1 rotates, 0 does not) or every
    ``no_rope_layer_interval``-th layer."""
    layers = spec["num_layers"]
    interval = cfg.whole("no_rope_layer_interval", 4)
    rotates = cfg.get("no_rope_layers")
    if rotates is None or rotates == []:  # an empty list is the config classes' default too (Llama 4's)
        rotates = [int((i + 1) % interval != 0) for i in range(layers)] if interval else [1] * layers
    if not isinstance(rotates, list) or len(rotates) != layers or not set(rotates) <= {0, 1}:
        raise cfg.error(f"no_rope_layers must give 1 (rotary) or 0 (none) for each of the {layers} layers, "
                        f"got {rotates!r}")
    if all(rotates):
        return
    every = every_nth_off(rotates)
    if not every:
        raise cfg.unsupported(f"layers without rotary positions that are not every N-th (no_rope_layers {rotates})")
    spec["no_rope_every"] = every
    if cfg.flag("use_sliding_window"):  # SmolLM3 then slides the NoPE layers only
        raise cfg.unsupported("sliding-window attention in its layers without rotary positions (use_sliding_window)")


# --- the families ------------------------------------------------------------------------------------

_SHAPE = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": ("hidden_size",),
    "num_attention_heads": ("num_attention_heads",),
    "ffn_hidden_size": ("intermediate_size",),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings",),
}
_LLAMA = {"architecture": "decoder", "mlp": "swiglu", "norm": "rmsnorm", "position_embedding": "rope",
          "linear_bias": False, "dropout": False}
_GPT = {"architecture": "decoder", "mlp": "gelu", "norm": "layernorm", "position_embedding": "learned"}
_ENCODER = {**_GPT, "architecture": "encoder", "norm_position": "post"}
_LLAMA_READERS: tuple[Reader, ...] = (read_kv_heads(), read_head_dim, read_tied, read_rope,
                                      read_norm_epsilon("rms_norm_eps"), read_dropout("attention_dropout"),
                                      read_activation("hidden_act", gated=True))
_LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                   "rope_theta": 10000.0}
_GEMMA_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "head_dim": 256,
                   "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                   "rope_theta": 10000.0}
_GEMMA_FIXED = {**_LLAMA, "mlp": "geglu", "norm_plus_one": True, "embedding_scale": True}
_GEMMA_READERS: tuple[Reader, ...] = (read_kv_heads(), read_head_dim, read_tied, read_rope,
                                      read_norm_epsilon("rms_norm_eps"), read_dropout("attention_dropout"),
                                      read_gemma, read_bidirectional)
_GRANITE_DEFAULTS = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
                     "attention_multiplier": 1.0}
_OLMO2 = {**_LLAMA, "qk_norm": True, "qk_norm_full_width": True, "norm_position": "output", "norm_weight_fp32": True}
# Gemma 3 and OLMo 3 give the sliding-window layers their own rotary embedding, which config.json's
# rope_scaling does not scale (their config classes put it in full_attention's parameters)
_GLOBAL_ONLY_SCALING = {"rope_scaling_local": False}
_GLM_DEFAULTS = {**_LLAMA_DEFAULTS, "rms_norm_eps": 1.5625e-07, "head_dim": 128, "attention_bias": True,
                 "partial_rotary_factor": 0.5}
# Command R: one bias-free LayerNorm feeding attention and MLP side by side (CohereDecoderLayer)
_COHERE = {**_LLAMA, "norm": "layernorm", "norm_bias": False, "parallel_attention": True, "norms_per_layer": 1,
           "rotary_interleaved": True, "layernorm_fp32": True}
_COHERE_DEFAULTS = {**_LLAMA_DEFAULTS, "layer_norm_eps": 1e-5, "tie_word_embeddings": True, "logit_scale": 0.0625}
_COHERE_READERS: tuple[Reader, ...] = (
    read_kv_heads(), read_tied, read_rope, read_norm_epsilon("layer_norm_eps"), read_dropout("attention_dropout"),
    read_activation("hidden_act", gated=True), read_biases(attention_bias=("qkv", "proj")))
_OLD_ROPE = frozenset({"pretraining_tp"})  # Llama's emulation of TP-sliced matmuls: numerics only
_COHERE_IGNORED = _OLD_ROPE | {"model_max_length"}  # the tokenizer's longest input

FAMILIES: dict[str, Family] = {
    "llama": Family(
        _SHAPE, _LLAMA, _LLAMA_DEFAULTS,
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj"), mlp_bias=("mlp",))),
        ignored=_OLD_ROPE),
    "mistral": Family(
        _SHAPE, _LLAMA, _LLAMA_DEFAULTS, (*_LLAMA_READERS, read_sliding_window)),
    "ministral3": Family(
        _SHAPE, _LLAMA, {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "head_dim": 128},
        (*_LLAMA_READERS, read_sliding_window, read_ministral3)),
    "qwen2": Family(
        _SHAPE, {**_LLAMA, "qkv_bias": True}, {**_LLAMA_DEFAULTS, "max_window_layers": 28},
        (*_LLAMA_READERS, read_sliding_window, read_qwen)),
    "qwen3": Family(
        _SHAPE, {**_LLAMA, "qk_norm": True}, {**_LLAMA_DEFAULTS, "head_dim": 128, "max_window_layers": 28},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj")), read_sliding_window)),
    "phi3": Family(
        _SHAPE, _LLAMA, {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj")), read_sliding_window,
         read_dropout("attention_dropout", "resid_pdrop", "embd_pdrop")),
        # original_max_position_embeddings is the base of longrope scaling, read with it
        ignored=frozenset({"original_max_position_embeddings"})),
    "gemma": Family(_SHAPE, _GEMMA_FIXED, _GEMMA_DEFAULTS, _GEMMA_READERS),
    "gemma2": Family(
        _SHAPE, {**_GEMMA_FIXED, "norms_per_layer": 4},
        {**_GEMMA_DEFAULTS, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
         "sliding_window": 4096, "sliding_window_pattern": 2, "query_pre_attn_scalar": 256},
        (*_GEMMA_READERS, read_sliding_window, read_softcaps, read_query_scale)),
    "gemma3_text": Family(
        _SHAPE, {**_GEMMA_FIXED, "norms_per_layer": 4, "qk_norm": True, **_GLOBAL_ONLY_SCALING},
        # Gemma3TextConfig's defaults, which the text_config inside a Gemma 3 config.json leaves out
        {**_GEMMA_DEFAULTS, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
         "sliding_window": 4096, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
         "vocab_size": 262_208, "max_position_embeddings": 131_072},
        (*_GEMMA_READERS, read_sliding_window, read_softcaps, read_query_scale, read_gemma3)),
    "falcon": Family(
        {**_SHAPE, "num_layers": ("num_hidden_layers", "n_layer"), "hidden_size": ("hidden_size", "n_embed"),
         "num_attention_heads": ("num_attention_heads", "n_head"), "ffn_hidden_size": ("ffn_hidden_size",)},
        {**_GPT, "position_embedding": "rope"},
        {"max_position_embeddings": 2048, "layer_norm_epsilon": 1e-5, "activation": "gelu",
         "tie_word_embeddings": True, "rope_theta": 10000.0},
        (read_tied, read_rope, read_norm_epsilon("layer_norm_epsilon"),
         read_dropout("hidden_dropout", "attention_dropout"), read_activation("activation", gated=False),
         read_falcon),
        expected={"apply_residual_connection_post_layernorm": (False, "the residual taken after the norm")},
        optional=frozenset({"ffn_hidden_size"})),
    "bloom": Family(
        {**_SHAPE, "num_layers": ("n_layer", "num_hidden_layers"), "hidden_size": ("hidden_size", "n_embed"),
         "num_attention_heads": ("n_head", "num_attention_heads"), "ffn_hidden_size": (),
         "max_position_embeddings": ()},
        {**_GPT, "position_embedding": "alibi", "embedding_norm": True, "gelu_tanh": True},
        {"layer_norm_epsilon": 1e-5, "tie_word_embeddings": True},
        (read_tied, read_norm_epsilon("layer_norm_epsilon"), read_dropout("hidden_dropout", "attention_dropout"),
         read_bloom),
        # Megatron-DeepSpeed's fusion and TP-emulation switches of the original training run
        ignored=frozenset({"masked_softmax_fusion", "offset_alibi", "skip_bias_add", "skip_bias_add_qkv",
                           "attention_softmax_in_fp32", "bias_dropout_fusion", "slow_but_exact",
                           "pretraining_tp"})),
    "gpt2": Family(
        {"num_layers": ("n_layer",), "hidden_size": ("n_embd",), "num_attention_heads": ("n_head",),
         "ffn_hidden_size": ("n_inner",), "vocab_size": ("vocab_size",), "max_position_embeddings": ("n_positions",)},
        _GPT,
        {"layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", "tie_word_embeddings": True,
         "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1},
        (read_gpt2, read_tied, read_norm_epsilon("layer_norm_epsilon"),
         read_dropout("resid_pdrop", "embd_pdrop", "attn_pdrop"),
         read_activation("activation_function", gated=False)),
        expected={"scale_attn_weights": (True, "unscaled attention scores (scale_attn_weights false)"),
                  "scale_attn_by_inverse_layer_idx": (False, "attention scaled by the layer index"),
                  "add_cross_attention": (False, "cross-attention")},
        # n_ctx is n_positions' old name; summary_* configure GPT2DoubleHeadsModel's classifier;
        # reorder_and_upcast_attn only computes the scores in fp32
        ignored=frozenset({"n_ctx", "summary_type", "summary_use_proj", "summary_activation",
                           "summary_proj_to_labels", "summary_first_dropout", "reorder_and_upcast_attn"}),
        optional=frozenset({"ffn_hidden_size"})),
    "gpt_neox": Family(
        _SHAPE, {**_GPT, "position_embedding": "rope"},
        {"layer_norm_eps": 1e-5, "hidden_act": "gelu", "tie_word_embeddings": False, "rotary_pct": 0.25,
         "rotary_emb_base": 10000.0},
        (read_tied, read_rope, read_norm_epsilon("layer_norm_eps"),
         read_dropout("hidden_dropout", "attention_dropout"), read_activation("hidden_act", gated=False),
         read_gpt_neox),
        # GPT-NeoX-20B's config.json carries its original training run's dropout names, which
        # transformers does not read (its keys are hidden_dropout and attention_dropout)
        ignored=frozenset({"classifier_dropout", "is_decoder", "attention_probs_dropout_prob",
                           "hidden_dropout_prob"})),
    "opt": Family(
        {**_SHAPE, "ffn_hidden_size": ("ffn_dim",)}, _GPT,
        {"activation_function": "relu", "tie_word_embeddings": True, "dropout": 0.1},
        (read_tied, read_dropout("dropout", "attention_dropout", "activation_dropout"),
         read_activation("activation_function", gated=False), read_opt),
        expected={"layerdrop": (0.0, "layers dropped at random in training (layerdrop)"),
                  "layer_norm_elementwise_affine": (True, "norms without weights")}),
    "bert": Family(
        _SHAPE, _ENCODER,
        {"layer_norm_eps": 1e-12, "hidden_act": "gelu", "tie_word_embeddings": True,
         "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1},
        (read_tied, read_norm_epsilon("layer_norm_eps"),
         read_dropout("hidden_dropout_prob", "attention_probs_dropout_prob"),
         read_activation("hidden_act", gated=False), read_bert),
        expected={"is_decoder": (False, "a causal decoder head (is_decoder)"),
                  "add_cross_attention": (False, "cross-attention")}),
    "granite": Family(
        _SHAPE, _LLAMA, {**_LLAMA_DEFAULTS, **_GRANITE_DEFAULTS},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj"), mlp_bias=("mlp",)), read_granite)),
    "olmo2": Family(
        _SHAPE, _OLMO2, {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj")))),
    "olmo3": Family(
        _SHAPE, {**_OLMO2, **_GLOBAL_ONLY_SCALING},
        {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
                         "sliding_window": 4096, "sliding_window_pattern": 4},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj")), read_sliding_window)),
    "smollm3": Family(
        _SHAPE, _LLAMA, {**_LLAMA_DEFAULTS, "tie_word_embeddings": True, "rope_theta": 2_000_000.0,
                         "no_rope_layer_interval": 4},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj"), mlp_bias=("mlp",)), read_no_rope,
         read_sliding_window),
        ignored=_OLD_ROPE),
    # GLM-4 and ERNIE 4.5 rotate adjacent pairs (their rotate_half takes x[..., 0::2], x[..., 1::2])
    "glm": Family(
        _SHAPE, {**_LLAMA, "rotary_interleaved": True}, _GLM_DEFAULTS,
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv",)))),
    "glm4": Family(
        _SHAPE, {**_LLAMA, "norms_per_layer": 4, "rotary_interleaved": True}, _GLM_DEFAULTS,
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv",)))),
    "nemotron": Family(
        _SHAPE, {**_LLAMA, "mlp": "relu2", "norm": "layernorm", "norm_plus_one": True},
        {"norm_eps": 1e-5, "hidden_act": "relu2", "tie_word_embeddings": False, "rope_theta": 10000.0,
         "partial_rotary_factor": 0.5},
        (read_kv_heads(), read_head_dim, read_tied, read_rope, read_norm_epsilon("norm_eps"),
         read_dropout("attention_dropout"), read_activation("hidden_act", gated=False),
         read_biases(attention_bias=("qkv", "proj"), mlp_bias=("mlp",)), read_kv_channels)),
    "cohere": Family(
        _SHAPE, _COHERE, {**_COHERE_DEFAULTS, "rope_theta": 500_000.0},
        (*_COHERE_READERS, read_cohere), ignored=_COHERE_IGNORED),
    "cohere2": Family(
        _SHAPE, _COHERE, {**_COHERE_DEFAULTS, "sliding_window": 4096, "sliding_window_pattern": 4},
        (*_COHERE_READERS, read_sliding_window, read_cohere, read_cohere2),
        # Cohere's own names, in Command R7B's config.json, of the architecture transformers builds
        expected={"use_gated_activation": (True, "an ungated MLP (use_gated_activation false)"),
                  "use_parallel_block": (True, "attention and MLP one after the other (use_parallel_block false)"),
                  "order_of_interleaved_layers": ("local_attn_first", "another order of sliding and global layers"),
                  "position_embedding_type": ("rope_gptj", "another position embedding")},
        ignored=_COHERE_IGNORED | {"layer_switch", "use_embedding_sharing", "use_parallel_embedding"}),
    "phi": Family(
        _SHAPE, {**_GPT, "position_embedding": "rope", "parallel_attention": True, "norms_per_layer": 1,
                 "head_bias": True, "linear_bias": True},
        {"layer_norm_eps": 1e-5, "hidden_act": "gelu_new", "tie_word_embeddings": False, "rope_theta": 10000.0,
         "partial_rotary_factor": 0.5},
        (read_kv_heads(), read_tied, read_rope, read_norm_epsilon("layer_norm_eps"),
         read_dropout("attention_dropout", "resid_pdrop", "embd_pdrop"), read_activation("hidden_act", gated=False),
         read_phi)),
    "arcee": Family(
        _SHAPE, {**_LLAMA, "mlp": "relu2"}, {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "hidden_act": "relu2"},
        (read_kv_heads(), read_head_dim, read_tied, read_rope, read_norm_epsilon("rms_norm_eps"),
         read_dropout("attention_dropout"), read_activation("hidden_act", gated=False),
         read_biases(attention_bias=("qkv", "proj"), mlp_bias=("mlp",))),
        ignored=_OLD_ROPE),
    "seed_oss": Family(
        _SHAPE, _LLAMA,
        {**_LLAMA_DEFAULTS, "head_dim": 128, "attention_bias": True, "attention_out_bias": False,
         "attention_dropout": 0.1, "residual_dropout": 0.1},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv",), attention_out_bias=("proj",), mlp_bias=("mlp",)),
         read_dropout("attention_dropout", "residual_dropout")),
        ignored=_OLD_ROPE),
    "ernie4_5": Family(
        _SHAPE, {**_LLAMA, "rotary_interleaved": True},
        {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0, "tie_word_embeddings": True, "head_dim": 128},
        (*_LLAMA_READERS, read_biases(use_bias=("qkv", "proj", "mlp")))),
    "exaone4": Family(
        _SHAPE, {**_LLAMA, "qk_norm": True, "norm_position": "output"},
        {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "sliding_window": 4096, "sliding_window_pattern": 4},
        (*_LLAMA_READERS, read_exaone4)),
    "starcoder2": Family(
        _SHAPE, {**_GPT, "position_embedding": "rope"},
        {"norm_epsilon": 1e-5, "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True,
         "rope_theta": 10000.0, "use_bias": True},
        (read_kv_heads(), read_tied, read_rope, read_norm_epsilon("norm_epsilon"),
         read_dropout("attention_dropout", "residual_dropout", "embedding_dropout"),
         read_activation("hidden_act", gated=False), read_biases(use_bias=("qkv", "proj", "mlp")),
         read_sliding_window),
        # the original training code's names of the architecture transformers builds
        expected={"mlp_type": ("default", "another MLP"),
                  "norm_type": ("layer_norm", "another norm")}),
    "gpt_bigcode": Family(
        {"num_layers": ("n_layer",), "hidden_size": ("n_embd",), "num_attention_heads": ("n_head",),
         "ffn_hidden_size": ("n_inner",), "vocab_size": ("vocab_size",), "max_position_embeddings": ("n_positions",)},
        {**_GPT, "linear_bias": True},
        {"layer_norm_epsilon": 1e-5, "activation_function": "gelu_pytorch_tanh", "tie_word_embeddings": True,
         "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "multi_query": True},
        (read_gpt2, read_tied, read_norm_epsilon("layer_norm_epsilon"),
         read_dropout("resid_pdrop", "embd_pdrop", "attn_pdrop"),
         read_activation("activation_function", gated=False), read_bigcode),
        expected={"scale_attn_weights": (True, "unscaled attention scores (scale_attn_weights false)"),
                  "add_cross_attention": (False, "cross-attention")},
        # where the scores' softmax runs in fp32 (numerics), n_positions' old name, and the original
        # inference server's settings (StarCoder's config.json)
        ignored=frozenset({"attention_softmax_in_fp32", "scale_attention_softmax_in_fp32", "n_ctx",
                           "inference_runner", "max_batch_size", "max_sequence_length", "pad_key_length",
                           "pre_allocate_kv_cache", "validate_runner_input", "runner_max_sequence_length",
                           "summary_type",
                           "summary_use_proj", "summary_activation", "summary_proj_to_labels",
                           "summary_first_dropout"}),
        optional=frozenset({"ffn_hidden_size"})),
}
FAMILIES["roberta"] = FAMILIES["bert"]

# Mixtures of experts. Keys that only set the router's training (its auxiliary loss, jitter, the
# normalisation and scaling of the top-k weights, DeepSeek's group-limited routing) change neither
# the parameters nor the priced work: ignored as keys, and named where Megatron-core's flags would
# build them otherwise (read_router). The storage format of a released checkpoint
# (``quantization_config``) is named for every family (model_from_hf_config).
_ROUTER_TRAINING = frozenset({"router_aux_loss_coef", "output_router_logits", "router_jitter_noise",
                              "norm_topk_prob"})
_DEEPSEEK_IGNORED = _ROUTER_TRAINING | {
    "routed_scaling_factor", "topk_method", "n_group", "topk_group", "aux_loss_alpha", "seq_aux",
    "ep_size",  # the original code's inference-time expert parallelism
    "rope_interleave", "pretraining_tp",  # numerics of the rotary embedding and of the matmuls
}
_DEEPSEEK_DEFAULTS = {**_LLAMA_DEFAULTS, "first_k_dense_replace": 0, "moe_layer_freq": 1, "n_shared_experts": None,
                      "num_experts_per_tok": None, "scoring_func": "softmax"}
_DEEPSEEK_EXPECTED = {"attention_bias": (False, "biases on the attention's projections"),
                      "mlp_bias": (False, "biases on the MLP")}
FAMILIES.update({
    "mixtral": Family(
        _SHAPE, _LLAMA, {**_LLAMA_DEFAULTS, "num_local_experts": 8, "num_experts_per_tok": 2},
        (*_LLAMA_READERS, read_sliding_window, read_experts("num_local_experts", width=None)),
        ignored=_ROUTER_TRAINING),
    "qwen2_moe": Family(
        _SHAPE, {**_LLAMA, "qkv_bias": True},
        {**_LLAMA_DEFAULTS, "max_window_layers": 28, "num_experts": 60, "num_experts_per_tok": 4,
         "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "norm_topk_prob": False},
        (*_LLAMA_READERS, read_sliding_window, read_qwen, read_experts("num_experts", "num_local_experts"),
         read_qwen_moe),
        expected={"qkv_bias": (True, "no biases on Q, K and V")}, ignored=_ROUTER_TRAINING),
    "qwen3_moe": Family(
        _SHAPE, {**_LLAMA, "qk_norm": True},
        # no head_dim: Qwen3MoeConfig has none, and its attention takes hidden / heads (transformers 5.24)
        {**_LLAMA_DEFAULTS, "max_window_layers": 28, "num_experts": 128,
         "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj")), read_sliding_window,
         read_experts("num_experts", "num_local_experts"), read_qwen_moe),
        ignored=_ROUTER_TRAINING),
    "olmoe": Family(
        _SHAPE, {**_LLAMA, "qk_norm": True, "qk_norm_full_width": True},
        {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj")),
         read_experts("num_experts", "num_local_experts", width=None)),
        expected={"clip_qkv": (None, "queries, keys and values clipped (clip_qkv)")}, ignored=_ROUTER_TRAINING),
    "deepseek_v2": Family(
        _SHAPE, _LLAMA, {**_DEEPSEEK_DEFAULTS, "n_routed_experts": 64, "norm_topk_prob": False,
                         "routed_scaling_factor": 1.0, "topk_method": "greedy"},
        (*_LLAMA_READERS, read_experts("n_routed_experts", "num_local_experts", "num_experts"), read_deepseek,
         read_mtp),
        expected=_DEEPSEEK_EXPECTED, ignored=_DEEPSEEK_IGNORED),
    "deepseek_v3": Family(
        _SHAPE, _LLAMA, {**_DEEPSEEK_DEFAULTS, "n_routed_experts": 256, "scoring_func": "sigmoid",
                         "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4},
        (*_LLAMA_READERS, read_experts("n_routed_experts", "num_local_experts", "num_experts"), read_deepseek,
         read_mtp),
        expected=_DEEPSEEK_EXPECTED, ignored=_DEEPSEEK_IGNORED),
    "gpt_oss": Family(
        _SHAPE, {**_LLAMA, "attention_sinks": True, "moe_router_bias": True, "moe_expert_bias": True,
                 "norm_weight_fp32": True},
        {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "num_local_experts": 128, "num_experts_per_tok": 4,
         "attention_bias": True},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj")), read_sliding_window,
         read_experts("num_local_experts", "num_experts", width=None)),
        # the original pre-training context (the clamped gate's swiglu_limit and swiglu_alpha: read_router)
        ignored=_ROUTER_TRAINING | {"initial_context_length"}),
    "minimax_m2": Family(
        _SHAPE, {**_LLAMA, "qk_norm": True, "qk_norm_full_width": True, "moe_router": "sigmoid"},
        {**_LLAMA_DEFAULTS, "head_dim": 128, "num_local_experts": 256, "num_experts_per_tok": 8,
         "rope_theta": 5_000_000.0},
        (*_LLAMA_READERS, read_experts("num_local_experts", "num_experts", width=None), read_minimax_m2),
        # what transformers' MiniMaxM2 always builds, in the names of MiniMax's own config.json
        expected={"use_qk_norm": (True, "no query/key norms (use_qk_norm false)"),
                  "qk_norm_type": ("per_layer", "query/key norms per head"),
                  "scoring_func": ("sigmoid", "another router (scoring_func)"),
                  "use_routing_bias": (True, "a router without its balancing bias (use_routing_bias false)"),
                  "shared_intermediate_size": (0, "a shared expert (shared_intermediate_size)"),
                  "attention_bias": (False, "biases on the attention's projections")},
        # the multi-token-prediction modules, which transformers does not build either (the plan is
        # for the main model)
        ignored=_ROUTER_TRAINING | {"use_mtp", "num_mtp_modules", "mtp_transformer_layers"}),
    "llama4_text": Family(
        {**_SHAPE, "ffn_hidden_size": ("intermediate_size_mlp",)}, _LLAMA,
        {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0, "head_dim": 128, "num_local_experts": 16,
         "num_experts_per_tok": 1,
         "intermediate_size_mlp": 16384, "no_rope_layer_interval": 4, "attention_chunk_size": 8192},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj")),
         read_experts("num_local_experts", "num_experts", width="intermediate_size"), read_no_rope, read_llama4),
        # an export switch of Meta's checkpoints (how the experts' weights are laid out)
        ignored=_ROUTER_TRAINING | {"for_llm_compressor"}),
    "glm4_moe": Family(
        _SHAPE, _LLAMA,
        {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5, "n_routed_experts": 128,
         "num_experts_per_tok": 8, "moe_intermediate_size": 1408, "n_shared_experts": 1,
         "first_k_dense_replace": 1, "use_qk_norm": False},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv",)),
         read_experts("n_routed_experts", "num_local_experts", "num_experts"), read_glm4_moe, read_mtp),
        # DeepSeek's group-limited routing and scaling
        ignored=_ROUTER_TRAINING | {"routed_scaling_factor", "n_group", "topk_group", "pretraining_tp"}),
    "granitemoe": Family(
        _SHAPE, _LLAMA, {**_LLAMA_DEFAULTS, **_GRANITE_DEFAULTS, "num_local_experts": 8, "num_experts_per_tok": 2},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj")), read_granite,
         read_experts("num_local_experts", "num_experts", width=None)),
        ignored=_ROUTER_TRAINING),
    "granitemoeshared": Family(
        _SHAPE, _LLAMA,
        {**_LLAMA_DEFAULTS, **_GRANITE_DEFAULTS, "num_local_experts": 8, "num_experts_per_tok": 2,
         "shared_intermediate_size": 0},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj")), read_granite,
         read_experts("num_local_experts", "num_experts", width=None), read_granite_shared),
        ignored=_ROUTER_TRAINING),
    "dots1": Family(
        _SHAPE, {**_LLAMA, "qk_norm": True},
        {**_LLAMA_DEFAULTS, "first_k_dense_replace": 0, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
         "n_group": 1, "topk_group": 1, "max_window_layers": 62, "sliding_window": 4096},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj")),
         read_experts("n_routed_experts", "num_local_experts"), read_dots1),
        ignored=_ROUTER_TRAINING),
    # GLM-4.7-Flash: DeepSeek-V3's latent attention and sigmoid-routed experts, its dense layers named by
    # mlp_layer_types (transformers' Glm4MoeLiteDecoderLayer)
    "glm4_moe_lite": Family(
        _SHAPE, _LLAMA, {**_DEEPSEEK_DEFAULTS, "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 4,
                         "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 1.8,
                         "n_group": 1, "topk_group": 1, "moe_intermediate_size": 1536},
        (*_LLAMA_READERS, read_experts("n_routed_experts", "num_local_experts", "num_experts"), read_deepseek,
         read_mtp, read_mlp_layer_types),
        expected=_DEEPSEEK_EXPECTED, ignored=_DEEPSEEK_IGNORED),
    "ernie4_5_moe": Family(
        _SHAPE, {**_LLAMA, "rotary_interleaved": True},
        {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0, "tie_word_embeddings": True,
         "moe_num_experts": 64, "moe_k": 6, "moe_intermediate_size": 1536, "moe_num_shared_experts": 2,
         "moe_layer_start_index": 1, "moe_layer_end_index": -1, "moe_layer_interval": 1},
        (*_LLAMA_READERS, read_ernie_moe),
        # the experts carry no biases where use_bias gives the rest theirs (Ernie4_5_MoeExperts)
        expected={"use_bias": (False, "biases on the attention and dense MLPs beside bias-free experts (use_bias)")},
        ignored=_ROUTER_TRAINING | {"moe_norm_min"}),
    # Granite 4.0's hybrid family with attention alone in every layer and no routed experts (Granite 4.0
    # micro): each layer's MLP is its shared MLP of shared_intermediate_size (transformers'
    # GraniteMoeHybridDecoderLayer builds block_sparse_moe only with num_local_experts > 0); Mamba layers
    # and routed experts are refused (refuse_unplannable, expected).
    "granitemoehybrid": Family(
        {**_SHAPE, "ffn_hidden_size": ("shared_intermediate_size",)}, _LLAMA,
        {**_LLAMA_DEFAULTS, **_GRANITE_DEFAULTS, "num_local_experts": 0, "position_embedding_type": "nope"},
        (*_LLAMA_READERS, read_biases(attention_bias=("qkv", "proj")), read_granite),
        expected={"num_local_experts": (0, "routed experts beside the shared MLP (num_local_experts)"),
                  "position_embedding_type": ("rope", "attention without position embeddings")},
        ignored=_ROUTER_TRAINING | {"layer_types", "intermediate_size", "normalization_function", "init_method",
                                    "num_experts_per_tok", "mamba_chunk_size", "mamba_conv_bias", "mamba_d_conv",
                                    "mamba_d_head", "mamba_d_state", "mamba_expand", "mamba_n_groups",
                                    "mamba_n_heads", "mamba_proj_bias"}),
})
TRANSFORMERS_HEADS: dict[str, tuple[int, int | None]] = {
    "llama": (32, None), "mistral": (32, 8), "qwen2": (32, 32), "qwen3": (32, 32), "phi3": (32, None),
    "gemma": (16, 16), "gemma2": (8, 4), "gemma3_text": (8, 4), "granite": (32, None), "olmo2": (32, None),
    "olmo3": (32, None), "smollm3": (16, 4), "glm": (32, 2), "glm4": (32, 2), "nemotron": (48, None),
    "cohere": (64, None), "cohere2": (64, None), "arcee": (32, None), "seed_oss": (80, 8), "ernie4_5": (16, 2),
    "exaone4": (32, 32), "starcoder2": (24, 2), "mixtral": (32, 8), "qwen2_moe": (16, 16), "qwen3_moe": (32, 4),
    "olmoe": (16, None), "deepseek_v2": (32, None), "deepseek_v3": (128, 128), "gpt_oss": (64, 8),
    "minimax_m2": (48, 8), "llama4_text": (40, 8), "glm4_moe": (96, 8), "granitemoe": (32, None),
    "granitemoeshared": (32, None), "granitemoehybrid": (32, None), "phi": (32, None), "ernie4_5_moe": (20, 4),
    "dots1": (32, None), "ministral3": (32, 8), "glm4_moe_lite": (20, 20),
}
"""Each family's config-class defaults of ``num_attention_heads`` and ``num_key_value_heads``
(transformers 5.24's configuration_<family>.py; None: as many key/value heads as attention heads),
which a config that leaves them out takes, as transformers builds it: a Mistral config without
``num_key_value_heads`` has 8, not one a head."""
for _type, (_heads, _kv_heads) in TRANSFORMERS_HEADS.items():
    _family = FAMILIES[_type]
    _defaults = {"num_attention_heads": _heads, **({"num_key_value_heads": _kv_heads} if _kv_heads else {})}
    FAMILIES[_type] = replace(_family, defaults={**_defaults, **_family.defaults})
# Kimi K2's config.json names its own model_type; its auto_map builds DeepSeek-V3's config and model
FAMILIES["kimi_k2"] = FAMILIES["deepseek_v3"]
MOE_FAMILIES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss",
                          "glm4_moe", "granitemoe", "granitemoeshared", "minimax_m2", "llama4_text", "kimi_k2",
                          "ernie4_5_moe", "dots1", "glm4_moe_lite"})
"""The families read as mixtures of experts."""

ENCODER_DECODER = "encoder-decoder models (t5, bart, ...) are not supported yet: dsauto plans decoder-only " \
                  "(causal LM) and encoder-only (masked LM) stacks"


def model_from_hf_config(config: Mapping[str, Any], where: str, default_name: str = "hf-model") -> ModelSpec:
    """Builds a ModelSpec from a Hugging Face config (the mapping in its ``config.json``, or a config
    object's ``to_dict()``); ``where`` names the source in messages, ``default_name`` is the name
    when the config has no ``_name_or_path``.

    Raises DsautoError for a family dsauto cannot read (naming the ones it can), a mixture of experts,
    an encoder-decoder or multimodal model, a missing or malformed shape key, or a value of an
    architecture dsauto does not model; warns (DsautoWarning) about keys it does not know.
    """
    model_type = config.get("model_type")
    refuse_unplannable(config, where)
    family = FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        raise DsautoError(
            f"{where} is a Hugging Face config of model_type {model_type!r}, which dsauto cannot "
            f"read; use one of model_type {', '.join(sorted(FAMILIES))}, or write a dsauto model "
            f"YAML (see the presets in templates/models)."
        )
    cfg = Config(config, where, str(model_type), family.defaults)
    spec: dict[str, Any] = {"name": config.get("_name_or_path") or default_name, **family.fixed}
    for name, keys in family.keys.items():
        # The first key the config gives, else the first with a config-class default.
        key = next((k for k in keys if cfg.given(k)), next((k for k in keys if k in family.defaults), None))
        if key is not None:
            spec[name] = cfg.whole(key)
        elif keys and name not in family.optional:
            raise DsautoError(f"{where} has no {keys[0]!r}; a Hugging Face {model_type} config must give it.")
    for read in family.readers:
        read(cfg, spec)
    if unmodelled := read_router(cfg, spec):
        add_unmodelled(spec, *unmodelled)
    for key, (modelled, meaning) in family.expected.items():
        value = cfg.get(key, modelled)
        if value != modelled:
            raise cfg.unsupported(f"{meaning} ({key}={value!r})")
    quantized = config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "a quantized format") if isinstance(quantized, Mapping) else quantized
        warnings.warn(f"{where}: its checkpoint is stored in {method} (quantization_config); dsauto plans training in "
                      f"the plan's dtype, the weights loaded at that precision, not {method} training or "
                      f"quantization-aware fine-tuning.", DsautoWarning, stacklevel=3)
    unknown = sorted(set(map(str, config)) - cfg.read - GENERIC_KEYS - family.ignored - set(family.expected)
                     - {"quantization_config"})
    if unknown and model_type in MOE_FAMILIES:
        # A mixture of experts has many ways to place and size its experts; a key dsauto does not
        # read could make it another model of another size, so it is refused rather than warned of.
        raise DsautoError(f"{where}: dsauto does not know the {model_type} config key(s) {', '.join(unknown)}, "
                          f"which may change the experts or their layers; remove them if they do not, or "
                          f"write a dsauto model YAML.")
    if unknown:
        warnings.warn(f"{where}: dsauto does not know the {model_type} config key(s) {', '.join(unknown)} "
                      f"and plans without them; if they change the architecture, the plan does not "
                      f"include that.", DsautoWarning, stacklevel=3)
    left_out = [f"{key}={config[key]!r}" for key in UNPLANNED_MODULE_KEYS if config.get(key)]
    if left_out:
        warnings.warn(f"{where}: its multi-token-prediction modules ({', '.join(left_out)}) are not planned: "
                      f"transformers does not build them, and Megatron-core's --mtp-num-layers builds one layer a "
                      f"depth, not these; the plan, its memory and its time are the main model's.",
                      DsautoWarning, stacklevel=3)
    try:
        return from_dict(ModelSpec, spec, where)
    except DsautoError as error:  # in the config's own words: its keys, not dsauto's field names
        used = {name: next((k for k in keys if cfg.given(k)), keys[0]) for name, keys in family.keys.items() if keys}
        used.update({name: next((k for k in keys if k in config), keys[0]) for name, keys in CONFIG_KEYS.items()})
        raise DsautoError(in_own_words(str(error), used)) from None


CONFIG_KEYS = {
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"),
    "attention_head_dim": ("head_dim", "kv_channels"),
    "moe_top_k": ("num_experts_per_tok", "experts_per_token", "moe_topk"),
    "num_experts": ("num_local_experts", "n_routed_experts", "num_experts"),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "tied_embeddings": ("tie_word_embeddings",),
    "glu_clamp": ("swiglu_limit",),
    "mtp_layers": ("num_nextn_predict_layers",),
    "rotary_base": ("rope_theta", "rotary_emb_base"),
    "rope_scaling_factor": ("rope_scaling.factor",),
    "rotary_percent": ("partial_rotary_factor", "rotary_pct"),
    "norm_epsilon": ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"),
}
"""The Hugging Face config keys of ModelSpec fields its readers set (besides each family's shape keys),
for errors in the config's words: the first the config gives, else the first."""


def read_router(cfg: Config, spec: dict[str, Any]) -> list[str]:
    """How a mixture of experts' router weighs and limits the experts, given or its config class's
    defaults (the same parameters and priced work either way): into the ModelSpec fields Megatron-core
    builds (``moe_router_pre_softmax``, ``moe_router_topk_scaling``, ``moe_router_groups`` and
    ``moe_router_group_topk``), and as the clauses of what it does not build (ModelSpec.unmodelled),
    which are returned; gpt-oss's clamped gate is read into ``glu_clamp``."""
    out = []
    if spec.get("num_experts"):
        scale = cfg.get("routed_scaling_factor")
        if isinstance(scale, (int, float)) and scale != 1:
            spec["moe_router_topk_scaling"] = float(scale)
        groups, top = cfg.get("n_group"), cfg.get("topk_group")
        if isinstance(groups, int) and groups > 1 and isinstance(top, int):
            if cfg.get("topk_method") == "group_limited_greedy":  # DeepSeek-V2: a group's best expert ranks it
                out.append(f"each token routed within the best {top} of {groups} expert groups by each group's best "
                           f"expert (topk_method group_limited_greedy; Megatron's --moe-router-num-groups ranks "
                           f"groups by the sum of their best experts)")
            else:
                spec.update(moe_router_groups=groups, moe_router_group_topk=top)
        if cfg.get("norm_topk_prob") is False:
            if spec.get("moe_router", "softmax") == "softmax":
                spec["moe_router_pre_softmax"] = True
            else:
                out.append("the chosen experts' sigmoid scores not renormalised (norm_topk_prob false; Megatron's "
                           "sigmoid router renormalises them)")
    limit, alpha = cfg.number("swiglu_limit"), cfg.number("swiglu_alpha", QUICK_GELU_ALPHA)
    if limit is not None:
        # gpt-oss's MLP: Megatron-LM's --quick-geglu (x sigmoid(1.702 x)) with --glu-linear-offset 1 and
        # --activation-func-clamp-value (megatron/core/fusions/fused_bias_geglu.py)
        spec["glu_clamp"] = float(limit)
        if alpha != QUICK_GELU_ALPHA:
            out.append(f"the MLP's gate x sigmoid({alpha:g} x) (swiglu_alpha); Megatron's --quick-geglu computes "
                       f"x sigmoid({QUICK_GELU_ALPHA:g} x), the same cost")
    return out


QUICK_GELU_ALPHA = 1.702
"""The slope of Megatron-core's quick GeLU, ``x sigmoid(1.702 x)`` (megatron/core/fusions/
fused_bias_geglu.py, ``quick_gelu``), which gpt-oss's gate computes (its ``swiglu_alpha``)."""


UNPLANNED_MODULE_KEYS = ("num_mtp_modules", "use_mtp")
"""Config keys (each family ignores them) that add multi-token-prediction modules beside the model
(MiniMax-M2's, of several layers each), which transformers does not build and dsauto does not plan:
named in a warning where set. DeepSeek-V3's and GLM-4.5's are read (:func:`read_mtp`)."""


NOT_ATTENTION_ONLY = {
    **dict.fromkeys(("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
                    "Gated DeltaNet linear-attention layers"),
    **dict.fromkeys(("mamba", "mamba2", "jamba", "bamba", "zamba", "zamba2", "falcon_h1", "nemotron_h",
                     "granitemoehybrid"), "Mamba state-space layers"),
    "minimax": "lightning (linear) attention layers",
    "kimi_linear": "Kimi Delta Attention (linear-attention) layers",
    "lfm2": "short convolution layers",
    "lfm2_moe": "short convolution layers",
    "rwkv": "RWKV recurrent layers",
    "recurrent_gemma": "recurrent (RG-LRU) layers",
    "deepseek_v32": "DeepSeek Sparse Attention (a lightning indexer choosing each query's keys)",
}
"""Families whose layers are not all softmax attention and an MLP, and what they have instead."""


def refuse_unplannable(config: Mapping[str, Any], where: str) -> None:
    """Refuses models with layers other than attention, mixtures of experts dsauto does not read,
    encoder-decoder and multimodal configs with one sentence."""
    model_type = config.get("model_type")
    layers = config.get("layer_types")
    attention_only = isinstance(layers, list) and layers and all(kind == "attention" for kind in layers)
    # a hybrid family with a reader (Granite 4.0's) is read where every layer is attention
    if model_type in NOT_ATTENTION_ONLY and not (model_type in FAMILIES and attention_only):
        raise DsautoError(f"{where} is a {model_type} model with {NOT_ATTENTION_ONLY[model_type]}, which dsauto does "
                          f"not price: it plans transformers whose every layer is softmax attention and an MLP "
                          f"(or experts).")
    multimodal = [key for key in ("text_config", "vision_config", "audio_config") if config.get(key) is not None]
    if multimodal:
        text = ("its text_config" if "text_config" in multimodal else
                "its language model's keys, with that model's model_type")
        raise DsautoError(f"{where} is a multimodal model (model_type {model_type!r} with "
                          f"{', '.join(multimodal)}); dsauto plans language models: give the text model's "
                          f"config ({text}) as the model.")
    moe = [f"{key}={config[key]!r}" for key in MOE_KEYS if config.get(key) not in (None, 0, False, {})]
    if (moe or model_type in MOE_TYPES) and model_type not in MOE_FAMILIES:
        named = f": {', '.join(moe)}" if moe else ""
        raise DsautoError(f"{where} is a mixture of experts (model_type {model_type!r}{named}), which dsauto "
                          f"reads only for model_type {', '.join(sorted(MOE_FAMILIES))}.")
    if config.get("is_encoder_decoder") or config.get("model_type") in ("t5", "mt5", "umt5", "bart", "mbart"):
        raise DsautoError(f"{where} is an encoder-decoder model (model_type {model_type!r}); {ENCODER_DECODER}.")
