"""Measure real DeepSpeed training steps of plans: median step time and peak per-rank tensor memory.

Run on every rank of a distributed job, one engine per plan in turn:

    torchrun --nproc_per_node 2 -m dsauto.profile.steps --plans plans.json --out measured.json

``plans.json`` is a list of plans (``Plan.to_dict()``); ``measured.json`` gets one
:class:`StepMeasurement` per plan. Each plan trains the reference model of its ``model`` spec on
random tokens through the DeepSpeed hook (:func:`dsauto.runtime.deepspeed.initialize`: the plan's
ds_config, per-layer choices applied); a pipeline-parallel plan trains it as DeepSpeed's
``PipelineModule`` (:func:`measure_pipeline_plan`). Memory is tracked tensor by tensor (:mod:`dsauto.profile.memory`) from before
the model is built, over the first steps; time is measured afterwards without the tracker.
A list of Megatron-core plans (engine ``megatron``) is measured by :mod:`dsauto.profile.megatron_steps`
instead, which trains them with Megatron-core's own modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dsauto.plan import Plan
from dsauto.profile.memory import MemoryTracker
from dsauto.profile.resources import run_queue_seconds
from dsauto.profile.run import bind_cpu_rank, current_device, max_over_ranks
from dsauto.serde import to_dict, write_json


@dataclass(frozen=True)
class StepMeasurement:
    """What real steps of one plan measured (the slowest rank's time, the largest rank's memory)."""

    step_seconds: float
    """Median wall time of one optimizer step (all its micro-batches), max over ranks."""
    step_seconds_samples: tuple[float, ...]
    """Every measured step time (max over ranks), in order."""
    peak_bytes: int
    """Most live tensor bytes on a rank during a training step, max over ranks."""
    static_bytes: int
    """Live tensor bytes on a rank between steps (parameters, gradients, optimizer states), max over ranks."""
    losses: tuple[float, ...]
    """Loss of each measured step (rank 0), a sanity check that training ran."""
    on_core_step_seconds: float = 0.0
    """Median over the timed steps of the step time on cores of the ranks' own: each step's wall
    time times the ranks' time on a core over their time on a core and waiting for one (all their
    threads, summed over the ranks; :func:`dsauto.profile.resources.run_queue_seconds`). On a
    machine other processes share, their time slices stretch the wall time; this is the step as the
    plan would run alone. Equal to ``step_seconds`` on an idle machine; 0 where not measured."""


def measure_plan(plan: Plan, steps: int = 5, warmup: int = 2, memory_steps: int = 2,
                 seed: int = 0) -> StepMeasurement:
    """Train ``plan`` for ``memory_steps`` tracked steps, ``warmup`` more, then ``steps`` timed ones."""
    import deepspeed.comm as dist

    from dsauto.emit.ds_config import ds_config
    from dsauto.models import build_model
    from dsauto.runtime.deepspeed import initialize

    if plan.pp > 1:
        return measure_pipeline_plan(plan, steps, warmup, memory_steps, seed)
    device = current_device()
    rank = dist.get_rank()
    config = ds_config(plan)
    generator = torch.Generator().manual_seed(seed + rank)
    vocab = plan.model.vocab_size

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, vocab, (plan.micro_batch, plan.seq_len + 1), generator=generator)
        tokens = tokens.to(device)
        return tokens[:, :-1], tokens[:, 1:]

    def step(engine) -> float:
        loss = None
        for _ in range(plan.grad_accum):
            tokens, labels = batch()
            loss = engine(tokens, labels)
            engine.backward(loss)
            engine.step()
        return float(loss.detach())

    def build():
        # Expert parallelism under DeepSpeed is DeepSpeed-MoE's; with ep = 1 the reference's own MoE
        # layers keep every expert local (and run under any ZeRO stage).
        model = build_model(plan.model, seed=seed, vocab_size=plan.padded_vocab_size, device=device,
                            deepspeed_ep=plan.ep if plan.model.moe and plan.ep > 1 else None)
        engine, *_ = initialize(dict(model=model, model_parameters=model.parameters(), config=config))
        return engine

    return _measure_engine(build, step, steps, warmup, memory_steps, device)


def _measure_engine(build: Callable[[], object], step: Callable[[object], float], steps: int, warmup: int,
                    memory_steps: int, device: torch.device) -> StepMeasurement:
    """Build a DeepSpeed engine with the memory tracker on (from before the model exists), run
    ``memory_steps`` tracked steps (the static bytes before and after them), ``warmup`` more, then
    ``steps`` timed ones between barriers; the slowest rank's times and the largest rank's memory."""
    tracker = MemoryTracker(device)
    with tracker:
        engine = build()
        with tracker.region("static"):
            pass
        for _ in range(memory_steps):
            with tracker.region("step"):
                step(engine)
        with tracker.region("static"):
            pass
    for _ in range(warmup):
        step(engine)
    times, losses, run_queue = [], [], []
    for _ in range(steps):
        sync_ranks(device)
        start, (on, waiting) = time.perf_counter(), run_queue_seconds(whole_process=True)
        losses.append(step(engine))
        sync_ranks(device)
        times.append(time.perf_counter() - start)
        after = run_queue_seconds(whole_process=True)
        run_queue.append((after[0] - on, after[1] - waiting))
    measured = slowest_rank(times, tracker.peak_bytes("step"), tracker.peak_bytes("static"), losses, device)
    measured = dataclasses.replace(measured, on_core_step_seconds=on_core_median(
        measured.step_seconds_samples, run_queue, device))
    engine.destroy()
    _forget_model_parallel_groups(engine)
    del engine
    gc.collect()
    return measured


def _forget_model_parallel_groups(engine: object) -> None:
    """Forget the groups a destroyed engine left as the process's model-parallel ones. A DeepSpeed
    engine given an ``mpu`` (a pipeline engine: its pipeline grid) stores it process-wide
    (``groups.mpu``, deepspeed/runtime/engine.py, ``_configure_distributed_model``) and ``destroy``
    leaves it there, so the next engine this process builds would take the grid's pipe x slice
    ranks for its own model parallelism."""
    from deepspeed.utils import groups

    if groups.mpu is not None and groups.mpu is getattr(engine, "mpu", None):
        groups.mpu = None


def pipeline_module(plan: Plan):
    """The reference model of ``plan`` as DeepSpeed's ``PipelineModule``, the way a DeepSpeed pipeline
    script writes it (deepspeed/runtime/pipe/module.py): ``LayerSpec``s, so that each rank builds its
    own stage's layers only (:func:`dsauto.models.pipeline.pipeline_layer_specs`), the cross-entropy
    as ``loss_fn``, cut into the plan's stages with its checkpointed blocks wrapped
    (:func:`dsauto.runtime.pipeline.pipeline_module`)."""
    from dsauto.models.gpt import logits_loss
    from dsauto.models.pipeline import pipeline_layer_specs
    from dsauto.runtime.pipeline import pipeline_module as planned

    return planned(plan, pipeline_layer_specs(plan.model, plan.padded_vocab_size), loss_fn=logits_loss)


def measure_pipeline_plan(plan: Plan, steps: int = 5, warmup: int = 2, memory_steps: int = 2,
                          seed: int = 0) -> StepMeasurement:
    """:func:`measure_plan` for a pipeline-parallel plan, trained by DeepSpeed's pipeline engine
    (``engine.train_batch``: 1F1B over the plan's micro-batches, then the gradient reduction and the
    optimizer step), built by the DeepSpeed hook (:func:`dsauto.runtime.deepspeed.initialize`)."""
    import deepspeed.comm as dist

    from dsauto.emit.ds_config import ds_config
    from dsauto.runtime.deepspeed import initialize

    device = current_device()
    generator = torch.Generator().manual_seed(seed + dist.get_rank())

    def batches():
        while True:
            tokens = torch.randint(0, plan.model.vocab_size, (plan.micro_batch, plan.seq_len + 1),
                                   generator=generator).to(device)
            yield tokens[:, :-1], tokens[:, 1:]

    data = batches()

    def step(engine) -> float:
        return float(engine.train_batch(data))

    def build():
        engine, *_ = initialize(dict(model=pipeline_module(plan), config=ds_config(plan)))
        return engine

    return _measure_engine(build, step, steps, warmup, memory_steps, device)


def sync_ranks(device: torch.device) -> None:
    """Wait for this rank's queued device work, then for every rank: a clock read next is the end
    of the same step on all ranks (the slowest rank's end, as in training). Plain torch.distributed,
    which DeepSpeed's communication wraps, so that Megatron-core jobs share it."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def on_core_median(wall_seconds: Sequence[float], run_queue: Sequence[tuple[float, float]],
                   device: torch.device) -> float:
    """The median of ``wall x on / (on + waiting)`` over the steps, ``on`` and ``waiting`` summed over
    the ranks (a collective: call on every rank); 0 where the scheduler's statistics are missing."""
    import torch.distributed as dist

    sums = torch.tensor([x for pair in run_queue for x in pair], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    pairs = sums.view(-1, 2).tolist()
    if any(on + waiting <= 0 for on, waiting in pairs):
        return 0.0
    return statistics.median(w * on / (on + waiting) for w, (on, waiting) in zip(wall_seconds, pairs))


def slowest_rank(step_seconds: Sequence[float], peak_bytes: int, static_bytes: int,
                 losses: Sequence[float], device: torch.device) -> StepMeasurement:
    """This rank's measurement with every time and memory replaced by its maximum over the ranks
    (a collective: call on every rank, with the same number of steps)."""
    steps = len(step_seconds)
    reduced = max_over_ranks([*step_seconds, peak_bytes, static_bytes], device)
    samples = tuple(reduced[:steps])
    return StepMeasurement(step_seconds=statistics.median(samples), step_seconds_samples=samples,
                           peak_bytes=int(reduced[steps]), static_bytes=int(reduced[steps + 1]),
                           losses=tuple(losses))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=Path, required=True, help="JSON list of plans")
    parser.add_argument("--out", type=Path, required=True, help="where rank 0 writes the measurements")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    plans = [Plan.from_dict(p, f"{args.plans} entry {i}") for i, p in enumerate(json.loads(args.plans.read_text()))]
    if any(plan.engine == "megatron" for plan in plans):
        # Megatron-core plans train under Megatron-core's own loop: this rank becomes that program,
        # with the same arguments (same process, so the launcher keeps watching it).
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "dsauto.profile.megatron_steps",
                                  *(sys.argv[1:] if argv is None else argv)])

    import deepspeed
    import deepspeed.comm as dist

    bind_cpu_rank()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    try:
        measure_plans(plans, lambda plan: measure_plan(plan, steps=args.steps, warmup=args.warmup), args.out)
    finally:
        dist.destroy_process_group()


def measure_plans(plans: Sequence[Plan], measure: Callable[[Plan], StepMeasurement], out: Path) -> None:
    """Measure ``plans`` in turn on every rank of the job (``measure`` trains one); rank 0 prints a
    line per plan and, once all are measured, writes the list to ``out``."""
    import torch.distributed as dist

    results = []
    for i, plan in enumerate(plans):
        measured = measure(plan)
        results.append(to_dict(measured))
        if dist.get_rank() == 0:
            print(f"plan {i + 1}/{len(plans)} on {dist.get_world_size()} ranks: step "
                  f"{measured.step_seconds * 1e3:.1f} ms, peak {measured.peak_bytes / 2**20:.1f} MiB", flush=True)
    if dist.get_rank() == 0:
        write_json(out, results)


if __name__ == "__main__":
    main()
