"""The later Hugging Face families in the Megatron-core plugin: each config's architecture builds
Megatron-core's TransformerConfig, with the activation, the layers without rotary positions and the
experts the model has."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from dsauto.runtime import megatron as dm
from dsauto.spec.hf import model_from_hf_config

CONFIGS = Path(__file__).parents[1] / "spec" / "configs"
NEW = ["seed-oss-36b", "ernie-4.5-0.3b", "llama-4-maverick-text", "minimax-m2", "c4ai-command-r-v01",
       "c4ai-command-r7b-12-2024", "phi-2", "glm-4.5-air", "glm-4-32b-0414", "glm-4-9b-chat-hf",
       "granite-3.0-3b-a800m-base", "granite-3.1-8b-instruct", "gpt_bigcode-santacoder", "minitron-8b-base",
       "olmo2-1124-7b", "olmo3-1025-7b", "smollm3-3b", "starcoder2-3b"]


def hf(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)


@pytest.mark.parametrize("name", NEW)
def test_config_builds(name):
    model = hf(name)
    config = dm.transformer_config_class(model)(**dm.transformer_config_kwargs(model), use_cpu_initialization=True)
    assert (config.num_layers, config.hidden_size, config.kv_channels) == (
        model.num_layers, model.hidden_size, model.head_dim)
    assert config.num_query_groups == model.kv_heads
    assert config.num_moe_experts == (model.num_experts or None)


def test_squared_relu_and_layernorm_1p():
    from megatron.core.activations import squared_relu

    config = dm.transformer_config_class(hf("minitron-8b-base"))(
        **dm.transformer_config_kwargs(hf("minitron-8b-base")), use_cpu_initialization=True)
    assert config.activation_func is squared_relu and not config.gated_linear_unit
    assert config.layernorm_zero_centered_gamma and config.normalization == "LayerNorm"


def test_no_rope_layers_follow_the_model():
    model = hf("smollm3-3b")
    config = dm.transformer_config_class(model)(**dm.transformer_config_kwargs(model), use_cpu_initialization=True)
    # Megatron-core expands the period into one flag per layer, 1 = without rotary positions
    assert config.no_rope_freq == [int((i + 1) % 4 == 0) for i in range(36)]


def test_glm45_experts_reach_the_config():
    model = hf("glm-4.5-air")
    config = dm.transformer_config_class(model)(**dm.transformer_config_kwargs(model), use_cpu_initialization=True)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (128, 8, 1408)
    assert config.moe_shared_expert_intermediate_size == 1408 and config.moe_router_score_function == "sigmoid"
    assert config.moe_layer_freq == [0] + [1] * 45 and config.add_qkv_bias and not config.add_bias_linear


def test_llama4_routing_reaches_the_config():
    model = hf("llama-4-maverick-text")
    config = dm.transformer_config_class(model)(**dm.transformer_config_kwargs(model), use_cpu_initialization=True)
    assert config.moe_layer_freq == [0, 1] * 24 and config.moe_apply_probs_on_input
    assert config.moe_router_score_function == "sigmoid" and not config.moe_router_enable_expert_bias
    assert config.no_rope_freq == [0, 0, 0, 1] * 12


@pytest.mark.parametrize("name, interleaved", [
    ("glm-4-9b-chat-hf", True), ("c4ai-command-r7b-12-2024", True), ("ernie-4.5-0.3b", True), ("glm-4.5-air", False),
    ("granite-3.1-8b-instruct", False)])
def test_rotary_layout_reaches_the_config(name, interleaved):
    model = hf(name)
    config = dm.transformer_config_class(model)(**dm.transformer_config_kwargs(model), use_cpu_initialization=True)
    assert config.rotary_interleaved is interleaved


def test_gpt_oss_builds_as_megatron_bridge_builds_it():
    """gpt-oss's sinks, clamped gate and biases reach the config as Megatron-Bridge's GPTOSSProvider sets
    them (softmax_type learnable, quick_gelu with glu_linear_offset 1 and activation_func_clamp_value 7,
    add_bias_linear), and the plugin's model check accepts the biases."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    model = hf("gpt-oss-20b")
    config = dm.transformer_config_class(model)(**dm.transformer_config_kwargs(model), use_cpu_initialization=True)
    assert (config.softmax_type, config.activation_func, config.gated_linear_unit, config.glu_linear_offset,
            config.activation_func_clamp_value, config.bias_activation_fusion) == (
        "learnable", quick_gelu, True, 1.0, 7.0, True)
    assert config.add_bias_linear and config.add_qkv_bias
    assert (config.window_size, config.window_attn_skip_freq) == ((127, 0), 2)
    dm._check_model(model, config)  # raises where the config is not the planned model's
