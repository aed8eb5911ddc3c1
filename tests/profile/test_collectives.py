"""Collective measurement: the alpha-beta fit against synthetic data from the cost model's own
formulas, the group layout, and a real two-rank gloo run."""

import json
import math
import os
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsauto.cost.collectives import Group
from dsauto.errors import DsautoError
from dsauto.profile.collectives import (
    CollectiveFit,
    GroupKind,
    fit_alpha_beta,
    group_kinds,
    measure_collectives,
    model_coefficients,
)
from dsauto.serde import from_dict, to_dict

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
SIZES_BYTES = [64 * 1024 * 4**i for i in range(6)]


def synthetic(op, n, latency_seconds, bandwidth_gbps):
    """Times of ``op`` that the cost model itself predicts for these parameters."""
    group = Group(n, bandwidth_gbps * 1e9, latency_seconds)
    return [(size, getattr(group, op)(size)) for size in SIZES_BYTES]


@pytest.mark.parametrize(
    "op, n", [(op, n) for op in OPS[:3] for n in (2, 4, 8)] + [("send_recv", 2)]  # a send has two ends
)
def test_fit_recovers_the_cost_models_parameters_exactly(op, n):
    steps, factor = model_coefficients(op, n)
    latency, bandwidth = fit_alpha_beta(synthetic(op, n, 15e-6, 120.0), factor, steps)
    assert latency == pytest.approx(15e-6, rel=1e-9)
    assert bandwidth == pytest.approx(120.0, rel=1e-9)


def test_model_coefficients_are_the_ring_factors_of_thakur_et_al():
    # Thakur, Rabenseifner and Gropp 2005: ring all-reduce 2(n-1) steps moving 2(n-1)/n of the
    # data; all-gather and reduce-scatter n-1 steps moving (n-1)/n; a send one step, all of it.
    assert model_coefficients("all_reduce", 8) == pytest.approx((14, 2 * 7 / 8))
    assert model_coefficients("all_gather", 8) == pytest.approx((7, 7 / 8))
    assert model_coefficients("reduce_scatter", 4) == pytest.approx((3, 3 / 4))
    assert model_coefficients("send_recv", 2) == pytest.approx((1, 1))


@pytest.mark.parametrize("seed", range(5))
def test_fit_recovers_parameters_from_noisy_times(seed):
    rng = np.random.default_rng(seed)
    steps, factor = model_coefficients("all_reduce", 4)
    samples = [
        (size, seconds * rng.lognormal(0.0, 0.03))  # 3% timing noise, three repeats per size
        for size, seconds in synthetic("all_reduce", 4, 20e-6, 10.0)
        for _ in range(3)
    ]
    latency, bandwidth = fit_alpha_beta(samples, factor, steps)
    assert latency == pytest.approx(20e-6, rel=0.1)
    assert bandwidth == pytest.approx(10.0, rel=0.1)


def test_a_negative_latency_is_clamped_to_zero_and_the_bandwidth_refitted():
    samples = synthetic("send_recv", 2, 0.0, 5.0)
    samples[0] = (samples[0][0], samples[0][1] * 0.8)  # the smallest message measured fast
    unclamped = np.polyfit([s for s, _ in samples], [t for _, t in samples], 1)
    assert unclamped[1] < 0  # a plain line through these points has a negative intercept
    latency, bandwidth = fit_alpha_beta(samples, 1.0, 1.0)
    assert latency == 0.0
    assert bandwidth == pytest.approx(5.0, rel=0.1)


def test_times_that_do_not_grow_with_size_are_refused():
    flat = [(size, 1e-3 * (1 - i * 0.01)) for i, size in enumerate(SIZES_BYTES)]
    with pytest.raises(DsautoError, match="do not grow with message size"):
        fit_alpha_beta(flat, 1.0)


def test_one_message_size_is_not_enough_to_fit_two_parameters():
    with pytest.raises(DsautoError, match="at least two message sizes"):
        fit_alpha_beta([(1024, 1e-5), (1024, 1.1e-5)], 1.0)


def test_groups_inside_and_across_nodes():
    assert group_kinds(8, 4) == (
        GroupKind("intra_node", 2, ((0, 1), (2, 3), (4, 5), (6, 7))),
        GroupKind("intra_node", 4, ((0, 1, 2, 3), (4, 5, 6, 7))),
        GroupKind("inter_node", 2, ((0, 4), (1, 5), (2, 6), (3, 7))),
    )


def test_a_node_of_six_is_measured_at_two_four_and_six_ranks():
    assert group_kinds(6, 6) == (
        GroupKind("intra_node", 2, ((0, 1), (2, 3), (4, 5))),
        GroupKind("intra_node", 4, ((0, 1, 2, 3),)),  # ranks 4 and 5 sit this one out
        GroupKind("intra_node", 6, ((0, 1, 2, 3, 4, 5),)),
    )


def test_three_nodes_are_measured_across_two_and_three():
    kinds = group_kinds(6, 2)
    assert [(k.scope, k.size) for k in kinds] == [("intra_node", 2), ("inter_node", 2), ("inter_node", 3)]
    assert kinds[2].groups == ((0, 2, 4), (1, 3, 5))


def test_one_rank_has_nothing_to_measure_and_uneven_nodes_are_refused():
    assert group_kinds(1, 1) == ()
    with pytest.raises(DsautoError, match=r"world size \(6\) is not a multiple of the ranks per node \(4\)"):
        group_kinds(6, 4)


def test_a_fit_round_trips_and_predicts_through_the_cost_model():
    fit = CollectiveFit("all_gather", 4, "inter_node", 1e-5, 25.0, ((1024, 3e-5), (2048, 4e-5)))
    assert from_dict(CollectiveFit, json.loads(json.dumps(to_dict(fit))), "fit") == fit
    assert fit.predict_seconds(1e6) == pytest.approx(3 * 1e-5 + 0.75 * 1e6 / 25e9)
    with pytest.raises(DsautoError, match="bandwidth_gbps must be positive"):
        from_dict(CollectiveFit, {**to_dict(fit), "bandwidth_gbps": 0}, "fit")


@pytest.fixture
def one_gloo_rank(tmp_path, monkeypatch):
    """A one-rank gloo job in this process, with no launcher variables set: the one an in-process
    profile of an earlier test keeps for the process's life (dsauto.profile.engine), or a new one."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    kept = dist.is_initialized()
    if kept:
        assert dist.get_world_size() == 1
    else:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                                world_size=1, timeout=timedelta(seconds=30))
    yield monkeypatch
    if not kept:
        dist.destroy_process_group()


def test_without_a_launcher_the_node_layout_must_be_given(one_gloo_rank):
    with pytest.raises(DsautoError, match=r"LOCAL_WORLD_SIZE \(torchrun\), LOCAL_SIZE \(deepspeed\)"):
        measure_collectives()
    assert measure_collectives(local_world_size=1) == ()  # one rank: no group to measure


def test_ranks_not_numbered_node_by_node_are_refused(one_gloo_rank):
    one_gloo_rank.setenv("LOCAL_SIZE", "1")  # the deepspeed launcher's name
    one_gloo_rank.setenv("LOCAL_RANK", "1")
    with pytest.raises(DsautoError, match="not numbered node by node"):
        measure_collectives()


# --- a real run: two gloo ranks on this machine -------------------------------------------------

# Up to 16 MiB: on a shared, loaded machine a small message can take a few ms now and then, and
# the largest must still stand clearly above that.
RUN_SIZES_BYTES = (16 * 1024, 256 * 1024, 16 * 1024 * 1024)


def _measure_on_two_ranks(rank, rendezvous, out_dir):
    # As torchrun would set them for two ranks on one node.
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        lines = []
        intra = measure_collectives(RUN_SIZES_BYTES, warmup=1, repeats=5, progress=lines.append)
        # The same two ranks, declared to be on two nodes, exercise the inter-node groups.
        inter = measure_collectives(RUN_SIZES_BYTES, warmup=1, repeats=5, local_world_size=1)
        result = {"fits": [to_dict(f) for f in intra + inter], "lines": lines}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_measure_every_op(tmp_path):
    context = mp.start_processes(_measure_on_two_ranks, args=(tmp_path / "rendezvous", tmp_path),
                                 nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the two-rank measurement did not finish in 120 s")

    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["fits"] == results[1]["fits"]  # every rank gets the same answer
    fits = [from_dict(CollectiveFit, f, "fit") for f in results[0]["fits"]]
    assert sorted((f.scope, f.op, f.group_size) for f in fits) == sorted(
        (scope, op, 2) for scope in ("intra_node", "inter_node") for op in OPS
    )
    for fit in fits:
        assert 0 < fit.bandwidth_gbps < math.inf and fit.latency_seconds >= 0
        sizes = [size for size, _ in fit.samples]
        seconds = [sec for _, sec in fit.samples]
        assert sizes == list(RUN_SIZES_BYTES)
        # A thousand times the bytes take longer, whatever else runs on the machine.
        assert seconds[-1] > seconds[0], fit
    # Progress comes from rank 0 only, one line per fit of the first call.
    assert len(results[0]["lines"]) == 4 and results[1]["lines"] == []
    assert results[0]["lines"][0].startswith("all_reduce intra_node n=2: latency ")
