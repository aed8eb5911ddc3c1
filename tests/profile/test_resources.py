"""Host memory of CPU ranks is estimated before launching them, and a launch that would not fit is
refused with the numbers; the CPU time other processes take during a trial is measured."""

from __future__ import annotations

import pytest

from dsauto.errors import DsautoError
from dsauto.profile import resources
from dsauto.profile.resources import (
    PROCESS_BYTES,
    CpuMeter,
    available_memory_bytes,
    check_fits,
    profiling_rank_bytes,
)
from dsauto.spec.loaders import load_model
from dsauto.units import GiB


def test_available_memory_is_known_and_positive():
    assert 0 < available_memory_bytes() < 2**60


def test_the_profiling_estimate_grows_with_the_work():
    tiny, big = load_model("gpt-tiny"), load_model("llama3-8b")
    small = profiling_rank_bytes(tiny, "fp32", 64, (1, 2), (1,))
    assert PROCESS_BYTES < small < PROCESS_BYTES + GiB
    assert profiling_rank_bytes(tiny, "fp32", 256, (1, 8), (1,)) > small
    # llama3-8b's head alone keeps 128256 logits per token: 16K tokens of them are over 20 GiB.
    assert profiling_rank_bytes(big, "bf16", 2048, (1, 2, 4, 8), (1,)) > 20 * GiB


def test_a_launch_that_would_not_fit_is_refused_with_numbers(monkeypatch):
    monkeypatch.setattr(resources, "available_memory_bytes", lambda: 8 * GiB)
    check_fits("Profiling x", 2, GiB, "do less")
    with pytest.raises(DsautoError, match=r"^Profiling x on 8 CPU ranks needs about 24.2 GiB of host memory \(3.0 GiB "
                                          r"per rank\), but this machine has 8.0 GiB available; do less\.$"):
        check_fits("Profiling x", 8, 3 * GiB, "do less")


class _Clock:
    """Stands for time in :func:`resources.await_fits`: sleeping advances it, and other processes
    free memory as it goes."""

    def __init__(self, available: list[int]) -> None:
        self.now, self.available = 0.0, available

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if len(self.available) > 1:
            self.available.pop(0)


def _clocked(monkeypatch, total: int, available: list[int]) -> _Clock:
    clock = _Clock(available)
    monkeypatch.setattr(resources.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(resources.time, "sleep", clock.sleep)
    monkeypatch.setattr(resources, "available_memory_bytes", lambda: clock.available[0])
    monkeypatch.setattr(resources, "total_memory_bytes", lambda: total)
    return clock


def test_a_launch_waits_while_other_processes_hold_the_memory_it_needs(monkeypatch):
    # Another trial of a shared study holds the memory for three polls, then ends.
    clock = _clocked(monkeypatch, 24 * GiB, [GiB, GiB, GiB, 8 * GiB])
    said: list[str] = []
    resources.await_fits("Training x", 2, GiB, "not launched", wait_seconds=60, say=said.append)
    assert clock.now == 3 * resources.MEMORY_POLL_SECONDS
    assert said == ["waiting up to 60 s for 2.2 GiB of host memory (1.0 GiB available: other processes hold "
                    "the rest)"]


def test_a_launch_is_refused_when_the_memory_is_not_freed_in_time(monkeypatch):
    clock = _clocked(monkeypatch, 24 * GiB, [GiB])
    with pytest.raises(DsautoError, match=r"needs about 2.2 GiB of host memory .* has 1.0 GiB available; no\.$"):
        resources.await_fits("Training x", 2, GiB, "no", wait_seconds=30)
    assert clock.now == 30


def test_a_launch_the_machine_could_never_hold_is_refused_without_waiting(monkeypatch):
    clock = _clocked(monkeypatch, 4 * GiB, [GiB, 8 * GiB])
    with pytest.raises(DsautoError, match=r"needs about 6.2 GiB"):
        resources.await_fits("Training x", 2, 3 * GiB, "no", wait_seconds=30)
    assert clock.now == 0


def test_the_total_memory_is_at_least_what_is_available():
    assert resources.total_memory_bytes() >= available_memory_bytes() > 0


def test_contention_is_other_work_beyond_the_free_cores(monkeypatch):
    meter = CpuMeter()
    meter.cores = 4
    assert not meter.contended(1.9, ranks=2)  # two cores were free for it
    assert meter.contended(2.6, ranks=2)
    assert meter.contended(0.6, ranks=4)
    assert meter.other_load() >= 0.0
