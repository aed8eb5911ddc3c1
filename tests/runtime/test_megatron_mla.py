"""Latent attention in the Megatron-core plugin: the config of DeepSeek-V2-Lite's and DeepSeek-V3's
architecture (multi-head latent attention, experts) builds as Megatron-core's MLATransformerConfig
with the model's latent ranks, head widths and yarn rotary scaling."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from dsauto.runtime import megatron as dm
from dsauto.spec.hf import model_from_hf_config

CONFIGS = Path(__file__).parents[1] / "spec" / "configs"


def hf(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])
def test_latent_attention_config_builds(name):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    model = hf(name)
    config_class = dm.transformer_config_class(model)
    assert config_class is MLATransformerConfig
    config = config_class(**dm.transformer_config_kwargs(model), use_cpu_initialization=True)
    assert config.multi_latent_attention
    # the norms of the compressed query and key/value, which Megatron-core's MLA specs build only under
    # qk_layernorm (gpt_layer_specs.py), and the flags say so too
    assert config.qk_layernorm
    from dsauto.api import make_plan
    from dsauto.emit.megatron import megatron_args

    plan = make_plan(model, "h100-80gb", nodes=32 if model.num_experts > 64 else 1, global_batch=512, seq_len=4096,
                     engine="megatron")
    assert "--qk-layernorm" in megatron_args(plan)
    # the router as the config weighs and limits the experts: V3's node-limited groups and scaled
    # weights; V2-Lite's softmax over all experts, not renormalised over the chosen (norm_topk_prob false)
    expected = {"deepseek-v3": (False, 2.5, 8, 4), "deepseek-v2-lite": (True, None, None, None)}[name]
    assert (config.moe_router_pre_softmax, config.moe_router_topk_scaling_factor, config.moe_router_num_groups,
            config.moe_router_group_topk) == expected
    flags = megatron_args(plan)
    if name == "deepseek-v3":
        assert {"--moe-router-topk-scaling-factor 2.5", "--moe-router-num-groups 8", "--moe-router-group-topk 4"} <= \
            set(flags)
    else:
        assert "--moe-router-pre-softmax" in flags
    assert (config.q_lora_rank or 0, config.kv_lora_rank) == (model.q_lora_rank, model.kv_lora_rank)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (
        model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim)
    assert config.num_moe_experts == model.num_experts and config.moe_router_topk == model.moe_top_k
    if model.rope_scaling == "yarn":
        assert config.rope_type == "yarn" and config.rotary_scaling_factor == model.rope_scaling_factor


def test_dense_attention_keeps_transformer_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    model = hf("mixtral-8x7b")
    assert dm.transformer_config_class(model) is TransformerConfig
    assert "multi_latent_attention" not in dm.transformer_config_kwargs(model)


def test_latent_attentions_up_projections_recomputed_as_megatron_core_does():
    """--recompute-modules mla_up_proj (Megatron-core's recompute_up_proj: the up projections and the
    rotary embedding re-run, their queries, keys and values dropped after the attention core) frees
    (q + k + v) x 2 bytes a token in every layer, costs the up projections' matrix multiplies again,
    reaches MLATransformerConfig, and is refused for DeepSpeed and for attention that is not latent."""
    from dsauto.api import make_plan
    from dsauto.errors import DsautoError

    model = hf("deepseek-v2-lite")
    pins = dict(engine="megatron", ep=8, tp=1, pp=1, micro_batch=1, checkpoint=False, global_batch=64,
                seq_len=4096, gpus_per_node=8, nodes=2)
    none, up = (make_plan(model, "h100-80gb", recompute_modules=m, **pins) for m in ("none", "mla_up_proj"))
    width = model.num_attention_heads * (2 * (model.qk_nope_head_dim + model.qk_rope_head_dim) + model.v_head_dim)
    freed = width * 2 * 4096 * model.num_layers
    assert none.stages[0].activation_bytes - up.stages[0].activation_bytes == pytest.approx(freed, rel=1e-6)
    assert up.stages[0].backward_seconds > none.stages[0].backward_seconds
    config = dm.transformer_config_class(model)(**dm.transformer_config_kwargs(model), use_cpu_initialization=True)
    assert "mla_up_proj" in dm.apply(up, config).recompute_modules
    with pytest.raises(DsautoError, match="'mla_up_proj' is Megatron-core's"):
        make_plan(model, "h100-80gb", engine="deepspeed", recompute_modules="mla_up_proj", nodes=2, global_batch=64)
    with pytest.raises(DsautoError, match="the model's attention is not latent"):
        make_plan("llama3-8b", "h100-80gb", engine="megatron", recompute_modules="mla_up_proj", global_batch=64)
