"""megatron_args.txt for every Hugging Face family: each architecture detail of the config is a flag
Megatron-LM reads, or a ``# Not expressed`` comment naming it.

Flag names and values were checked against Megatron-LM's own parse_args, validate_args and
core_transformer_config_from_args at commit d98e8a6 (the flags build a TransformerConfig with the
config's kv_channels, biases, qk norm, window, activation and norm epsilon); test_megatron.py runs
the parser where Megatron-LM is installed.
"""

from __future__ import annotations

import json
import shlex
import warnings
from pathlib import Path

import pytest

from dsauto.emit.megatron import megatron_args
from dsauto.spec.hf import model_from_hf_config

CONFIGS = Path(__file__).parents[1] / "spec" / "configs"

# fixture -> (flags with their values (None: a switch), flags that must be absent, comment fragments)
EXPECTED = {
    "llama-3.1-8b": (
        {"--num-query-groups": "8", "--position-embedding-type": "rope", "--rotary-base": "500000",
         "--use-rope-scaling": None, "--rope-scaling-factor": "8", "--normalization": "RMSNorm",
         "--norm-epsilon": "1e-05", "--swiglu": None, "--disable-bias-linear": None,
         "--untie-embeddings-and-output-weights": None},
        ("--kv-channels", "--add-qkv-bias", "--qk-layernorm", "--rotary-percent", "--window-size",
         "--rotary-interleaved"),
        ()),
    "llama-3.2-1b": (
        {"--rope-scaling-factor": "32", "--use-rope-scaling": None},
        ("--untie-embeddings-and-output-weights", "--kv-channels"),  # head_dim 64 = 2048 / 32
        ()),
    "mistral-nemo-12b": (
        {"--kv-channels": "128", "--hidden-size": "5120", "--num-attention-heads": "32",
         "--rotary-base": "1000000"},
        ("--window-size", "--use-rope-scaling"),
        ()),
    "mistral-7b-v0.1": ({"--window-size": "4095,0"}, ("--window-attn-skip-freq",), ()),
    "qwen2.5-7b": (
        {"--disable-bias-linear": None, "--add-qkv-bias": None, "--norm-epsilon": "1e-06",
         "--rotary-base": "1000000", "--num-query-groups": "4"},
        ("--window-size", "--qk-layernorm"),
        ()),
    "qwen3-8b": (
        {"--qk-layernorm": None, "--disable-bias-linear": None},
        ("--add-qkv-bias", "--kv-channels"),  # head_dim 128 = 4096 / 32, Megatron's default
        ()),
    "qwen3-0.6b": ({"--kv-channels": "128", "--qk-layernorm": None}, (), ()),  # 1024 / 16 = 64
    "gemma-7b": (
        {"--kv-channels": "256", "--apply-layernorm-1p": None, "--norm-epsilon": "1e-06", "--quick-geglu": None},
        ("--untie-embeddings-and-output-weights", "--swiglu"),
        ("the MLP is GeGLU (GeLU, tanh approximation)", "embeddings scaled by sqrt(hidden size)")),
    "gemma-2-27b": (
        {"--kv-channels": "128", "--window-size": "4095,0", "--window-attn-skip-freq": "2"},
        (),
        ("scaled by 1/sqrt(144) instead of 1/sqrt(head width 128)", "soft-capped at 50",
         "logits soft-capped at 30", "4 per layer")),
    "gemma-3-1b": (
        {"--window-size": "511,0", "--window-attn-skip-freq": "6", "--qk-layernorm": None,
         "--rotary-base": "1000000", "--num-query-groups": "1"},
        (),
        ("sliding-window layers use the rotary base 10000",)),
    "phi-3-mini-4k": ({"--window-size": "2046,0", "--swiglu": None}, ("--num-query-groups",), ()),
    "falcon-7b": (
        {"--num-query-groups": "1", "--disable-bias-linear": None, "--position-embedding-type": "rope"},
        ("--swiglu",),
        ("attention and MLP in parallel on the same input (1 norm)",)),
    "falcon-40b": ({"--num-query-groups": "8"}, (), ("in parallel on the same input (2 norms)",)),
    "bloom-560m": (
        {"--position-embedding-type": "none", "--normalization": "LayerNorm", "--max-position-embeddings": "2048"},
        ("--disable-bias-linear", "--no-bias-gelu-fusion", "--untie-embeddings-and-output-weights"),
        ("ALiBi", "a norm after the embedding")),
    "gpt2": (
        {"--position-embedding-type": "learned_absolute", "--ffn-hidden-size": "3072"},
        ("--no-bias-gelu-fusion", "--disable-bias-linear", "--hidden-dropout"),  # fused bias-GeLU is tanh
        ()),
    "pythia-1b": (
        {"--rotary-percent": "0.25", "--untie-embeddings-and-output-weights": None,
         "--no-bias-gelu-fusion": None},  # exact GeLU
        ("--disable-bias-linear",),
        ("in parallel on the same input (2 norms)",)),
    "gpt-neox-20b": ({"--rotary-percent": "0.25"}, ("--no-bias-gelu-fusion",), ()),
    "opt-1.3b": (
        {"--ffn-hidden-size": "8192", "--position-embedding-type": "learned_absolute"},
        ("--swiglu", "--squared-relu"),
        ("ReLU in the MLP", "2 rows before the first position")),
    "bert-base-uncased": (
        {"--bert-no-binary-head": None, "--norm-epsilon": "1e-12", "--no-bias-gelu-fusion": None},
        ("--untie-embeddings-and-output-weights",),
        ("post-norm", "token-type embedding (2 rows)", "pretrain_bert.py")),
    "roberta-base": (
        {"--max-position-embeddings": "512", "--bert-no-binary-head": None},
        (),
        ("token-type embedding (1 rows)", "2 rows before the first position")),
    # its 32,768-token window over the plan's shorter sequences slides over nothing: full attention
    "ministral-8b-instruct-2410": ({"--num-query-groups": "8"}, ("--window-size",), ()),
    "granite-3.1-8b-instruct": (
        {"--rotary-base": "10000000", "--num-query-groups": "8", "--swiglu": None},
        ("--untie-embeddings-and-output-weights",),
        ("embeddings multiplied by 12", "multiplied by 0.22 before their residual adds",
         "logits multiplied by 0.0625", "scaled by 1/sqrt(16384) instead of 1/sqrt(head width 128)")),
    "olmo2-1124-7b": (
        {"--qk-layernorm": None, "--normalization": "RMSNorm", "--untie-embeddings-and-output-weights": None},
        ("--window-size",),
        ("each branch's output normalised before its residual add", "over all heads at once")),
    "olmo3-1025-7b": (
        {"--window-size": "4095,0", "--window-attn-skip-freq": "4", "--position-embedding-type": "yarn",
         "--norm-epsilon": "1e-06"},
        (),
        ("each branch's output normalised", "yarn rope scaling in the global layers only")),
    "smollm3-3b": (
        {"--no-rope-freq": "4", "--num-query-groups": "4", "--rotary-base": "5000000"},
        ("--untie-embeddings-and-output-weights", "--window-size"),
        ()),
    "glm-4-9b-chat-hf": (
        {"--rotary-interleaved": None, "--rotary-percent": "0.5", "--add-qkv-bias": None, "--disable-bias-linear": None,
         "--num-query-groups": "2"},
        (), ()),
    "glm-4-32b-0414": (
        {"--rotary-interleaved": None, "--rotary-percent": "0.5", "--disable-bias-linear": None},
        ("--add-qkv-bias",),
        ("4 per layer",)),
    "starcoder2-3b": (
        {"--window-size": "4095,0", "--num-query-groups": "2", "--normalization": "LayerNorm"},
        ("--disable-bias-linear", "--swiglu", "--untie-embeddings-and-output-weights", "--no-bias-gelu-fusion"),
        ()),
    "gpt_bigcode-santacoder": (
        {"--num-query-groups": "1", "--position-embedding-type": "learned_absolute"},
        ("--disable-bias-linear", "--no-bias-gelu-fusion"),
        ()),
    "c4ai-command-r-v01": (
        {"--rotary-interleaved": None, "--normalization": "LayerNorm", "--rotary-base": "8000000",
         "--disable-bias-linear": None},
        ("--untie-embeddings-and-output-weights", "--no-rope-freq"),
        ("LayerNorms without biases", "in parallel on the same input (1 norm)", "logits multiplied by 0.0625")),
    "c4ai-command-r7b-12-2024": (
        {"--window-size": "4095,0", "--window-attn-skip-freq": "4", "--no-rope-freq": "4"}, (), ()),
    "phi-2": (
        {"--rotary-percent": "0.4", "--untie-embeddings-and-output-weights": None},
        ("--disable-bias-linear", "--no-bias-gelu-fusion"),
        ("a bias over the 51200-word vocabulary on the LM head", "in parallel on the same input (1 norm)")),
    "llama-4-maverick-text": (
        {"--moe-layer-freq": "([0,1]*24)", "--moe-router-score-function": "sigmoid", "--moe-router-topk": "1",
         "--moe-apply-probs-on-input": None, "--no-rope-freq": "4", "--moe-shared-expert-intermediate-size": "8192",
         "--ffn-hidden-size": "16384", "--moe-ffn-hidden-size": "8192"},
        ("--moe-router-enable-expert-bias",),
        ("chunked attention (8192-token chunks)", "scale their queries with the position")),
    "seed-oss-36b": (
        {"--add-qkv-bias": None, "--disable-bias-linear": None, "--kv-channels": "128", "--num-query-groups": "8",
         "--rotary-base": "10000000"},
        (), ()),
    "ernie-4.5-0.3b": (
        {"--rotary-interleaved": None, "--disable-bias-linear": None, "--kv-channels": "128",
         "--rotary-base": "500000"},
        ("--add-qkv-bias", "--untie-embeddings-and-output-weights"), ()),
    "minitron-8b-base": (
        {"--squared-relu": None, "--apply-layernorm-1p": None, "--rotary-percent": "0.5",
         "--kv-channels": "128", "--normalization": "LayerNorm", "--disable-bias-linear": None},
        ("--swiglu",),
        ()),
}


def flags(lines: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for line in lines:
        if not line.startswith("# "):
            flag, _, value = line.partition(" ")
            assert flag not in out, f"{flag} given twice"
            out[flag] = " ".join(shlex.split(value)) or None  # the words a shell reads
    return out


@pytest.fixture
def plan_of(make_plan, layer_runs):
    def build(name: str):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = model_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)
        stages = (model.num_layers,)
        # sequences long enough for the windows to slide (ModelSpec.window_slides)
        return make_plan(model, dp=2, tp=1, pp=1, zero_stage=1, stage_layers=stages,
                         layers=layer_runs(model, stages), seq_len=min(8192, model.max_position_embeddings))
    return build


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_family_flags(plan_of, name):
    present, absent, notes = EXPECTED[name]
    lines = megatron_args(plan_of(name))
    given = flags(lines)
    for flag, value in present.items():
        assert flag in given, (flag, lines)
        assert given[flag] == value, (flag, given[flag], value)
    for flag in absent:
        assert flag not in given, (flag, given[flag])
    text = "\n".join(line for line in lines if line.startswith("# "))
    for note in notes:
        assert note in text, (note, text)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shape_flags_are_the_config(plan_of, name):
    """The numbers Megatron builds the model from are the config's own."""
    data = json.loads((CONFIGS / f"{name}.json").read_text())
    given = flags(megatron_args(plan_of(name)))
    layers = data.get("num_hidden_layers") or data.get("n_layer")
    width = data.get("hidden_size") or data.get("n_embd")
    heads = data.get("num_attention_heads") or data.get("n_head")
    assert (given["--num-layers"], given["--hidden-size"], given["--num-attention-heads"]) == \
        (str(layers), str(width), str(heads))
    head_dim = data.get("head_dim") or width // heads
    assert int(given.get("--kv-channels") or width // heads) == head_dim
    kv = 1 if data.get("multi_query") and not data.get("new_decoder_architecture") else \
        data.get("num_key_value_heads") or data.get("num_kv_heads") or heads
    assert int(given.get("--num-query-groups") or heads) == kv


def test_rope_scalings_megatron_has_no_flag_for_are_named(plan_of, make_plan, layer_runs):
    from dataclasses import replace

    base = plan_of("llama-3.1-8b")
    odd = replace(base.model, rope_scaling_params=(("low_freq_factor", 2.0), ("high_freq_factor", 4.0),
                                                   ("original_max_position_embeddings", 8192.0)))
    text = "\n".join(megatron_args(replace(base, model=odd)))
    assert "--use-rope-scaling" in text and "llama3 rope scaling with low_freq_factor 2" in text
    linear = replace(base.model, rope_scaling="linear", rope_scaling_factor=4.0, rope_scaling_params=())
    assert "--rotary-seq-len-interpolation-factor 4" in megatron_args(replace(base, model=linear))
    yarn = replace(base.model, rope_scaling="yarn", rope_scaling_factor=4.0,
                   rope_scaling_params=(("original_max_position_embeddings", 32768.0), ("beta_fast", 32.0)))
    given = flags(megatron_args(replace(base, model=yarn)))
    assert given["--position-embedding-type"] == "yarn" and given["--rotary-scaling-factor"] == "4"
    assert given["--yarn-original-max-position-embeddings"] == "32768" and given["--yarn-beta-fast"] == "32"
    dynamic = replace(base.model, rope_scaling="dynamic", rope_scaling_factor=2.0, rope_scaling_params=())
    lines = megatron_args(replace(base, model=dynamic))
    assert any(line.startswith("# Not expressed: dynamic rope scaling (factor 2)") for line in lines)
    assert "--use-rope-scaling" not in flags(lines)


def test_partial_biases_are_named(plan_of):
    from dataclasses import replace

    base = plan_of("llama-3.1-8b")
    attention = replace(base.model, qkv_bias=True, proj_bias=True)  # Llama's attention_bias
    lines = megatron_args(replace(base, model=attention))
    assert "--add-qkv-bias" in flags(lines) and "--disable-bias-linear" in flags(lines)
    assert any("biases on the attention output projection only" in line for line in lines)
