"""``dsauto profile``: measure a model's layers (and, on several ranks, the collectives) and store them.

On one process it profiles the layers on the current device (CUDA when present, else CPU). Launched
on several ranks (``torchrun`` or the deepspeed launcher), rank 0 profiles the layers while the
others wait, then every rank takes part in the collective measurements; rank 0 writes the profile.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from dsauto.errors import DsautoError
from dsauto.profile.cpu_optimizer import measure_cpu_optimizer
from dsauto.profile.launch import free_port, launch, stop
from dsauto.profile.layers import REFERENCE_ENGINE, LayerMeasurement, measure_layer, median_seconds, profile_layers
from dsauto.profile.store import Profile, load_profile, profile_path, software_versions, update_profile
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import Dtype

TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Report = Callable[[str], None]


def current_device() -> torch.device:
    """The device this process profiles: its CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def bind_cpu_rank() -> None:
    """On a CPU, pin this rank to one core (its local rank), as DeepSpeed's launcher does with
    ``--bind_cores_to_rank``: ranks that migrate between cores time unevenly from run to run."""
    if torch.cuda.is_available() or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    if local_size > 1 and len(cores) >= local_size:
        os.sched_setaffinity(0, {cores[local_rank]})


def measure_optimizer(num_params: int, dtype: torch.dtype, device: torch.device,
                      warmup: int = 2, repeats: int = 5, fused: bool = True) -> float:
    """Seconds per parameter of one torch AdamW step over a flat fp32 tensor of ``num_params``
    (DeepSpeed's ZeRO optimizers step one flat fp32 partition; the emitted config asks for torch's
    fused AdamW; ``fused`` False times its default multi-tensor update). Capped at 2^24 elements: the
    update is bandwidth-bound, so the rate holds beyond it."""
    n = max(1, min(num_params, 2**24))
    param = torch.nn.Parameter(torch.zeros(n, dtype=torch.float32, device=device))
    param.grad = torch.randn(n, dtype=torch.float32, device=device)
    optimizer = torch.optim.AdamW([param], lr=1e-4, fused=fused)
    return median_seconds(optimizer.step, device, warmup, repeats) / n


def load_factory(spec: str) -> Callable[[ModelSpec], torch.nn.Module]:
    """A user's model factory ``package.module:function`` (called with the ModelSpec)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise DsautoError(f"--factory {spec!r} must look like package.module:function.")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # noqa: BLE001 - importing the user's module may fail in any way
        raise DsautoError(f"Cannot load the model factory {spec!r}: {type(exc).__name__}: {exc}; check the "
                          f"module is on PYTHONPATH, imports cleanly and defines {attr}.") from None


def profile_factory_layers(model: ModelSpec, factory: Callable[[ModelSpec], torch.nn.Module],
                           seq_len: int, micro_batches: Sequence[int], dtype: torch.dtype,
                           device: torch.device, warmup: int, repeats: int,
                           progress: Report | None) -> tuple[LayerMeasurement, ...]:
    """Measure the user's own layers (TP 1 only: an arbitrary module cannot be sharded here). The
    model must expose an embedding, a list of identical transformer blocks and a head the way
    :func:`dsauto.runtime.layers.find_layers` finds them; the first block stands for all of them."""
    from dsauto.runtime.layers import find_layers

    name = getattr(factory, "__qualname__", repr(factory))
    try:
        net = factory(model)
    except Exception as exc:  # noqa: BLE001 - the user's factory may fail in any way
        raise DsautoError(f"The model factory {name} failed when called with the ModelSpec: "
                          f"{type(exc).__name__}: {exc}; give a function of the ModelSpec that builds the "
                          f"model.") from None
    if not isinstance(net, torch.nn.Module):
        raise DsautoError(f"The model factory {name} returned a {type(net).__name__}, not a torch.nn.Module; give "
                          f"a function of the ModelSpec that builds the model.")
    net = net.to(device=device, dtype=dtype)
    layers = find_layers(net)
    if layers.num_layers != model.num_layers:
        raise DsautoError(f"The factory's model has {layers.num_layers} blocks in {layers.blocks_name}, "
                          f"but {model.name} has {model.num_layers} layers; profile the model the factory builds.")
    block = layers.blocks[0]
    results = []
    for n, micro_batch in enumerate(micro_batches, 1):
        for ckpt in (False, True):
            def make_input(micro_batch=micro_batch):
                return (torch.randn(micro_batch, seq_len, model.hidden_size, device=device, dtype=dtype,
                                    requires_grad=True),)
            fwd, bwd, act, peak = measure_layer(block, make_input, ckpt, device, warmup, repeats)
            results.append(LayerMeasurement(
                group=model.architecture, tp=1, micro_batch=micro_batch, checkpoint=ckpt,
                forward_seconds=fwd, backward_seconds=bwd, activation_bytes=act, peak_bytes=peak,
                params_bytes=sum(p.numel() * p.element_size() for p in block.parameters())))
            if progress is not None:
                progress(f"[{n}/{len(micro_batches)}] {model.architecture} micro-batch {micro_batch}"
                         f"{' recomputed' if ckpt else ''}: forward {fwd * 1e3:.2f} ms, backward {bwd * 1e3:.2f} ms")
    return tuple(results)


def run_profile(model: ModelSpec, dtype: Dtype, seq_len: int, micro_batches: Sequence[int],
                tps: Sequence[int], out_dir: Path | str, force: bool = False, factory: str | None = None,
                warmup: int = 2, repeats: int = 5, progress: Report | None = None,
                engine: str = REFERENCE_ENGINE) -> tuple[Profile, Path, bool]:
    """Profile ``model`` (reusing a stored profile with the same key unless ``force``), its
    transformer layers as ``engine`` trains them (:func:`dsauto.profile.layers.profile_layers`).

    Returns the profile, its path, and whether it was reused. Call on every rank when launched on
    several; only rank 0 writes.
    """
    import torch.distributed as dist

    device = current_device()
    torch_dtype = TORCH_DTYPES[dtype]
    versions = software_versions()
    if factory is not None and engine != REFERENCE_ENGINE:
        raise DsautoError(f"--factory times the factory's own layers and --engine {engine} {engine}'s; "
                          f"give one of the two.")
    path = profile_path(out_dir, model, device_name(device), dtype, seq_len, versions, engine, factory or "")
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    say = progress if rank == 0 else None
    if path.exists() and not force:
        try:
            stored = load_profile(path)
        except DsautoError as exc:  # a corrupt file (a disk full while writing): measure again
            if say:
                say(f"measuring again: {exc}")
        else:
            world = dist.get_world_size() if distributed else 1
            # the transformer layers' shapes each micro-batch and tp (a factory times tp 1 only)
            asked = {(micro, tp) for micro in micro_batches for tp in ((1,) if factory else tps)}
            held = {(m.micro_batch, m.tp) for m in stored.layers if m.group not in ("embedding", "head")}
            missing = sorted(asked - held)
            if missing and say:
                say("measuring again: the stored profile lacks " + ", ".join(
                    f"micro-batch {micro} at tp {tp}" for micro, tp in missing))
            if stored.world_size >= world and not missing:  # more ranks than stored add collectives
                return stored, path, True

    layers: tuple[LayerMeasurement, ...] = ()
    optimizer_rate = 0.0
    # Every rank measures at once, as every rank computes at once in training (on a CPU the ranks
    # share memory bandwidth and caches; alone, rank 0 would time its layers ~10% fast); the
    # slowest rank's time of each measurement is kept.
    if factory is not None:
        layers = profile_factory_layers(model, load_factory(factory), seq_len, micro_batches,
                                        torch_dtype, device, warmup, repeats, say)
    else:
        layers = profile_layers(model, seq_len, micro_batches, tps, torch_dtype, device, warmup,
                                repeats, say, engine)
    optimizer_rate = measure_optimizer(model.num_parameters(), torch_dtype, device)
    cpu_rate, cpu_optimizer = measure_cpu_optimizer(model.num_parameters(), engine=engine)
    if distributed:
        layers, optimizer_rate = _slowest_rank(layers, optimizer_rate, device)
        _, cpu_rate = _slowest_rank((), cpu_rate, device)
    if say:
        say(f"optimizer: {optimizer_rate * 1e9:.2f} ns per parameter (AdamW); on the host "
            f"{cpu_rate * 1e9:.2f} ns per parameter ({cpu_optimizer})")

    collectives: tuple = ()
    world = 1
    if distributed:
        from dsauto.profile.collectives import measure_collectives

        world = dist.get_world_size()
        dist.barrier()
        collectives = measure_collectives(device=device, progress=say)

    zero3_seconds, modules = 0.0, {}
    if factory is None:  # the per-module cost of ZeRO-3 is measured on the reference layer
        from dsauto.profile.engine import measure_zero3_module_seconds, modules_per_layer

        zero3_seconds = measure_zero3_module_seconds(
            model, seq_len, torch_dtype, device,
            bandwidth_seconds=_zero3_bandwidth_seconds(model, dtype, collectives, world))
        modules = modules_per_layer(model)
        if say:
            say(f"ZeRO-3: {zero3_seconds * 1e3:.3f} ms per hooked module per micro-batch "
                f"({modules['1']} modules per layer)")

    profile = Profile(model=model, device=device_name(device), dtype=dtype, seq_len=seq_len,
                      threads=torch.get_num_threads(), versions=versions, layers=layers,
                      optimizer_seconds_per_param=optimizer_rate, collectives=tuple(collectives),
                      world_size=world, zero3_module_seconds=zero3_seconds, layer_modules=modules,
                      cpu_optimizer_seconds_per_param=cpu_rate, cpu_optimizer=cpu_optimizer, engine=engine,
                      factory=factory or "")
    if rank == 0:
        # Measured again (--force, more ranks, a corrupt file): the steps earlier studies measured,
        # and the calibration fitted to them, stay with the profile.
        profile, _ = update_profile(out_dir, profile, lambda stored: dataclasses.replace(
            profile, calibration=stored.calibration, history=stored.history))
    return profile, path, False


def _zero3_bandwidth_seconds(model: ModelSpec, dtype: str, collectives: Sequence, world: int) -> float:
    """The bandwidth part of gathering one layer's parameters twice (forward, backward) and
    reduce-scattering its gradients over ``world`` ranks, from the fitted collectives."""
    if world <= 1:
        return 0.0
    from dsauto.cost.collectives import Group
    from dsauto.spec.model import layer_groups
    from dsauto.spec.training import DTYPE_BYTES

    volume = layer_groups(model, 1, DTYPE_BYTES[dtype], 1)[1].params * DTYPE_BYTES[dtype]
    seconds = 0.0
    for fit in collectives:
        if fit.group_size == world and fit.scope == "intra_node":
            # The cost model's ring formulas with the fitted bandwidth and no latency: the latency
            # of each gather is part of the per-module cost being measured.
            bandwidth_only = Group(world, fit.bandwidth_gbps * 1e9, 0.0)
            if fit.op == "all_gather":
                seconds += 2 * bandwidth_only.all_gather(volume)
            elif fit.op == "reduce_scatter":
                seconds += bandwidth_only.reduce_scatter(volume)
    return seconds


def max_over_ranks(values: Sequence[float], device: torch.device) -> list[float]:
    """Each value replaced by its maximum over the ranks of the current job."""
    import torch.distributed as dist

    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _slowest_rank(layers: tuple[LayerMeasurement, ...], optimizer_rate: float,
                  device: torch.device) -> tuple[tuple[LayerMeasurement, ...], float]:
    """Each measured time replaced by its maximum over the ranks (all measured the same layers)."""
    values = max_over_ranks([t for m in layers for t in (m.forward_seconds, m.backward_seconds)]
                            + [optimizer_rate], device)
    slowest = tuple(dataclasses.replace(m, forward_seconds=values[2 * i], backward_seconds=values[2 * i + 1])
                    for i, m in enumerate(layers))
    return slowest, values[-1]


def launch_profile(model: str, dtype: Dtype, seq_len: int, tps: Sequence[int], ranks: int,
                   out_dir: Path | str, progress: Report | None = None, engine: str = REFERENCE_ENGINE) -> None:
    """Run ``dsauto profile`` on ``ranks`` local processes (torchrun), so that the collectives and the
    ZeRO-3 hook cost are measured too; ``model`` is what ``--model`` takes. The ranks run under a
    guard (:mod:`dsauto.profile.launch`): they end with this process, however it ends. Raises
    DsautoError with the last lines of its output when it fails."""
    import subprocess
    import sys

    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(port), "-m", "dsauto.cli", "profile", "--model", model, "--dtype", dtype, "--seq-len",
               str(seq_len), "--tp", ",".join(map(str, tps)), "--out", str(out_dir), "--engine", engine]
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", "1")
    process = launch(command, env, port, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert process.stdout is not None
    try:
        for line in process.stdout:
            tail = (tail + [line.rstrip()])[-5:]
            if progress and (line.startswith("[") or line.startswith("wrote") or line.startswith("reused")):
                progress(line.rstrip())
        returncode = process.wait()
    except BaseException:
        stop(process)  # interrupted or terminated: the ranks go with us
        raise
    if returncode != 0:
        raise DsautoError(f"Profiling {model} on {ranks} ranks failed (exit code {returncode}): "
                          f"{' / '.join(tail)}; run `{' '.join(command[1:])}` to see why.")
