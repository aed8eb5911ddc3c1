"""gpt-oss's clamped gate (ModelSpec.glu_clamp) runs fused in Megatron-core's routed experts alone: a
model that also has dense MLP layers or shared experts is refused on Megatron-core in one sentence with
its numbers, planned on DeepSpeed when the engine is left open, and its Megatron-LM flags (a DeepSpeed
plan's) turn the fusion off so that they launch."""

from __future__ import annotations

import dataclasses

import pytest

from dsauto.api import make_plan
from dsauto.emit.megatron import megatron_args
from dsauto.engines.rules import clamped_gate_refusal
from dsauto.errors import DsautoError
from dsauto.spec.loaders import load_model

DENSE = dataclasses.replace(load_model("gpt-tiny"), name="clamped-dense", mlp="swiglu", glu_clamp=7.0)


def test_dense_clamped_gate_is_refused_on_megatron_with_its_count():
    with pytest.raises(DsautoError) as refused:
        make_plan(DENSE, "cpu", engine="megatron")
    said = str(refused.value)
    assert f"clamped-dense's {DENSE.num_layers} dense MLP layers would run it only unfused" in said
    assert "glu_clamp 7" in said and "which dsauto does not price" in said
    assert said.endswith("plan it with --engine deepspeed.")


def test_engine_left_open_plans_deepspeed_and_its_megatron_flags_run_unfused():
    plan = make_plan(DENSE, "cpu")
    assert plan.engine == "deepspeed"
    lines = megatron_args(plan)
    assert "--quick-geglu" in lines and "--no-bias-gelu-fusion" in lines
    assert any(line.startswith("# Unfused: Megatron-core fuses a clamped gate") for line in lines)


def test_routed_experts_alone_keep_the_fused_gate():
    base = dataclasses.replace(load_model("gpt-tiny"), mlp="swiglu", glu_clamp=7.0, num_experts=4, moe_top_k=2,
                               moe_ffn_hidden_size=64)
    assert clamped_gate_refusal("megatron", base) is None
    assert clamped_gate_refusal("deepspeed", dataclasses.replace(base, moe_first_dense_layers=1)) is None
    one_dense = clamped_gate_refusal("megatron", dataclasses.replace(base, moe_first_dense_layers=1))
    assert one_dense is not None and "'s 1 dense MLP layer would run it" in one_dense
    shared = clamped_gate_refusal("megatron", dataclasses.replace(base, shared_expert_ffn_hidden_size=64))
    assert shared is not None and "a shared expert in each MoE layer" in shared
