"""Megatron-LM flags of mixtures of experts and latent attention (names as in Megatron-LM's
arguments.py, ``_add_moe_args`` and the MLA arguments), and dense plans unchanged."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import dsauto
from dsauto.engines.megatron import degree_fields, degree_flags
from dsauto.parallel import ParallelDims

CONFIGS = Path(__file__).parents[1] / "spec" / "configs"


def plan(name, nodes, **pins):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dsauto.make_plan(json.loads((CONFIGS / f"{name}.json").read_text()), "h100-80gb", nodes=nodes,
                                gpus_per_node=8, global_batch=256, seq_len=4096, engine="megatron", **pins)


def test_expert_degrees_are_written_for_experts_only():
    dims = ParallelDims(dp=8, tp=2, ep=4)
    assert degree_flags(dims) == ["--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 1"]
    # etp is written even when 1: Megatron's default expert TP is tp
    assert degree_flags(dims, experts=True)[-2:] == ["--expert-model-parallel-size 4",
                                                     "--expert-tensor-parallel-size 1"]
    assert "expert_model_parallel_size" not in degree_fields(dims)
    assert degree_fields(dims, experts=True)["expert_tensor_parallel_size"] == 1


def test_mixtral_flags():
    mixtral = plan("mixtral-8x7b", 4, ep=4, etp=1)
    flags = dsauto.megatron_args(mixtral)
    for flag in ("--num-experts 8", "--moe-router-topk 2", "--moe-ffn-hidden-size 14336", "--moe-grouped-gemm",
                 "--moe-token-dispatcher-type alltoall", "--expert-model-parallel-size 4",
                 "--expert-tensor-parallel-size 1"):
        assert flag in flags
    assert not any(f.startswith(("--moe-layer-freq", "--moe-shared", "--multi-latent")) for f in flags)
    assert dsauto.ds_config(mixtral)["dsauto"]["ep"] == 4  # the plan block carries the degrees


def test_deepseek_flags():
    flags = dsauto.megatron_args(plan("deepseek-v2-lite", 2, ep=8))
    for flag in ("--num-experts 64", "--moe-router-topk 6", "--moe-ffn-hidden-size 1408",
                 "--moe-shared-expert-intermediate-size 2816", "--moe-layer-freq '([0]*1+[1]*26)'",
                 "--multi-latent-attention", "--kv-lora-rank 512", "--qk-head-dim 128",
                 "--qk-pos-emb-head-dim 64", "--v-head-dim 128"):
        assert flag in flags
    assert not any(f.startswith("--q-lora-rank") for f in flags)  # V2-Lite projects queries directly


def test_qwen2_moe_gate_and_gpt_oss_as_megatron_lm_builds_it():
    assert "--moe-shared-expert-gate" in dsauto.megatron_args(plan("qwen1.5-moe-a2.7b", 1))
    flags = dsauto.megatron_args(plan("gpt-oss-20b", 1))
    # the sinks, the clamped gate, and the biases of attention, experts and router: Megatron-LM's
    # defaults (add_bias_linear), as Megatron-Bridge's GPTOSSProvider builds gpt-oss
    assert {"--softmax-type learnable", "--quick-geglu", "--glu-linear-offset 1",
            "--activation-func-clamp-value 7", "--window-attn-skip-freq 2"} <= set(flags)
    assert not {"--swiglu", "--disable-bias-linear", "--add-qkv-bias"} & set(flags)
    assert not any("Not expressed" in flag for flag in flags), flags
    assert "--attention-backend fused" in flags  # TE runs the sinks in cuDNN's kernel alone
