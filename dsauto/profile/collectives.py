"""Measure the collectives' latency and bandwidth on the cluster at hand, in the cost model's terms.

Every rank of an initialised ``torch.distributed`` job calls :func:`measure_collectives`. It times
all-reduce, all-gather, reduce-scatter and send/recv over a range of message sizes, on groups inside
one node and, when there are several nodes, on groups with one rank per node, and fits the
alpha-beta model (Hockney 1994, "The communication challenge for MPP: Intel Paragon and Meiko CS-2")
to each: ``time = steps · alpha + ring_factor · bytes / bandwidth``.

The step counts and ring factors are those of :mod:`dsauto.cost.collectives` (Thakur, Rabenseifner
and Gropp 2005, "Optimization of Collective Communication Operations in MPICH"): all-reduce
``2(n-1)`` steps and ``2(n-1)/n`` of the bytes, all-gather and reduce-scatter ``n-1`` steps and
``(n-1)/n`` of the full size, send/recv one step and all the bytes. They are read from
:class:`~dsauto.cost.collectives.Group` itself, so that a fitted ``latency_seconds`` and
``bandwidth_gbps`` mean exactly what the cost model means by them: per-step latency and *bus*
bandwidth, the bandwidth NCCL's tests report as "busbw".
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from dsauto.cost.collectives import Group
from dsauto.profile.resources import run_queue_seconds
from dsauto.errors import DsautoError
from dsauto.units import format_bytes, format_seconds

Op = Literal["all_reduce", "all_gather", "reduce_scatter", "send_recv"]
Scope = Literal["intra_node", "inter_node"]

COLLECTIVE_OPS: tuple[Op, ...] = ("all_reduce", "all_gather", "reduce_scatter")
"""The collectives measured on every group; send/recv is measured on the groups of two."""

DEFAULT_SIZES_BYTES: tuple[int, ...] = tuple(64 * 1024 * 4**i for i in range(6))
"""64 KiB to 64 MiB in steps of 4: small sizes pin down the latency, large ones the bandwidth."""

# (launcher, variable with the ranks per node, variable with this rank's index on its node)
_LOCAL_ENV = (
    ("torchrun", "LOCAL_WORLD_SIZE", "LOCAL_RANK"),
    ("deepspeed", "LOCAL_SIZE", "LOCAL_RANK"),
    ("mpirun", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
)


@dataclass(frozen=True)
class CollectiveFit:
    """latency + bytes / bandwidth fitted to measured times of one collective on one kind of group."""

    op: Op
    """The operation: ``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``send_recv``."""
    group_size: int
    """Ranks in the group (2 for ``send_recv``)."""
    scope: Scope
    """``intra_node``: all members on one node; ``inter_node``: one member on each of ``group_size``
    nodes."""
    latency_seconds: float
    """Fitted alpha: the latency of one ring step, as ``Group.latency_seconds`` (an all-reduce of
    ``n`` ranks pays it ``2(n-1)`` times, an all-gather ``n-1`` times, a send once)."""
    bandwidth_gbps: float
    """Fitted bus bandwidth, GB/s (10^9 bytes per second), after dividing out the ring factor; equal
    to ``Group.bandwidth_bytes_per_second / 1e9``, that is to ``LinkSpec.bandwidth_gbps *
    LinkSpec.efficiency`` of the link the group uses."""
    samples: tuple[tuple[int, float], ...]
    """The measurements fitted: (message bytes, median seconds of the slowest rank). The bytes are
    the full size (the gathered output of an all-gather, the input of a reduce-scatter); a
    send/recv's seconds are half a ping-pong's round trip."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2, got {self.group_size}")
        if not self.latency_seconds >= 0:
            raise ValueError(f"latency_seconds must be at least 0, got {self.latency_seconds}")
        if not 0 < self.bandwidth_gbps < math.inf:
            raise ValueError(f"bandwidth_gbps must be positive and finite, got {self.bandwidth_gbps}")

    def group(self) -> Group:
        """The cost model's group with this fit's latency and bandwidth."""
        return Group(self.group_size, self.bandwidth_gbps * 1e9, self.latency_seconds)

    def predict_seconds(self, size_bytes: float) -> float:
        """The cost model's time for this operation on ``size_bytes`` with the fitted parameters."""
        return float(getattr(self.group(), self.op)(size_bytes))


@dataclass(frozen=True)
class GroupKind:
    """Disjoint groups of one size and scope, measured at the same time."""

    scope: Scope
    """``intra_node`` or ``inter_node``."""
    size: int
    """Ranks in each group."""
    groups: tuple[tuple[int, ...], ...]
    """Global ranks of each group; ranks in none of them sit the measurement out."""


def model_coefficients(op: Op, group_size: int) -> tuple[float, float]:
    """``(latency_steps, ring_factor)`` of ``op`` on ``group_size`` ranks in the cost model.

    Read off :class:`Group` rather than written out again, so that the fit cannot drift from the
    model it feeds: with no latency and 1 byte/s, one byte takes ``ring_factor`` seconds; with
    infinite bandwidth and 1 s per step, it takes ``latency_steps`` seconds.
    """
    ring_factor = getattr(Group(group_size, 1.0, 0.0), op)(1.0)
    latency_steps = getattr(Group(group_size, math.inf, 1.0), op)(1.0)
    return float(latency_steps), float(ring_factor)


def fit_alpha_beta(
    samples: Sequence[tuple[int, float]], ring_factor: float, latency_steps: float = 1.0
) -> tuple[float, float]:
    """Fits ``seconds = latency_steps · alpha + ring_factor · bytes / (bandwidth_gbps · 1e9)``.

    Returns ``(alpha in seconds, bandwidth_gbps)``. The fit is least squares on *relative* errors:
    the sizes span three decades, and an ordinary fit would let the largest messages decide alpha
    too, which the small ones measure. Timing noise is also roughly proportional to the time. When
    the best fit has a negative alpha it is clamped to 0 and the bandwidth refitted (the optimum of
    this convex problem under ``alpha >= 0``).
    """
    if len({size for size, _ in samples}) < 2:
        raise DsautoError(
            f"Fitting latency and bandwidth needs at least two message sizes, got "
            f"{len({size for size, _ in samples})}; measure more sizes."
        )
    sizes = np.array([size for size, _ in samples], dtype=np.float64)
    seconds = np.array([sec for _, sec in samples], dtype=np.float64)
    if not np.all(np.isfinite(seconds)) or np.any(seconds <= 0):
        raise DsautoError(f"Measured times must be positive and finite, got {seconds.tolist()}.")
    # Unknowns: alpha and beta = 1 / bandwidth (seconds per byte). Dividing each row by its
    # measured time turns absolute residuals into relative ones.
    design = np.column_stack([np.full_like(sizes, latency_steps), ring_factor * sizes]) / seconds[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    if alpha < 0:
        x = design[:, 1]
        alpha, beta = 0.0, float(x.sum() / (x @ x))
    if beta <= 0:
        raise DsautoError(
            f"The measured times do not grow with message size ({format_bytes(sizes.min())} to "
            f"{format_bytes(sizes.max())}), so no bandwidth can be fitted; measure larger sizes "
            f"(several MiB) where bandwidth, not latency, dominates."
        )
    return float(alpha), float(1.0 / beta / 1e9)


def group_kinds(world_size: int, local_world_size: int) -> tuple[GroupKind, ...]:
    """The groups to measure on ``world_size`` ranks, ``local_world_size`` per node, node-major.

    Sizes are the powers of two and the full extent, inside a node (consecutive ranks, as tensor
    parallelism lays them out) and across nodes (the same local rank on consecutive nodes, as data
    and pipeline parallelism do). All groups of a kind run at once, as in training, where every
    tensor-parallel group all-reduces at the same time and every GPU drives its own NIC: the
    measured bandwidth is what one group gets while the others are busy too.
    """
    if world_size % local_world_size:
        raise DsautoError(
            f"The world size ({world_size}) is not a multiple of the ranks per node "
            f"({local_world_size}); launch the same number of ranks on every node."
        )
    nodes = world_size // local_world_size
    kinds = []
    for size in _sizes_up_to(local_world_size):
        groups = [
            tuple(node * local_world_size + first + i for i in range(size))
            for node in range(nodes)
            for first in range(0, local_world_size - size + 1, size)
        ]
        kinds.append(GroupKind("intra_node", size, tuple(groups)))
    for size in _sizes_up_to(nodes):
        groups = [
            tuple((first + i) * local_world_size + local for i in range(size))
            for local in range(local_world_size)
            for first in range(0, nodes - size + 1, size)
        ]
        kinds.append(GroupKind("inter_node", size, tuple(groups)))
    return tuple(kinds)


def _sizes_up_to(extent: int) -> list[int]:
    """2, 4, 8, ... up to ``extent``, and ``extent`` itself."""
    sizes = [2**k for k in range(1, extent.bit_length()) if 2**k <= extent]
    if extent >= 2 and extent not in sizes:
        sizes.append(extent)
    return sizes


def measure_collectives(
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    warmup: int = 2,
    repeats: int = 5,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    progress: Callable[[str], None] | None = None,
    local_world_size: int | None = None,
) -> tuple[CollectiveFit, ...]:
    """Times every collective on every :func:`group_kinds` group and fits latency and bandwidth.

    Every rank of an initialised ``torch.distributed`` job must call this with the same arguments;
    every rank gets the same fits. ``device`` defaults to the current CUDA device under NCCL and to
    the CPU otherwise (pass it for other accelerators). ``local_world_size`` (ranks per node)
    defaults to the launcher's environment: ``LOCAL_WORLD_SIZE`` (torchrun), ``LOCAL_SIZE``
    (deepspeed) or ``OMPI_COMM_WORLD_LOCAL_SIZE`` (mpirun); ranks must be numbered node by node, as
    these launchers do. ``progress``, if given, gets one line per fit on rank 0.
    """
    if not dist.is_initialized():
        raise DsautoError("Measuring collectives needs torch.distributed; call init_process_group first.")
    if warmup < 0 or repeats < 1:
        raise DsautoError(f"Need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}.")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    device = device or _default_device()
    if local_world_size is None:
        local_world_size = _local_world_size_from_env(rank, device)
    say = progress if progress is not None and rank == 0 else (lambda line: None)
    item_bytes = torch.empty((), dtype=dtype).element_size()
    timer = _Timer(device, warmup, repeats)

    fits = []
    for kind in group_kinds(world_size, local_world_size):
        # new_group is collective over the whole world: every rank creates every group, in the same
        # order, and keeps only its own (the others come back as non-member placeholders).
        mine = None
        for ranks in kind.groups:
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine = (group, ranks)
        ops: list[Op] = list(COLLECTIVE_OPS) + (["send_recv"] if kind.size == 2 else [])
        for op in ops:
            samples = []
            for size_bytes in sizes_bytes:
                action, used_bytes = _prepare(op, size_bytes, kind.size, item_bytes, dtype, device,
                                              mine, rank)
                seconds = timer.median_max_seconds(action)
                # A ping-pong sends two messages; the model's send/recv is one.
                samples.append((used_bytes, seconds / 2 if op == "send_recv" else seconds))
                del action  # free this size's buffers before the next is allocated
            steps, factor = model_coefficients(op, kind.size)
            latency_seconds, bandwidth_gbps = fit_alpha_beta(samples, factor, steps)
            fit = CollectiveFit(op, kind.size, kind.scope, latency_seconds, bandwidth_gbps, tuple(samples))
            fits.append(fit)
            say(f"{op} {kind.scope} n={kind.size}: latency {format_seconds(latency_seconds)}, bus "
                f"bandwidth {bandwidth_gbps:.2f} GB/s ({len(samples)} sizes, "
                f"{format_bytes(samples[0][0])} .. {format_bytes(samples[-1][0])})")
        timer.barrier()
        if mine is not None:
            dist.destroy_process_group(mine[0])  # NCCL communicators hold device buffers
    return tuple(fits)


def _default_device() -> torch.device:
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local_world_size_from_env(rank: int, device: torch.device) -> int:
    """The ranks per node the launcher announced, checked to be numbered node by node."""
    for _, size_var, rank_var in _LOCAL_ENV:
        if size_var in os.environ:
            local_world_size = int(os.environ[size_var])
            local_rank = int(os.environ.get(rank_var, rank % local_world_size))
            break
    else:
        announced = ", ".join(f"{size_var} ({launcher})" for launcher, size_var, _ in _LOCAL_ENV)
        raise DsautoError(
            f"Cannot tell which ranks share a node: none of {announced} is set; launch with one of "
            f"those or pass local_world_size."
        )
    # Every rank must raise or none: one rank raising alone would leave the others hanging in
    # their next collective.
    misplaced = torch.tensor([float(local_rank != rank % local_world_size)], device=device)
    dist.all_reduce(misplaced, op=dist.ReduceOp.MAX)
    if misplaced.item():
        raise DsautoError(
            f"Ranks are not numbered node by node (rank {rank} has local rank {local_rank}, "
            f"expected {rank % local_world_size} with {local_world_size} ranks per node); launch "
            f"with torchrun or deepspeed, which number them so."
        )
    return local_world_size


def _prepare(
    op: Op,
    size_bytes: int,
    group_size: int,
    item_bytes: int,
    dtype: torch.dtype,
    device: torch.device,
    mine: tuple[dist.ProcessGroup, tuple[int, ...]] | None,
    rank: int,
) -> tuple[Callable[[], object] | None, int]:
    """The timed action of this rank (None if it sits out) and the bytes it actually moves.

    Sizes are rounded down to whole elements, and to a multiple of the group size for the sharded
    collectives, identically on every rank.
    """
    elements = max(1, size_bytes // item_bytes)
    if op in ("all_gather", "reduce_scatter"):
        elements = max(1, elements // group_size) * group_size
    used_bytes = elements * item_bytes
    if mine is None:
        return None, used_bytes
    group, ranks = mine
    if op == "all_reduce":
        buffer = torch.zeros(elements, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buffer, group=group), used_bytes
    if op in ("all_gather", "reduce_scatter"):
        full = torch.zeros(elements, dtype=dtype, device=device)
        shard = torch.zeros(elements // group_size, dtype=dtype, device=device)
        if op == "all_gather":
            # all_gather_single replaces all_gather_into_tensor from torch 2.13; keep both working.
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return lambda: gather(full, shard, group=group), used_bytes
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(shard, full, group=group), used_bytes
    # send_recv: a ping-pong, halved by the caller. Timing one way needs synchronised clocks or a
    # send that returns only once the data has arrived, which no backend promises; a round trip
    # needs neither, and is how the benchmarks behind Hockney's model measured a message.
    buffer = torch.zeros(elements, dtype=dtype, device=device)
    first, second = ranks
    peer = second if rank == first else first

    def ping_pong() -> None:
        if rank == first:
            dist.send(buffer, peer)
            dist.recv(buffer, peer)
        else:
            dist.recv(buffer, peer)
            dist.send(buffer, peer)

    return ping_pong, used_bytes


class _Timer:
    """Times an action on every rank and agrees on one time for all of them."""

    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.device, self.warmup, self.repeats = device, warmup, repeats
        self._token = torch.zeros(1, device=device)

    def barrier(self) -> None:
        """All ranks are here and the device is idle. An all-reduce of one number on the device
        rather than ``dist.barrier``, which under NCCL guesses the device and warns."""
        dist.all_reduce(self._token)
        _synchronize(self.device)

    def median_max_seconds(self, action: Callable[[], object] | None) -> float:
        """Median over repeats of the slowest rank's time for one call of ``action``."""
        for _ in range(self.warmup):  # first calls set up connections and allocator pools
            self.barrier()
            if action is not None:
                action()
        _synchronize(self.device)
        seconds, on_core, waiting = [], [], []
        for _ in range(self.repeats):
            # Start together and from an idle device, so each repeat times this call alone: back
            # to back, calls would overlap and hide latency.
            self.barrier()
            start, queue = time.perf_counter(), run_queue_seconds(whole_process=True)
            if action is not None:
                action()
            _synchronize(self.device)
            seconds.append(time.perf_counter() - start)
            on, wait = (a - b for a, b in zip(run_queue_seconds(whole_process=True), queue))
            on_core.append(on)
            waiting.append(wait)
        # A collective is done only when its slowest member is: ranks leave the barrier at
        # slightly different times, and whoever arrives first waits inside the call for the
        # others. The max over ranks is the time a training step would see.
        per_repeat = torch.tensor(seconds, dtype=torch.float64, device=self.device)
        dist.all_reduce(per_repeat, op=dist.ReduceOp.MAX)
        if self.device.type == "cpu":
            # On CPU ranks (gloo copies and reduces on the cores) that share the machine with
            # other work, the other processes' time slices stretch each call: scaled by the
            # ranks' time on a core over their time on or waiting for one (all their threads).
            cpu = torch.tensor([on_core, waiting], dtype=torch.float64)
            dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
            busy = cpu[0] + cpu[1]
            per_repeat = per_repeat * torch.where(busy > 0, cpu[0] / busy.clamp(min=1e-12), torch.ones_like(busy))
        # The median, not the mean or the minimum: one repeat hit by the OS scheduler or another
        # job must not move the result, and the minimum would be a best case nobody trains at.
        return float(statistics.median(per_repeat.tolist()))


def _synchronize(device: torch.device) -> None:
    """Waits for the device's queued work; the CPU runs collectives synchronously."""
    if device.type == "cpu":
        return
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        accelerator.synchronize(device)
    else:
        torch.cuda.synchronize(device)
