"""The fused attention kernel a plan runs: cuDNN's fused attention for Megatron-core on Hopper (what
Transformer Engine picks there), FlashAttention otherwise; priced, emitted and reported as chosen."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dsauto.api import make_plan
from dsauto.cli import main
from dsauto.describe import describe_plan
from dsauto.emit.megatron import megatron_args
from dsauto.engines.rules import attention_kernel_refusal, default_attention_kernel
from dsauto.plan_io import read_plan
from dsauto.refine.space import strategy_of
from dsauto.spec.loaders import as_model

LLAMA = as_model("llama3-8b")
CONFIGS = Path(__file__).resolve().parents[1] / "spec" / "configs"


def backend(plan) -> str:
    [line] = [line for line in megatron_args(plan) if line.startswith("--attention-backend ")]
    return line.split()[1]


@pytest.mark.parametrize("engine, fused, dtype, flash, model, expected", [
    ("megatron", True, "bf16", True, LLAMA, "cudnn"),
    ("megatron", True, "fp16", True, LLAMA, "cudnn"),
    ("deepspeed", True, "bf16", True, LLAMA, "flash"),  # DeepSpeed plans run the model's own attention
    ("megatron", False, "bf16", True, LLAMA, "flash"),  # no cuDNN constant: pre-Hopper
    ("megatron", True, "fp32", True, LLAMA, "flash"),
    ("megatron", True, "bf16", False, LLAMA, "flash"),  # eager attention
    # cuDNN 9.5 on trains heads up to 256 wide on Hopper (TE's fused_attn.cpp: "9.5: <= 256 + Hopper + bprop")
    ("megatron", True, "bf16", True, dataclasses.replace(LLAMA, attention_head_dim=256), "cudnn"),
    ("megatron", True, "bf16", True, dataclasses.replace(LLAMA, attention_head_dim=272), "flash"),
    ("megatron", False, "bf16", True, dataclasses.replace(LLAMA, attention_head_dim=256), "flash"),
    ("megatron", True, "bf16", True, dataclasses.replace(LLAMA, attention_head_dim=72), "flash"),
    # cuDNN runs a causal sliding window without attention dropout (TE's fused_attn.cpp, cuDNN 9.2 on)
    ("megatron", True, "bf16", True, dataclasses.replace(LLAMA, sliding_window=4096, dropout=False), "cudnn"),
    ("megatron", True, "bf16", True, dataclasses.replace(LLAMA, sliding_window=4096, dropout=True), "flash"),
    ("megatron", True, "bf16", True, dataclasses.replace(LLAMA, attention_chunk=8192), "flash"),
])
def test_default_kernel(engine, fused, dtype, flash, model, expected):
    assert default_attention_kernel(engine, fused, dtype, flash, model) == expected
    refusal = attention_kernel_refusal(engine, "cudnn", dtype, flash, model, hopper=fused)
    if fused:  # where the device has cuDNN's kernel, it runs wherever allowed
        assert (refusal is None) == (expected == "cudnn")
    assert attention_kernel_refusal(engine, "flash", dtype, flash, model) is None


def test_megatron_plan_on_hopper_runs_cudnn_and_says_so(tmp_path):
    plan = make_plan("llama3-8b", "h100-80gb", engine="megatron", seq_len=8192, global_batch=16)
    assert plan.attention_kernel == "cudnn"
    assert backend(plan) == "fused"
    assert "cuDNN fused attention" in describe_plan(plan)
    assert strategy_of(plan).attention_kernel == "cudnn"
    assert main(["tune", "--model", "llama3-8b", "--hardware", "h100-80gb", "--engine", "megatron",
                 "--out", str(tmp_path)]) == 0
    assert read_plan(tmp_path / "plan.yaml").attention_kernel == "cudnn"
    assert "--attention-backend fused" in (tmp_path / "megatron_args.txt").read_text().splitlines()


def test_a_windowed_model_runs_cudnn_on_hopper_and_keeps_its_window():
    # Mistral 7B: a 4096-token causal window, no attention dropout: Transformer Engine's FusedAttention
    # (cuDNN 9.2 on) runs it, and prefers it on Hopper.
    config = json.loads((CONFIGS / "mistral-7b-v0.1.json").read_text())
    plan = make_plan(config, "h100-80gb", engine="megatron", seq_len=8192, global_batch=16, gpus_per_node=8)
    assert plan.attention_kernel == "cudnn" and backend(plan) == "fused"
    assert "--window-size 4095,0" in megatron_args(plan)
    flash = make_plan(config, "h100-80gb", engine="megatron", seq_len=8192, global_batch=16, gpus_per_node=8,
                      attention_kernel="flash", tp=plan.tp, pp=plan.pp, zero_stage=plan.zero_stage,
                      micro_batch=plan.micro_batch)
    assert flash.prediction.step_seconds > plan.prediction.step_seconds  # the window at cuDNN's faster rate


def test_cudnn_is_priced_at_the_devices_fused_rate():
    pins = dict(engine="megatron", tp=1, pp=1, zero_stage=1, micro_batch=1, checkpoint=True)
    fused = make_plan("llama3-8b", "h100-80gb", seq_len=8192, global_batch=16, **pins)
    flash = make_plan("llama3-8b", "h100-80gb", seq_len=8192, global_batch=16, attention_kernel="flash", **pins)
    assert flash.attention_kernel == "flash" and backend(flash) == "flash"
    assert fused.layers == flash.layers and fused.dims == flash.dims
    # Same plan, only attention priced differently: cuDNN's kernel runs faster on H100.
    assert fused.prediction.compute_seconds < flash.prediction.compute_seconds
    assert fused.prediction.peak_memory_bytes == flash.prediction.peak_memory_bytes
    # Pinned on a device without a cuDNN rate: priced at the FlashAttention rate, with a warning.
    with pytest.warns(UserWarning, match="priced at its FlashAttention efficiency"):
        a100 = make_plan("llama3-8b", "a100-80gb", seq_len=8192, global_batch=16, attention_kernel="cudnn", **pins)
    a100_flash = make_plan("llama3-8b", "a100-80gb", seq_len=8192, global_batch=16, **pins)
    assert a100_flash.attention_kernel == "flash" and a100.attention_kernel == "cudnn"
    assert a100.prediction.step_seconds == pytest.approx(a100_flash.prediction.step_seconds)


def test_deepspeed_plans_keep_flash():
    plan = make_plan("llama3-8b", "h100-80gb", engine="deepspeed")
    assert plan.attention_kernel == "flash"


def test_cudnn_pinned_where_it_cannot_run_is_one_sentence(tmp_path, capsys):
    assert main(["tune", "--model", "llama3-8b", "--hardware", "h100-80gb", "--engine", "deepspeed",
                 "--attention-kernel", "cudnn", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "only dsauto's Megatron-core plans" in error
    assert not list(tmp_path.iterdir())
    # Left to the search, the engine follows the pin: Megatron-core.
    assert main(["tune", "--model", "llama3-8b", "--hardware", "h100-80gb", "--attention-kernel", "cudnn",
                 "--out", str(tmp_path)]) == 0
    assert read_plan(tmp_path / "plan.yaml").engine == "megatron"


def test_a_plan_edited_to_cudnn_under_deepspeed_is_refused():
    plan = make_plan("llama3-8b", "h100-80gb", engine="deepspeed")
    with pytest.raises(ValueError, match="attention_kernel cudnn needs a Megatron-core plan"):
        dataclasses.replace(plan, attention_kernel="cudnn")
    with pytest.raises(ValueError, match="attention_kernel must be one of flash, cudnn"):
        dataclasses.replace(plan, attention_kernel="sdpa")


def test_latent_attention_runs_in_cudnn_on_hopper_and_never_in_flashattention(capsys):
    """Transformer Engine turns FlashAttention off for latent attention's 192-wide query/key and 128-wide
    value heads (get_attention_backend's head-dimension filter) and keeps FusedAttention, which cuDNN 9.5
    on trains up to 256 wide on Hopper: Megatron-core plans of DeepSeek-V2-Lite run cuDNN there. On an
    A100 neither kernel runs it: a Megatron-core plan needs unfused attention, said in one sentence."""
    config = json.loads((CONFIGS / "deepseek-v2-lite.json").read_text())
    model = as_model(config)
    assert attention_kernel_refusal("megatron", "flash", "bf16", True, model) is not None
    assert attention_kernel_refusal("deepspeed", "flash", "bf16", True, model) is None  # the model's own attention
    assert attention_kernel_refusal("megatron", "cudnn", "bf16", True, model, hopper=True) is None
    assert attention_kernel_refusal("megatron", "cudnn", "bf16", True, model) == (
        "cuDNN's fused attention trains heads in multiples of 8 up to 128 wide (256 on Hopper with cuDNN 9.5 or "
        "later), not latent attention's 192/128")
    narrow = dataclasses.replace(model, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
    assert default_attention_kernel("megatron", False, "bf16", True, narrow) == "cudnn"  # 96-wide: cuDNN anywhere
    pins = dict(engine="megatron", ep=8, global_batch=64, seq_len=4096, gpus_per_node=8, nodes=2)
    plan = make_plan(config, "h100-80gb", **pins)
    assert plan.attention_kernel == "cudnn" and backend(plan) == "fused"
    path = CONFIGS / "deepseek-v2-lite.json"
    common = ["plan", "--model", str(path), "--engine", "megatron", "--ep", "8", "--nodes", "2", "--global-batch", "64",
              "--seq-len", "4096"]
    assert main([*common, "--hardware", "a100-80gb"]) == 2
    assert ("fused attention cannot run: Transformer Engine's FlashAttention does not run latent attention, whose "
            "query and key heads (192 wide) are not its value heads (128), and cuDNN's fused attention trains heads "
            "in multiples of 8 up to 128 wide (256 on Hopper with cuDNN 9.5 or later), not latent attention's "
            "192/128; add --no-flash-attention (unfused attention), or plan for Hopper.") in capsys.readouterr().err
    assert main([*common, "--hardware", "h100-80gb", "--attention-kernel", "flash"]) == 2
    assert "; use --attention-kernel cudnn or leave it out." in capsys.readouterr().err
    assert main([*common, "--hardware", "h100-80gb", "--dtype", "fp32"]) == 2
    assert ("and cuDNN's fused attention runs in bf16 or fp16, not fp32; add --no-flash-attention (unfused "
            "attention).") in capsys.readouterr().err
    unfused = make_plan(config, "a100-80gb", flash_attention=False, **pins)
    assert backend(unfused) == "unfused"


def test_attention_sinks_run_in_cudnn_and_split_over_cp_by_heads(capsys):
    """gpt-oss's sinks are Megatron-core's softmax_type learnable: Transformer Engine turns FlashAttention
    off for it ("Filter: Softmax type") and cuDNN 9.13.1 on runs it, on an A100 too; its context
    parallelism runs it with cp_comm_type a2a alone."""
    from dsauto.engines.rules import cp_comm_type_refusal

    path = CONFIGS / "gpt-oss-20b.json"
    model = as_model(json.loads(path.read_text()))
    assert attention_kernel_refusal("megatron", "flash", "bf16", True, model) == (
        "Transformer Engine's FlashAttention does not run the sinks' learnable softmax (gpt-oss: --softmax-type "
        "learnable)")
    assert attention_kernel_refusal("deepspeed", "flash", "bf16", True, model) is None  # the model's own attention
    assert default_attention_kernel("megatron", False, "bf16", True, model) == "cudnn"
    assert default_attention_kernel("deepspeed", False, "bf16", True, model) == "flash"
    plan = make_plan(model, "a100-80gb", engine="megatron", nodes=1, global_batch=32, seq_len=4096)
    assert plan.attention_kernel == "cudnn" and backend(plan) == "fused"
    assert cp_comm_type_refusal("megatron", "p2p", 2, 1, model, 4096) == (
        "Transformer Engine's context parallelism runs the sinks' learnable softmax (gpt-oss) only with cp_comm_type "
        "a2a, not p2p")
    assert cp_comm_type_refusal("megatron", "a2a", 2, 1, model, 4096) is None
    cp = make_plan(model, "h100-80gb", engine="megatron", nodes=1, global_batch=32, seq_len=8192, cp=2)
    assert cp.cp_comm_type == "a2a"
    assert main(["plan", "--model", str(path), "--engine", "megatron", "--hardware", "h100-80gb", "--global-batch",
                 "32", "--attention-kernel", "flash"]) == 2
    assert "does not run the sinks' learnable softmax" in capsys.readouterr().err
