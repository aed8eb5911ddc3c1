"""Peak memory measured tensor by tensor, the same way on CPU and on CUDA.

Process RSS counts the Python heap, shared libraries and freed-but-cached pages, so it says little
about what a plan needs. What the cost model predicts is the bytes of live tensors. On CUDA the
caching allocator counts them (``torch.cuda.max_memory_allocated``). On CPU nothing counts them, so
the tracker does, at the tensor level: a ``TorchDispatchMode`` sees every tensor an operator
creates, and a weak reference to each new storage says when the storage is freed (PyTorch keeps a
storage's Python object alive exactly as long as the storage, so the callback fires on the free,
whichever thread drops the last reference; the same technique as
``torch.distributed._tools.mem_tracker``). Counting allocator events through the profiler instead
misses frees made on gloo's worker threads, which drifted by tens of MiB in DeepSpeed runs.

Only tensors created while the tracker runs are counted, so start it before building the model and
the engine, or hand it the tensors that already exist (``tracker.adopt(model.parameters())``).
Regions (``tracker.region("step")``) mark the spans whose peak you want, e.g. the training steps
without the engine's start-up.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _StorageCounter(TorchDispatchMode):
    """Counts the bytes of live storages created under it, and the peak of every open region."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.open_regions: dict[str, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage: nothing new was allocated (and the
        # input may predate the tracker, like a weight whose transpose a linear layer takes).
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in inputs:
                    self._track(storage)
        return out

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count the storages of tensors created before the counter started, each once, until freed."""
        for tensor in tensors:
            if tensor.device.type == "cpu":
                self._track(tensor.untyped_storage())

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = id(storage), storage.nbytes()
        if key in self._refs or size == 0:
            return  # an in-place result or a view of a storage already counted

        def freed(_ref: weakref.ref, key: int = key, size: int = size) -> None:
            with self._lock:
                if self._refs.pop(key, None) is not None:
                    self.live_bytes -= size

        with self._lock:
            self._refs[key] = weakref.ref(storage, freed)
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            for name, peak in self.open_regions.items():
                self.open_regions[name] = max(peak, self.live_bytes)


class MemoryTracker:
    """Counts the bytes of live tensors on ``device`` while active.

    Bytes are relative to the start of tracking (tensors that existed before are not counted,
    unless :meth:`adopt` is given them).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._counter: _StorageCounter | None = None
        self._regions: dict[str, int] = {}
        self._start = 0
        self._peak = 0
        self._final = 0
        self._adopted_cuda: set[int] = set()

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self) -> MemoryTracker:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._counter = _StorageCounter()
            self._counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            self._peak = max(self._peak, torch.cuda.max_memory_allocated(self.device) - self._start)
            self._final = torch.cuda.memory_allocated(self.device) - self._start
            return
        assert self._counter is not None
        self._counter.__exit__(*exc)
        self._peak, self._final = self._counter.peak_bytes, self._counter.live_bytes

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that existed before tracking started (a model's parameters and buffers, an
        optimizer's states) as live from now until their storage is freed; a storage shared by
        several of them (views, tied weights) counts once. Call while the tracker runs.

        On CPU each storage is tracked like a new one (a weak reference notices its free). On CUDA
        the allocator already counts them and will notice their frees, but the bytes are reported
        relative to the start of tracking, so the start is lowered by their bytes instead.
        """
        if self._cuda:
            for tensor in tensors:
                storage = tensor.untyped_storage()
                on_device = tensor.is_cuda and self.device.index in (None, tensor.device.index)
                if on_device and storage.data_ptr() not in self._adopted_cuda:
                    self._adopted_cuda.add(storage.data_ptr())
                    self._start -= storage.nbytes()
            return
        assert self._counter is not None, "tensors are adopted while the tracker runs"
        self._counter.adopt(tensors)

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Mark a span whose peak ``peak_bytes(name)`` reports (the max over all spans of that name)."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self._start
            self._peak = max(self._peak, peak)
        else:
            assert self._counter is not None, "regions are marked while the tracker runs"
            counter = self._counter
            with counter._lock:
                counter.open_regions[name] = counter.live_bytes
            yield
            with counter._lock:
                peak = counter.open_regions.pop(name)
        self._regions[name] = max(self._regions.get(name, 0), peak)

    def peak_bytes(self, region: str | None = None) -> int:
        """Most live tensor bytes at any moment (inside the spans called ``region``, if given)."""
        if region is None:
            return self._peak
        if region not in self._regions:
            raise KeyError(f"no memory region called {region!r} was recorded")
        return self._regions[region]

    def final_bytes(self) -> int:
        """Live tensor bytes when tracking stopped."""
        return self._final
