"""Peak memory measured tensor by tensor, the same way on CPU and on CUDA.

Process RSS counts the Python heap, shared libraries and freed-but-cached pages, so it says little
about what a plan needs. What the cost model predicts is the bytes of live tensors. On CUDA the
caching allocator counts them (``torch.cuda.max_memory_allocated``). On CPU nothing counts them by
default, but the profiler does: with ``profile_memory=True`` every allocation and free of the CPU
allocator is reported as a ``[memory]`` event with its size (c10's ``ProfiledCPUMemoryReporter``,
enabled by the profiler for the profiling thread and the threads it propagates to). Summing those
events in time order gives the live bytes at every moment, hence the peak.

On CPU only tensors allocated while the tracker runs are counted, so start it before building the
model and the engine. Regions (``tracker.region("step")``) mark the spans whose peak you want,
e.g. the training steps without the engine's start-up.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# Regions are marked by allocating and freeing a byte buffer of an odd size no real tensor has.
_MARKER_BYTES = 7_777_777


@dataclass
class MemoryTracker:
    """Counts the bytes of live tensors on ``device`` while active; ``peak_bytes`` once it stops.

    Bytes are relative to the start of tracking (tensors that existed before are not counted).
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _profiler: profile | None = None
    _cuda_regions: dict[str, int] = field(default_factory=dict)
    _cuda_start: int = 0
    _cuda_peak: int = 0
    _timeline: list[int] = field(default_factory=list)
    _marker_sizes: dict[str, int] = field(default_factory=dict)
    _region_peaks: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self) -> MemoryTracker:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        else:
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            self._cuda_peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_start
            return
        assert self._profiler is not None
        self._profiler.__exit__(*exc)
        events = self._cpu_memory_events(self._profiler)
        self._profiler = None
        # Replay the allocations in order. A region's bounds are marker allocations of a size no
        # tensor has (see ``region``); they are matched by size, so no clock is needed, and they are
        # left out of the live bytes.
        markers = {size: name for name, size in self._marker_sizes.items()}
        live, open_regions = 0, {}
        self._timeline, self._region_peaks = [], {}
        for delta in events:
            if delta in markers:
                name = markers[delta]
                if name in open_regions:
                    peak = max(open_regions.pop(name), live)
                    self._region_peaks[name] = max(self._region_peaks.get(name, 0), peak)
                else:
                    open_regions[name] = live
                continue
            if -delta in markers:
                continue
            live += delta
            self._timeline.append(live)
            for name in open_regions:
                open_regions[name] = max(open_regions[name], live)

    @staticmethod
    def _cpu_memory_events(prof: profile) -> list[int]:
        """Byte deltas of the CPU allocations and frees seen while profiling, in time order.

        A free is kept only when its allocation was seen too: the CPU allocator's reporter also
        reports frees of blocks allocated under an earlier profiling session of the process. Only
        the Chrome trace carries the block address that pairs them, so it is written and read back.
        """
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
        events = sorted((e["ts"], e["args"]) for e in trace["traceEvents"]
                        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
        seen: set[int] = set()
        deltas = []
        for _, args in events:
            size, address = int(args["Bytes"]), args["Addr"]
            if size > 0:
                seen.add(address)
            elif address in seen:
                seen.discard(address)
            else:
                continue
            deltas.append(size)
        return deltas

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Mark a span whose peak ``peak_bytes(name)`` reports (the max over all spans of that name)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_start
            self._cuda_regions[name] = max(self._cuda_regions.get(name, 0), peak)
            self._cuda_peak = max(self._cuda_peak, peak)
            return
        size = self._marker_sizes.setdefault(name, _MARKER_BYTES + len(self._marker_sizes))
        torch.empty(size, dtype=torch.uint8)  # allocated and freed at once: marks the start
        yield
        torch.empty(size, dtype=torch.uint8)  # and the end

    def peak_bytes(self, region: str | None = None) -> int:
        """Most live tensor bytes at any moment (inside the spans called ``region``, if given)."""
        peaks = self._cuda_regions if self._cuda else self._region_peaks
        if region is None:
            return self._cuda_peak if self._cuda else max(self._timeline, default=0)
        if region not in peaks:
            raise KeyError(f"no memory region called {region!r} was recorded")
        return peaks[region]

    def final_bytes(self) -> int:
        """Live tensor bytes when tracking stopped (CPU), or allocated now (CUDA)."""
        if self._cuda:
            return torch.cuda.memory_allocated(self.device) - self._cuda_start
        return self._timeline[-1] if self._timeline else 0
