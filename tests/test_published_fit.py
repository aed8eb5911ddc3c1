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
