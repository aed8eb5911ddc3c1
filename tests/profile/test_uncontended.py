"""Layer timings on a shared CPU: each run scaled to its time on the core, from the scheduler's
statistics; without them, only the runs during which the rank kept its core. The clocks are driven
by the test (a loaded machine must not change the outcome)."""

from __future__ import annotations

import itertools

import pytest
import torch

import dsauto.profile.layers as layers
import dsauto.profile.resources as resources
from dsauto.profile.layers import uncontended

CPU = torch.device("cpu")


class Clocks:
    """Wall and process CPU clocks that the runs advance."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def run(self, computed: float, off_core: float) -> None:
        self.wall += computed + off_core
        self.cpu += computed


@pytest.fixture()
def clocks(monkeypatch):
    """The clocks, without the scheduler's statistics: runs are kept or left out."""
    c = Clocks()
    monkeypatch.setattr(layers.time, "perf_counter", lambda: c.wall)
    monkeypatch.setattr(layers.time, "process_time", lambda: c.cpu)
    monkeypatch.setattr(resources, "run_queue_seconds", lambda whole_process=False: (0.0, 0.0))
    return c


def test_with_the_schedulers_statistics_each_run_is_scaled_to_its_time_on_the_core(monkeypatch):
    c = Clocks()
    c.run(1.0, 0.5)  # the thread has run before
    monkeypatch.setattr(resources, "run_queue_seconds", lambda whole_process=False: (c.cpu, c.wall - c.cpu))
    calls = itertools.count()

    def run():  # every other run waits for the core as long as it computes: its times are doubled
        off = 0.01 if next(calls) % 2 else 0.0
        c.run(0.01, off)
        return (0.004 * (1 + off / 0.01), 0.006 * (1 + off / 0.01))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread computes: the statistics of the calling thread are its own
    try:
        assert uncontended(run, CPU, repeats=4) == [pytest.approx((0.004, 0.006))] * 4
    finally:
        torch.set_num_threads(threads)


def test_runs_that_waited_off_the_core_are_left_out(clocks):
    calls = itertools.count()

    def run():  # every third run loses its core for as long as it computes
        n = next(calls)
        clocks.run(0.01, 0.01 if n % 3 == 2 else 0.0)
        return (n, 0.0)

    assert [n for n, _ in uncontended(run, CPU, repeats=4)] == [0, 1, 3, 4]


def test_a_little_time_off_the_core_is_tolerated(clocks):
    def run():
        clocks.run(0.01, 0.0005)
        return (1.0, 2.0)

    assert len(uncontended(run, CPU, repeats=3)) == 3


def test_when_contention_never_lets_up_the_runs_tried_are_kept(clocks):
    def run():
        clocks.run(0.01, 0.01)
        return (1.0, 2.0)

    assert len(uncontended(run, CPU, repeats=3)) == 9  # three times the repeats were tried


def test_on_an_accelerator_every_run_counts(clocks):
    calls = itertools.count()

    def run():
        clocks.run(0.01, 0.01)
        return (next(calls), 0.0)

    assert uncontended(run, torch.device("meta"), repeats=3) == [(0, 0.0), (1, 0.0), (2, 0.0)]


def test_collective_timings_are_scaled_to_the_ranks_time_on_their_cores(tmp_path, monkeypatch):
    from datetime import timedelta

    import torch.distributed as dist

    import dsauto.profile.collectives as collectives

    c = Clocks()
    c.run(1.0, 0.0)
    monkeypatch.setattr(collectives.time, "perf_counter", lambda: c.wall)
    monkeypatch.setattr(collectives, "run_queue_seconds", lambda whole_process=False: (c.cpu, c.wall - c.cpu))
    # A one-rank group; an earlier test in this process may have left its own one-rank group (DeepSpeed
    # keeps the default group of the engine it measured), which serves as well.
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                                timeout=timedelta(seconds=30))
    assert dist.get_world_size() == 1
    try:
        timer = collectives._Timer(CPU, warmup=0, repeats=3)
        # each call computes 2 ms and waits 6 ms for the core: 2 ms on a core of its own
        assert timer.median_max_seconds(lambda: c.run(0.002, 0.006)) == pytest.approx(0.002)
    finally:
        if started:
            dist.destroy_process_group()
