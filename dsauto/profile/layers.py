"""Measure one rank's cost of each distinct layer: forward and backward time, activation and peak bytes.

Each layer group of the model (embedding, one transformer layer, head) is built from the reference
implementation (:mod:`dsauto.models`), from Megatron-core's for its plans' transformer layer
(:mod:`dsauto.profile.megatron_layers`), or taken from a user's model, at the per-rank shapes of every
tensor-parallel degree asked for (a TP-t layer's shard runs on one device; its collectives are priced
from the bandwidth table), and timed for every micro-batch size, with and without recomputation.

Forward and backward are timed separately (Galvatron's profiler times forward only and assumes
backward = 2 x forward; that ratio drifts with the layer's shape and the kernels). Timing follows
the usual discipline: warm-up runs, then repeats, the median, and a device synchronisation before
each clock read. Activation bytes are those autograd keeps for backward (``saved_tensors_hooks``,
each storage counted once, parameters excluded); peak bytes come from :class:`MemoryTracker`.
"""

from __future__ import annotations

import statistics
import time
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from dsauto.cost.measured import MOE_GROUP_SUFFIX
from dsauto.models.gpt import Block, Embedding, Head
from dsauto.plan import Engine
from dsauto.profile.memory import MemoryTracker
from dsauto.spec.model import ModelSpec

GROUPS = ("embedding", "block", "head")
ENGINES = typing.get_args(Engine)
"""Engines whose transformer layers the profiler times: ``deepspeed`` trains the reference layers
(or the user's own), ``megatron`` Megatron-core's."""
REFERENCE_ENGINE = "deepspeed"


@dataclass(frozen=True)
class LayerMeasurement:
    """Measured cost of one layer on one rank, for one micro-batch."""

    group: str
    """``embedding``, ``decoder`` / ``encoder`` (one transformer layer) or ``head``."""
    tp: int
    """Tensor-parallel degree whose per-rank shard was measured."""
    micro_batch: int
    """Sequences in the micro-batch."""
    checkpoint: bool
    """Whether the layer ran under activation checkpointing (backward then includes recomputation)."""
    forward_seconds: float
    """Median forward time."""
    backward_seconds: float
    """Median backward time (gradients of the input and of the parameters)."""
    activation_bytes: int
    """Bytes autograd keeps for backward after the forward pass (parameters excluded)."""
    peak_bytes: int
    """Most live bytes above the parameters during forward and backward (activations, temporaries,
    the input and output gradients and the parameter gradients)."""
    params_bytes: int
    """Bytes of the layer's parameters on this rank."""
    hidden_bytes: int = 0
    """The head only: bytes its layers before the LM head matrix keep for backward (the final norm,
    an encoder's transform) and their output, which the matrix keeps as its input; what a loss
    computed in checkpointed chunks keeps outside them. 0 for other layers, or where not measured."""


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of ``run`` over ``repeats`` calls after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + repeats):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


UNCONTENDED_CPU_SHARE = 0.9
"""On a CPU, a timed run of a layer counts as uncontended when this process was on a core for at
least this share of its wall time: a layer's forward and backward only compute, so less means that
other processes took the core meanwhile, and the run timed them too."""


def uncontended(run: Callable[[], tuple[float, float]], device: torch.device,
                repeats: int) -> list[tuple[float, float]]:
    """``repeats`` results of ``run`` (which times a pure computation, in seconds) as they would be
    on a core of its own.

    On an accelerator every run counts as it is. On a CPU computing with one thread, each run's
    times are scaled by the share of its wall time the thread spent on a core rather than waiting
    for one (:func:`dsauto.profile.resources.run_queue_seconds`): on a machine other processes
    share, their time slices stretch a computation by that factor, evenly at the scale of a
    layer's kernels. Without the scheduler's statistics (or with several threads), runs during
    which the process kept less than :data:`UNCONTENDED_CPU_SHARE` of a core are left out (up to
    three times the repeats are tried, and all of them kept when too few were uncontended)."""
    from dsauto.profile.resources import run_queue_seconds

    if device.type != "cpu":
        return [run() for _ in range(repeats)]
    if torch.get_num_threads() == 1 and run_queue_seconds() != (0.0, 0.0):
        scaled = []
        for _ in range(repeats):
            on, waiting = run_queue_seconds()
            result = run()
            on, waiting = (a - b for a, b in zip(run_queue_seconds(), (on, waiting)))
            share = on / (on + waiting) if on + waiting > 0 else 1.0
            scaled.append(tuple(share * seconds for seconds in result))
        return scaled
    kept, tried = [], []
    while len(kept) < repeats and len(tried) < 3 * repeats:
        wall, cpu = time.perf_counter(), time.process_time()
        result = run()
        tried.append(result)
        if time.process_time() - cpu >= UNCONTENDED_CPU_SHARE * (time.perf_counter() - wall):
            kept.append(result)
    return kept if len(kept) >= max(1, repeats // 2) else tried


def _saved_bytes(run: Callable[[], torch.Tensor], params: set[int],
                 storages: dict[int, int] | None = None) -> tuple[torch.Tensor, int]:
    """Run a forward pass and count the distinct storages autograd saves for backward (added to
    ``storages``, by data pointer, when given)."""
    storages = {} if storages is None else storages

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(storages.values())


def head_hidden_bytes(head: nn.Module, x: torch.Tensor) -> int:
    """What the head's layers before its LM head matrix keep for backward (``head.hidden``: the
    final norm, an encoder's transform), with their output, which the matrix keeps as its input:
    what a loss computed in chunks keeps outside them, which the head's kept activations (its
    loss's log-softmax among them) do not tell apart. Measured, it is what the device ran: torch's
    own RMSNorm, before the reference head computed Hugging Face's, kept 10 bytes an element in
    bf16 on CPU (its fp32 decomposition) and 4 on CUDA (a fused kernel)."""
    storages: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in head.parameters()}
    out, _ = _saved_bytes(lambda: head.hidden(x), params, storages)
    storages[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    return sum(storages.values())


def measure_layer(module: nn.Module, make_input: Callable[[], tuple[torch.Tensor, ...]],
                  checkpoint: bool, device: torch.device, warmup: int = 2,
                  repeats: int = 5) -> tuple[float, float, int, int]:
    """(forward seconds, backward seconds, activation bytes, peak bytes) of ``module`` on fresh inputs.

    ``make_input`` returns the positional inputs; the module's output must be a scalar loss or a
    tensor, whose backward is seeded with ones.
    """
    param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def forward(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if checkpoint:
            return recompute(module, *inputs, use_reentrant=False)
        return module(*inputs)

    def once() -> tuple[float, float]:
        inputs = make_input()
        sync(device)
        start = time.perf_counter()
        out = forward(inputs)
        sync(device)
        middle = time.perf_counter()
        out.backward(torch.ones_like(out))
        sync(device)
        end = time.perf_counter()
        module.zero_grad(set_to_none=True)
        return middle - start, end - middle

    if device.type == "cuda":
        forward_times, backward_times = _queued_pass_seconds(forward, make_input, module, device, warmup, repeats)
    else:
        for _ in range(warmup):
            once()
        forward_times, backward_times = zip(*uncontended(once, device, repeats))

    inputs = make_input()
    tracker = MemoryTracker(device)
    with tracker:
        with tracker.region("layer"):
            out, activation = _saved_bytes(lambda: forward(inputs), param_ptrs)
            out.backward(torch.ones_like(out))
            del out
    module.zero_grad(set_to_none=True)
    return (statistics.median(forward_times), statistics.median(backward_times), activation,
            tracker.peak_bytes("layer"))


def _queued_pass_seconds(forward: Callable[[tuple[torch.Tensor, ...]], torch.Tensor],
                         make_input: Callable[[], tuple[torch.Tensor, ...]], module: nn.Module,
                         device: torch.device, warmup: int, repeats: int) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of ``repeats`` passes on an accelerator as a training step runs
    them: queued one after another with CUDA events between, the host running ahead of the device,
    one synchronisation at the end. Timed with a synchronisation around each pass instead, a layer
    whose kernels take less time than the host needs to issue them is measured host-bound alone,
    where inside a step the host issues it while the device runs the layers before it (measured on
    an H100: Llama layers of 5-7 ms timed alone took 16-34% longer than inside a stack of 8;
    benchmarks/results/device_layers_h100-80gb.md)."""
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(warmup + repeats)]
    sync(device)
    for start, middle, end in events:
        args = make_input()  # queued before the start event: not timed
        start.record()
        out = forward(args)
        middle.record()
        out.backward(torch.ones_like(out))
        end.record()
        module.zero_grad(set_to_none=True)
    sync(device)
    timed = events[warmup:]
    return ([start.elapsed_time(middle) / 1e3 for start, middle, _ in timed],
            [middle.elapsed_time(end) / 1e3 for _, middle, end in timed])


def reference_layer(model: ModelSpec, group: str, tp: int, vocab_size: int) -> nn.Module:
    """The per-rank shard of one layer of the reference implementation."""
    if group == "embedding":
        return Embedding(model, vocab_size // tp)
    if group == "head":
        return Head(model, vocab_size // tp, tied_weight=None)
    return Block(model, tp=tp, moe=group == "moe-block")


def layer_groups_of(model: ModelSpec, tp: int) -> tuple[str, ...]:
    """The groups measured for ``model`` at TP degree ``tp``: the embedding, the dense transformer
    layer (if the model has any), the MoE layer (mixtures of experts; its router, the dispatch of
    the tokens to their experts and the experts, all on one rank as with ep = 1; at tp = 1 only, the
    reference MoE layer being built whole) and the head."""
    moe_layers = len(model.moe_layers())
    groups = ["embedding"]
    if moe_layers < model.num_layers:
        groups.append("block")
    if moe_layers and tp == 1:
        groups.append("moe-block")
    return (*groups, "head")


class _HeadWithLabels(nn.Module):
    """The head as a module of its hidden input only (labels fixed), so it can be timed like a layer."""

    def __init__(self, head: nn.Module, labels: torch.Tensor):
        super().__init__()
        self.head, self.labels = head, labels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x, self.labels)


def profile_layers(model: ModelSpec, seq_len: int, micro_batches: Sequence[int], tps: Iterable[int],
                   dtype: torch.dtype, device: torch.device, warmup: int = 2, repeats: int = 5,
                   progress: Callable[[str], None] | None = None,
                   engine: str = REFERENCE_ENGINE) -> tuple[LayerMeasurement, ...]:
    """Every (group, tp, micro-batch, checkpoint) measurement of the layers of ``model`` that
    ``engine`` trains: the reference layers for ``deepspeed``; for ``megatron`` Megatron-core's own
    dense transformer layer (:mod:`dsauto.profile.megatron_layers`), with the reference embedding,
    head and MoE layer.

    Transformer layers are measured with and without checkpointing; the embedding and head only
    without (the planner never checkpoints them). The vocabulary is padded for each TP degree as
    Megatron pads it, as the plans are.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    if engine == "megatron":
        from dsauto.profile.megatron_layers import megatron_layer_state

        with megatron_layer_state(device):
            return _profile_layers(model, seq_len, micro_batches, tps, dtype, device, warmup, repeats,
                                   progress, engine)
    return _profile_layers(model, seq_len, micro_batches, tps, dtype, device, warmup, repeats, progress, engine)


def _profile_layers(model: ModelSpec, seq_len: int, micro_batches: Sequence[int], tps: Iterable[int],
                    dtype: torch.dtype, device: torch.device, warmup: int, repeats: int,
                    progress: Callable[[str], None] | None, engine: str) -> tuple[LayerMeasurement, ...]:
    tps = tuple(tps)
    jobs = [(g, t, b, c) for t in tps for g in layer_groups_of(model, t) for b in micro_batches
            for c in ((False, True) if g in ("block", "moe-block") else (False,))]
    results = []
    for n, (group, tp, micro_batch, ckpt) in enumerate(jobs, 1):
        torch.manual_seed(0)
        vocab_size = model.padded_vocab_size(tp)
        if engine == "megatron" and group == "block":
            from dsauto.profile.megatron_layers import megatron_layer

            layer = megatron_layer(model, tp, dtype).to(device=device, dtype=dtype)
            shape = (seq_len, micro_batch)  # Megatron's layout: [sequence, batch, hidden]
        else:
            layer = reference_layer(model, group, tp, vocab_size).to(device=device, dtype=dtype)
            shape = (micro_batch, seq_len)
        width = model.hidden_size

        if group == "embedding":
            def make_input(shape=shape, vocab=vocab_size // tp):
                return (torch.randint(0, vocab, shape, device=device),)
            timed: nn.Module = layer
        else:
            def make_input(shape=shape, width=width):
                return (torch.randn(*shape, width, device=device, dtype=dtype, requires_grad=True),)
            if group == "head":
                labels = torch.randint(0, vocab_size // tp, shape, device=device)
                timed = _HeadWithLabels(layer, labels)
            else:
                timed = layer
        fwd, bwd, activation, peak = measure_layer(timed, make_input, ckpt, device, warmup, repeats)
        hidden = head_hidden_bytes(layer, *make_input()) if group == "head" else 0
        name = {"block": model.architecture, "moe-block": model.architecture + MOE_GROUP_SUFFIX}.get(group, group)
        params_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        results.append(LayerMeasurement(
            group=name, tp=tp, micro_batch=micro_batch, checkpoint=ckpt, forward_seconds=fwd,
            backward_seconds=bwd, activation_bytes=activation, peak_bytes=peak,
            params_bytes=params_bytes, hidden_bytes=hidden))
        if progress is not None:
            progress(f"[{n}/{len(jobs)}] {name} tp={tp} micro-batch {micro_batch}"
                     f"{' recomputed' if ckpt else ''}: forward {fwd * 1e3:.2f} ms, "
                     f"backward {bwd * 1e3:.2f} ms, kept {activation / 2**20:.1f} MiB")
    return tuple(results)
