"""The configs of the published mixtures of experts that benchmarks/fidelity.py prices have the
parameter counts their publishers state (benchmarks/hf_configs/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_modules import load  # tests/ is on sys.path through its conftest

from dsauto.spec.hf import model_from_hf_config

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_configs"

# (total, active without the input embedding, tolerance): the publisher's figures and rounding.
PUBLISHED = {
    "gpt-oss-20b": (20.91e9, 3.61e9, 0.002),  # gpt-oss model card, Table 1
    "gpt-oss-120b": (116.83e9, 5.13e9, 0.002),  # gpt-oss model card, Table 1
    "qwen3-30b-a3b": (30.5e9, None, 0.005),  # Qwen3-30B-A3B model card
    "qwen3-235b-a22b": (235e9, None, 0.003),  # Qwen3-235B-A22B model card (22B active with the embeddings)
    "deepseek-v3": (671e9, None, 0.005),  # DeepSeek-V3 technical report, abstract (MTP module apart)
    "kimi-k2": (1e12, None, 0.03),  # MoonshotAI/Kimi-K2 README: 1T in total (1,026.4B counted)
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_moe_config_has_its_published_size(name):
    model = model_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)
    total, active, tolerance = PUBLISHED[name]
    assert model.num_parameters() == pytest.approx(total, rel=tolerance)
    if active is not None:
        embedding = model.vocab_size * model.hidden_size
        assert model.num_active_parameters() - embedding == pytest.approx(active, rel=tolerance)


def test_every_shipped_config_is_documented():
    readme = (CONFIGS / "README.md").read_text()
    assert sorted(p.stem for p in CONFIGS.glob("*.json")) == sorted(PUBLISHED)
    assert all(f"{name}.json" in readme for name in PUBLISHED)


def test_the_fidelity_harness_prices_each_moe_run_as_it_ran():
    fidelity = load("fidelity")
    runs, excluded = fidelity.load_runs()
    moe = {run.id: run for run in runs if run.model.moe}
    assert len(moe) == 21
    bridge = moe["mbridge2602-moe-gpt-oss-120b-64gpu"]
    assert bridge.model.num_layers == 36 and bridge.model.num_experts == 128
    assert (bridge.pins.ep, bridge.pins.pp, bridge.pins.zero_stage, bridge.pins.micro_batch) == (8, 4, 1, 1)
    assert bridge.pins.recompute_modules == "layernorm,moe_act"
    assert bridge.pins.expert_load_balanced and not bridge.grad_reduce_in_fp32  # pinned: the search bounds memory so
    # its sinks run in cuDNN's fused attention (TE turns FlashAttention off for them); AutoModel's in FlexAttention
    assert bridge.attention_kernel == "cudnn" and moe["automodel-moe-gpt-oss-120b-64gpu"].attention_kernel == "flash"
    deepseek = moe["automodel-moe-deepseek-v3-256gpu"]
    assert deepseek.pins.expert_dispatcher == "deepep"  # pinned: the search prices DeepEP's dispatch
    assert deepseek.pins.zero_stage == 1 and deepseek.pins.vpp == 8  # pipelines: ZeRO 0-1
    assert moe["automodel-moe-qwen3-30b-a3b-8gpu"].pins.zero_stage == 3
    # Megatron-Bridge's Qwen3-30B-A3B in FP8 with current scaling, TE's (cuDNN's) attention
    qwen = moe["mbridge2511-moe-qwen3_30b_a3b-16gpu"]
    assert (qwen.pins.fp8, qwen.pins.fp8_recipe, qwen.attention_kernel) == (True, "tensorwise", "cudnn")
    # the later containers' presets: HybridEP priced as DeepEP's dispatch; tensor-parallel overlap
    # as the recipe sets it (Qwen3-235B-A22B's H100 recipe turns it off at tp 2)
    hybrid = moe["mbridge2604-moe-qwen3_30b_a3b-16gpu"]
    assert (hybrid.pins.expert_dispatcher, hybrid.pins.ep, hybrid.pins.pp, hybrid.pins.expert_a2a_overlap) == (
        "deepep", 16, 1, None)
    big = moe["mbridge2511-moe-qwen3_235b_a22b-256gpu"]
    assert big.pins.tp == 2 and big.pins.tp_comm_overlap is False and not big.engine_options["tp_comm_overlap"]
    assert moe["mbridge2511-moe-qwen3_30b_a3b-16gpu"].pins.expert_dispatcher is None  # alltoall
    reasons = dict(excluded)
    assert "not the global batch" in reasons["mbridge2511-moe-gpt-oss-120b-64gpu"]
    kimi = moe["automodel-moe-kimi-k2-256gpu"]  # Kimi K2's own model_type, DeepSeek-V3's architecture
    assert (kimi.model.num_experts, kimi.pins.pp, kimi.pins.vpp, kimi.pins.ep, kimi.pins.expert_dispatcher) == (
        384, 8, 4, 32, "deepep")
