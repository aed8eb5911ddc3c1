"""benchmarks/fidelity.py prices each published FP8 run as it ran: FP8 pinned with the recipe its
table names, the engine options and attention kernel of its stack, and the FP8 GEMM efficiency
fitted on these runs alone (the 16-bit runs fit the rest)."""

from __future__ import annotations

import dataclasses

from benchmark_modules import load  # tests/ is on sys.path through its conftest


def test_each_fp8_run_is_pinned_as_it_ran_and_kept_out_of_the_16_bit_fit():
    fidelity = load("fidelity")
    runs, excluded = fidelity.load_runs()
    fp8 = {run.id: run for run in runs if run.pins.fp8}
    assert len(fidelity.fp8_runs(runs, "h100")) == 16 and all(r.id in fp8 for r in fidelity.fp8_runs(runs, "h100"))
    llama = fp8["mbridge2511-llama3_8b-8gpu"]  # FP8-CS, the FSDP column set
    assert (llama.pins.fp8_recipe, llama.pins.zero_stage, llama.attention_kernel) == ("tensorwise", 3, "cudnn")
    seventy = fp8["mbridge2602-llama3_70b-64gpu"]  # "FP8": the H100 presets are FP8_CS
    assert seventy.pins.fp8_recipe == "tensorwise" and (seventy.pins.tp, seventy.pins.pp, seventy.pins.vpp) == (4, 8, 5)
    assert seventy.pins.tp_comm_overlap and seventy.pins.fp8_param_gather and not seventy.notes
    assert any("recipe not published" in note for note in fp8["mpt-h100-fp8-1b-s512-8gpu-gbs1792"].notes)
    mpt = fp8["mpt-h100-fp8-3b-s2048-8gpu-gbs480"]  # llm-foundry's later sweep: early stop, fp32 reduce
    assert mpt.recompute_early_stop and mpt.grad_reduce_in_fp32 and mpt.pins.zero_stage == 3
    assert not any(r.pins.fp8 for r in fidelity.fitted_runs(runs, "h100"))
    reasons = dict(excluded)
    assert "not published" in reasons["nemo2407-llama3-8b-8gpu"]


def test_the_fp8_fit_moves_only_the_fp8_gemm_efficiency():
    fidelity = load("fidelity")
    runs, _ = fidelity.load_runs()
    chosen = [r for r in runs if r.id in ("mbridge2511-llama3_8b-8gpu", "mpt-h100-fp8-3b-s2048-8gpu-gbs480")]
    start = fidelity.Constants.of(fidelity.base_hardware("h100-80gb"))
    fitted = fidelity.fit_fp8(fidelity.build_cases(chosen, start), start)
    assert 0.3 <= fitted.fp8_matmul_efficiency <= 1.0
    assert dataclasses.replace(fitted, fp8_matmul_efficiency=start.fp8_matmul_efficiency) == start
