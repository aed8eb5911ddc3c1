"""Whether measuring on this machine fits in its memory, checked before any rank is launched.

Without a GPU, profiling and trials run their ranks on the CPU, and each rank holds in host memory
what it would hold on a device: a model planned for an 80 GB accelerator, launched on 8 CPU ranks of
a 24 GiB machine, ends with the kernel's OOM killer (and takes other work with it). So before a
launch the ranks' memory is estimated and compared with the memory the machine has available
(the smaller of what the kernel reports available and what the cgroup still allows), and a launch
that would not fit is refused with the numbers.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from dsauto.errors import DsautoError
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import DTYPE_BYTES
from dsauto.units import MiB, format_bytes

PROCESS_BYTES = 512 * MiB
"""Host memory of one rank before its tensors: the interpreter with torch, DeepSpeed and gloo
(measured: 240 MiB after the imports alone; the engine, the allocator's caches and gloo's buffers add
to it while training)."""
LAUNCHER_BYTES = 256 * MiB
"""Host memory of the launcher process (torchrun or DeepSpeed's) and the guard beside the ranks."""
USABLE_FRACTION = 0.9
"""Of the available memory, what launched ranks may take: the rest is left for everything else."""
OPTIMIZER_PROBE_ELEMENTS = 2**24
"""Elements of the flat fp32 tensor the profiler times AdamW on (:func:`dsauto.profile.run.measure_optimizer`)."""


def ranks_on_cpu() -> bool:
    """Whether ranks launched here compute on the CPU (no CUDA device), holding their tensors in
    host memory."""
    import torch

    return not torch.cuda.is_available()


CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
"""The cgroup's memory limit and usage (v2, then v1)."""


def _cgroup_limit() -> tuple[int, int] | None:
    """The cgroup's memory limit and usage, or None when it sets none."""
    for limit_file, usage_file in CGROUP_FILES:
        with contextlib.suppress(OSError, ValueError):
            limit = Path(limit_file).read_text().strip()
            if limit == "max":
                return None
            return int(limit), int(Path(usage_file).read_text().strip())
    return None


def available_memory_bytes() -> int:
    """Host memory this process's children may still allocate: the kernel's estimate of available
    memory, capped by the cgroup's limit less its usage (containers see the host's /proc/meminfo)."""
    import psutil

    available = int(psutil.virtual_memory().available)
    cgroup = _cgroup_limit()
    if cgroup is not None:
        available = min(available, cgroup[0] - cgroup[1])
    return max(available, 0)


def total_memory_bytes() -> int:
    """Host memory this process's children could allocate were nothing else running: the machine's
    memory, capped by the cgroup's limit."""
    import psutil

    total = int(psutil.virtual_memory().total)
    cgroup = _cgroup_limit()
    return min(total, cgroup[0]) if cgroup is not None else total


def profiling_rank_bytes(model: ModelSpec, dtype: str, seq_len: int, micro_batches: Sequence[int],
                         tps: Sequence[int]) -> int:
    """Host memory of one profiling rank (:func:`dsauto.profile.layers.profile_layers`): the largest
    layer at the largest micro-batch, with its gradients, the activations kept for backward and the
    head's logits, plus the optimizer probe and the process itself."""
    element = DTYPE_BYTES[dtype]
    tokens = max(micro_batches) * seq_len
    largest = 0.0
    for group in layer_groups(model, seq_len, element, min(tps)):
        weights = 2 * group.params * element  # the layer and its gradients
        # the reference layers keep what Hugging Face's do (LayerGroup.unfused_*)
        kept = tokens * (group.act_tp_bytes_per_token + group.act_replicated_bytes_per_token
                         + group.checkpoint_bytes_per_token + group.unfused_bytes_per_token)
        # Activations kept for backward and as much again in flight; the head's logits with their
        # softmax and gradients (LayerGroup.logits_bytes_per_token counts those already).
        largest = max(largest, weights + 2 * kept + tokens * group.logits_bytes_per_token)
    optimizer = 4 * 4 * min(model.num_parameters(), OPTIMIZER_PROBE_ELEMENTS)  # fp32 param, grad, 2 moments
    return int(PROCESS_BYTES + largest + optimizer)


def check_fits(what: str, ranks: int, rank_bytes: int, remedy: str) -> None:
    """Raises DsautoError when ``ranks`` processes of ``rank_bytes`` each (and their launcher) would
    not fit in the memory this machine has available; ``what`` names the job, ``remedy`` what to change."""
    needed = ranks * rank_bytes + LAUNCHER_BYTES
    available = available_memory_bytes()
    if needed > USABLE_FRACTION * available:
        raise DsautoError(f"{what} on {ranks} CPU rank{'s' if ranks > 1 else ''} needs about "
                          f"{format_bytes(needed)} of host memory ({format_bytes(rank_bytes)} per rank), but "
                          f"this machine has {format_bytes(available)} available; {remedy}.")


MEMORY_WAIT_SECONDS = 300.0
"""How long a launch that would fit the machine's memory, but not what other processes leave of it
now, waits for them to free it (a trial of another tune sharing the study on this machine ends
within its timeout)."""
MEMORY_POLL_SECONDS = 1.0


def await_fits(what: str, ranks: int, rank_bytes: int, remedy: str, wait_seconds: float = MEMORY_WAIT_SECONDS,
               say: Callable[[str], None] | None = None) -> None:
    """:func:`check_fits`, waiting up to ``wait_seconds`` while only the memory available now is
    short: ranks that would fit the machine were nothing else running are held back until other
    processes free enough (``say`` is told once), not refused at once. Ranks that would not fit even
    then are refused at once."""
    needed = ranks * rank_bytes + LAUNCHER_BYTES
    if needed <= USABLE_FRACTION * total_memory_bytes():
        deadline = time.monotonic() + wait_seconds
        told = False
        while needed > USABLE_FRACTION * available_memory_bytes() and time.monotonic() < deadline:
            if say is not None and not told:
                say(f"waiting up to {wait_seconds:.0f} s for {format_bytes(needed)} of host memory "
                    f"({format_bytes(available_memory_bytes())} available: other processes hold the rest)")
                told = True
            time.sleep(MEMORY_POLL_SECONDS)
    check_fits(what, ranks, rank_bytes, remedy)


CONTENTION_SLACK_CORES = 0.5
"""Other CPU use tolerated beyond the cores the ranks leave free (dsauto itself, the launcher, noise)."""


class CpuMeter:
    """What other processes did with the CPU while this process's children ran: started before a
    launch, read after it has been waited for.

    The machine's busy time (``/proc/stat``, stolen time included) less the CPU time of this
    process's waited-for descendants is the other processes' work; over the wall time it is the
    number of cores they kept busy. When that exceeds the cores the ranks left free, the ranks
    competed for cores and their timings are slower than the plan would run alone.
    """

    def __init__(self) -> None:
        import psutil

        self.loadavg = os.getloadavg()[0]
        self.cores = psutil.cpu_count() or 1
        self._busy = busy_seconds()
        self._own = _children_seconds()
        self._started = time.monotonic()

    def other_load(self) -> float:
        """Cores other processes kept busy since the meter started (0 when unknown)."""
        wall = time.monotonic() - self._started
        if wall <= 0:
            return 0.0
        others = (busy_seconds() - self._busy) - (_children_seconds() - self._own)
        return max(0.0, others / wall)

    def contended(self, other_load: float, ranks: int) -> bool:
        """Whether ``ranks`` CPU ranks competed with other work for cores."""
        return other_load > max(self.cores - ranks, 0) + CONTENTION_SLACK_CORES


def run_queue_seconds(whole_process: bool = False) -> tuple[float, float]:
    """(seconds on a core, seconds runnable but waiting for one) of the calling thread, or with
    ``whole_process`` of all this process's threads, from the Linux scheduler's statistics
    (``/proc/.../schedstat``: time on the CPU and time waiting on a run queue, in nanoseconds);
    (0, 0) where they are not available. On a machine other processes share, the waiting is the
    time they took from this one."""
    paths = (list(Path("/proc/self/task").glob("*/schedstat")) if whole_process
             else [Path("/proc/thread-self/schedstat")])
    on = waiting = 0
    for path in paths:
        try:
            fields = path.read_text().split()
        except OSError:  # not Linux, or a thread that ended meanwhile
            continue
        on, waiting = on + int(fields[0]), waiting + int(fields[1])
    return on / 1e9, waiting / 1e9


def busy_seconds(cores: Collection[int] | None = None) -> float:
    """CPU seconds the whole machine (or only ``cores``) has been busy since boot, over all its cores
    (stolen time included, idle and I/O wait not)."""
    import psutil

    total = 0.0
    for t in ([psutil.cpu_times()] if cores is None else [psutil.cpu_times(percpu=True)[c] for c in cores]):
        idle = t.idle + getattr(t, "iowait", 0.0)
        guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)  # counted in user already
        total += sum(t) - idle - guest
    return total


def _children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
