"""benchmarks/fit_device.py fits the device constants to the published runs of benchmarks/fidelity.py;
a run whose step time is set by a cost dsauto knows it does not price is priced and reported but
weighs nothing in that fit (fidelity.Source.fitted)."""

from __future__ import annotations

import dataclasses

import pytest
from benchmark_modules import load  # tests/ is on sys.path through its conftest


def test_deepspeeds_2021_zero3_rows_are_priced_but_weigh_nothing_in_the_fit():
    pytest.importorskip("scipy")
    fidelity, fit_device = load("fidelity"), load("fit_device")
    runs, _ = fidelity.load_runs()
    a100 = fidelity.fitted_runs(runs, "a100")
    unfitted = [r.id for r in a100 if not r.source.fitted]
    assert len(unfitted) == 6 and all(i.startswith("narayanan21-t2-zero3") for i in unfitted)
    by_id = {r.id: r for r in a100}
    picked = [by_id["narayanan21-t1-1.7b"], by_id["narayanan21-t1-3.6b"], by_id["narayanan21-t2-zero3-174.6b-384gpu"]]
    cases = fidelity.build_cases(picked)
    # The source weighs one over its fitted runs: the two Megatron-LM rows, not the ZeRO-3 one.
    assert [c.weight for c in cases] == [0.5, 0.5, 0.0]
    start = fit_device.Constants.of(fidelity.base_hardware("a100-80gb"))
    free = ("matmul_efficiency",)
    with_it = fit_device.fit(cases, start, free=free, starts=())
    without = fit_device.fit(cases[:2], start, free=free, starts=())
    assert with_it == without
    # ... and it would have moved the constant: fitted on alone, the ZeRO-3 row wants slower GEMMs.
    alone = fit_device.fit([dataclasses.replace(cases[2], weight=1.0)], start, free=free, starts=())
    assert alone.matmul_efficiency < without.matmul_efficiency


def test_a_run_is_priced_on_the_network_its_source_states():
    """IBM's blog states its clusters' inter-node bandwidth (400 Gb/s a node on A100, 800 Gb/s on
    H100): those runs are priced with it shared by a node's 8 GPUs, the others on their presets."""
    fidelity = load("fidelity")
    runs, _ = fidelity.load_runs()
    by_id = {r.id: r for r in runs}
    a100, h100 = by_id["ibm-fsdp-llama2-7b-a100"], by_id["ibm-fsdp-llama2-7b-h100"]
    assert (a100.inter_node_gbps, h100.inter_node_gbps) == (400, 800)
    assert fidelity.run_hardware(a100).inter_node.bandwidth_gbps == pytest.approx(6.25)  # GB/s a GPU
    assert fidelity.run_hardware(h100).inter_node.bandwidth_gbps == pytest.approx(12.5)
    assert all(fidelity.run_hardware(r) == fidelity.base_hardware(r.hardware) for r in runs if r.source.key != "ibm")
    # the prediction and the fit's cases see it: the H100 7B row's gathers slow its step
    on_dgx = dataclasses.replace(h100, inter_node_gbps=None)
    assert fidelity.predict(h100, fidelity.Constants.of(fidelity.run_hardware(h100)))[0].prediction.step_seconds > \
        fidelity.predict(on_dgx, fidelity.Constants.of(fidelity.run_hardware(on_dgx)))[0].prediction.step_seconds
    assert fidelity.build_cases([h100])[0].hardware == fidelity.run_hardware(h100)


def test_runs_of_engines_that_reduced_after_the_backward_are_priced_so():
    """Megatron-LM 2021's local DDP all-reduced the gradients after the backward, and DeepSpeed's
    pipeline engine reduces after its flush: those runs are priced unoverlapped
    (--no-overlap-grad-reduce), PyTorch's DDP and Megatron-core's with the overlap they set."""
    fidelity = load("fidelity")
    runs, _ = fidelity.load_runs()
    by_id = {r.id: r for r in runs}
    plain = lambda run: fidelity.predict(run, fidelity.Constants.of(fidelity.run_hardware(run)))[0]  # noqa: E731
    # the paper's launch scripts: PyTorch's DDP without a pipeline, Megatron-LM's local DDP with one
    assert plain(by_id["narayanan21-t1-1.7b"]).overlap_grad_reduce
    local = plain(by_id["narayanan21-t1-76.1b"])
    assert not local.overlap_grad_reduce and local.prediction.exposed_comm_seconds > 0
    assert (local.micro_batch, local.virtual_stages) == (2, 3)  # MBS=2, 5 of its 15 layers a chunk
    after = [r for r in runs if r.source.key in ("mtnlg", "bloom")]
    assert len(after) == 4 and not any(r.source.dp_overlap for r in after)
    assert plain(by_id["dgxc2501-llama31-8b-8gpu"]).overlap_grad_reduce
