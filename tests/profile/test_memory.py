"""The tensor-level memory tracker counts what is allocated and freed, region by region."""

import torch

from dsauto.profile.memory import MemoryTracker

MB = 1_000_000


def test_peak_and_regions_count_live_tensor_bytes():
    with MemoryTracker() as tracker:
        kept = torch.empty(4 * MB, dtype=torch.uint8)
        with tracker.region("step"):
            a = torch.empty(8 * MB, dtype=torch.uint8)
            b = torch.empty(2 * MB, dtype=torch.uint8)
            del a, b
        big = torch.empty(16 * MB, dtype=torch.uint8)
        del big
        with tracker.region("between"):
            pass
    assert tracker.peak_bytes() == 20 * MB  # kept + big
    assert tracker.peak_bytes("step") == 14 * MB  # kept + a + b
    assert tracker.peak_bytes("between") == 4 * MB
    assert tracker.final_bytes() == 4 * MB
    del kept


def test_tensors_from_before_or_from_an_earlier_session_are_not_counted():
    old = torch.empty(32 * MB, dtype=torch.uint8)
    with MemoryTracker():
        survivor = torch.empty(3 * MB, dtype=torch.uint8)
    with MemoryTracker() as tracker:
        del old, survivor  # frees of blocks this session never saw allocated
        x = torch.empty(1 * MB, dtype=torch.uint8)
    assert tracker.peak_bytes() == 1 * MB
    assert tracker.final_bytes() == 1 * MB
    del x


def test_the_same_region_name_reports_its_largest_span():
    with MemoryTracker() as tracker:
        for size in (1, 5, 2):
            with tracker.region("step"):
                t = torch.empty(size * MB, dtype=torch.uint8)
                del t
    assert tracker.peak_bytes("step") == 5 * MB


def test_autograd_activations_show_in_the_peak():
    layer = torch.nn.Linear(256, 1024)
    x = torch.randn(64, 256)
    with MemoryTracker() as tracker:
        with tracker.region("forward"):
            y = layer(x)  # output 64 x 1024 fp32 = 256 KiB, kept
    assert tracker.peak_bytes("forward") >= 64 * 1024 * 4
    del y


def test_views_of_tensors_from_before_tracking_are_not_counted():
    layer = torch.nn.Linear(1024, 1024)  # 4 MiB of weight, made before tracking
    x = torch.randn(8, 1024)
    with MemoryTracker() as tracker:
        view = layer.weight.t()  # no new storage
        y = layer(x)  # only the 8 x 1024 output is new
    assert tracker.peak_bytes() == 8 * 1024 * 4
    del view, y
