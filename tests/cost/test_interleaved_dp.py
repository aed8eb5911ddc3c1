"""An interleaved pipeline's data-parallel traffic, chunk by chunk, as Megatron-LM launches it with
--overlap-grad-reduce and --overlap-param-gather (schedules.py, forward_backward_pipelining_with_
interleaving, grad_sync_func and param_sync_func): each chunk's reduction launched whole once its
last micro-batch is through its backward, each chunk's gather a chunk ahead of its forward."""

from __future__ import annotations

import pytest

from dsauto.cost.layer import CostModel
from dsauto.cost.step import _interleaved_exposed, _megatron_exposed
from dsauto.cost.strategy import Strategy
from dsauto.parallel import ParallelDims
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.loaders import load_hardware
from dsauto.spec.training import TrainSpec


@pytest.fixture(scope="module")
def cost() -> CostModel:
    strategy = Strategy(dims=ParallelDims(dp=2, tp=1, pp=4), zero_stage=1, micro_batch=1, grad_accum=8, sequence_parallel=False,
                        engine="megatron", virtual_stages=2)
    return CostModel(ClusterSpec(load_hardware("h100-80gb"), nodes=1, gpus_per_node=8),
                     TrainSpec(global_batch=16, seq_len=2048, dtype="bf16", flash_attention=True), strategy, 4096)


def lag(cost: CostModel) -> float:
    return 1 - cost.device.comm_overlap_efficiency


def test_the_first_chunks_reduction_is_exposed_whole_and_the_others_slow_the_later_passes(cost):
    """Launched as the step's last backward ends, the first chunk's reduction hides behind nothing;
    the second's runs beside the first chunk's pp passes, which it slows by the overlap's lag."""
    grads = _interleaved_exposed(cost, [0.0, 0.0], [0.100, 0.100], [0.060, 0.060], [0.0, 0.0], 4, 0.01)
    assert grads == pytest.approx(0.060 + lag(cost) * 0.060)
    # One chunk a rank: the old price, every bucket beside the last micro-batch's backward.
    assert _megatron_exposed(cost, 0.0, 0.200, 0.120, 0.0, 0.01) == pytest.approx(lag(cost) * 0.120)


def test_reductions_queue_on_the_one_data_parallel_group(cost):
    """A later chunk's reduction longer than the passes after it runs into the first chunk's: the
    queue, not each window alone, sets what is left when the backward ends."""
    grads = _interleaved_exposed(cost, [0.0, 0.0], [0.010, 0.010], [0.030, 0.200], [0.0, 0.0], 4, 0.0)
    # Chunk 1's reduction starts at 40 ms (its four passes), ends at 240 ms; chunk 0's then runs to
    # 270 ms, where the backward ended at 80 ms.
    tail = 0.270 - 0.080
    assert grads == pytest.approx(tail + lag(cost) * (0.230 - tail))


def test_each_chunk_reduces_its_own_traffic(cost):
    """The embedding on the first chunk of the first rank makes that chunk's reduction, the exposed one,
    the larger: the same traffic split unevenly costs more when the first chunk holds more."""
    even = _interleaved_exposed(cost, [0.0, 0.0], [0.1, 0.1], [0.05, 0.05], [0.0, 0.0], 4, 0.0)
    embedding_first = _interleaved_exposed(cost, [0.0, 0.0], [0.1, 0.1], [0.08, 0.02], [0.0, 0.0], 4, 0.0)
    assert embedding_first > even


def test_gathers_ahead_of_their_chunk_wait_only_when_not_through(cost):
    """The first chunk gathers bucket by bucket beside its first forward; the second, launched at the
    step's start behind it, has the first chunk's pp forward passes to finish in."""
    hidden = _interleaved_exposed(cost, [0.050, 0.050], [0.0, 0.0], [0.0, 0.0], [0.020, 0.020], 4, 0.0)
    assert hidden == pytest.approx(lag(cost) * 0.020 + lag(cost) * 0.020)
    late = _interleaved_exposed(cost, [0.010, 0.010], [0.0, 0.0], [0.0, 0.0], [0.020, 0.100], 4, 0.0)
    # The first chunk's forward runs `first` late; the second gather ends at 120 ms, where its chunk
    # starts at 40 ms + first: 80 ms - first of waiting.
    first = cost.overlapped(0.010, 0.020) - 0.010
    assert late == pytest.approx(first + (0.080 - first) + lag(cost) * (0.100 - (0.080 - first)))


def test_a_late_first_gather_delays_the_later_chunks_once(cost):
    """The first chunk's gather longer than its pp forward passes (the embedding's, on a slow network)
    makes the step wait once: the second chunk, with nothing to gather, adds no wait of its own."""
    late_first = _interleaved_exposed(cost, [0.010, 0.010], [0.0, 0.0], [0.0, 0.0], [0.100, 0.0], 4, 0.0)
    assert late_first == pytest.approx(cost.overlapped(0.010, 0.100) - 0.010)


def test_a_gather_is_launched_when_the_chunk_before_it_really_starts(cost):
    """Four chunks: the second's gather, late, delays the third chunk's start, and so the fourth's
    launch; the fourth's wait counts from that delayed start."""
    exposed = _interleaved_exposed(cost, [0.010] * 4, [0.0] * 4, [0.0] * 4, [0.0, 0.100, 0.0, 0.050], 4, 0.0)
    # Chunk 1's gather ends at 100 ms, its chunk was due at 40 ms: 60 ms late. Chunk 3's gather is
    # launched as chunk 2 starts (80 + 60 = 140 ms) and ends at 190 ms; chunk 3 starts at 120 + 60 =
    # 180 ms: 10 ms more.
    assert exposed == pytest.approx(0.070 + lag(cost) * (0.150 - 0.070))


def test_a_launch_without_the_overlap_flags_waits_for_the_whole_traffic(cost):
    """Megatron-LM's default launch (no --overlap-grad-reduce): each chunk's gradients are reduced at once
    after the backward (finish_grad_sync starts the reduction and waits on it), and without
    --overlap-param-gather the parameters are gathered at once after the optimizer step
    (step_with_ready_grads): each whole, exposed, with one chunk a rank or several."""
    args = ([0.05, 0.05], [0.1, 0.1], [0.03, 0.04], [0.02, 0.01], 4, 0.1)
    assert _interleaved_exposed(cost, *args, False, False) == pytest.approx(0.07 + 0.03)
    overlapped = _interleaved_exposed(cost, *args)
    assert overlapped < _interleaved_exposed(cost, *args, True, False) < 0.07 + 0.03
    assert _megatron_exposed(cost, 0.1, 0.2, 0.07, 0.03, 0.1, False, False) == pytest.approx(0.10)
    assert _megatron_exposed(cost, 0.1, 0.2, 0.07, 0.03, 0.1, True, False) == pytest.approx(
        _megatron_exposed(cost, 0.1, 0.2, 0.07, 0.0, 0.1) + 0.03)
