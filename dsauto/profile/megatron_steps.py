"""Measure real Megatron-core training steps of plans: the Megatron counterpart of :mod:`dsauto.profile.steps`.

Run on every rank of a distributed job, one plan after the other:

    torchrun --nproc_per_node 2 -m dsauto.profile.megatron_steps --plans plans.json --out measured.json

Each plan (engine ``megatron``) trains the GPT of its ``model`` spec with Megatron-core's own modules,
as Megatron-LM's training loop builds them (megatron/training/training.py: ``get_model``,
``get_megatron_optimizer``, ``train_step``): GPTModel with the local layer spec, ``Float16Module``
under bf16 / fp16, ``DistributedDataParallel`` (the distributed optimizer for ZeRO-1), the schedule of
``get_forward_backward_func`` (1F1B, interleaved with virtual stages), on random tokens. Every
Megatron setting comes from the plan through dsauto's plugin (:mod:`dsauto.runtime.megatron`:
``initialize_model_parallel``, ``apply``, ``model_chunks``, ``gpt_model_kwargs``, ``ddp_config``,
``optimizer_config``). On a machine without CUDA the ranks run on CPU with gloo, through
:mod:`dsauto.compat.megatron_cpu`; Megatron-FSDP (the plan's ZeRO-2 / 3) needs CUDA, so there the
distributed optimizer stands in, as the plugin reports.

The quantities are :class:`~dsauto.profile.steps.StepMeasurement`'s, measured by :class:`StepMeter`,
which ``dsauto tune --script`` also uses inside a user's Megatron-core script
(:mod:`dsauto.refine.megatron_trial`): live tensor bytes (:class:`~dsauto.profile.memory.MemoryTracker`,
started before the model is built) over the first optimizer steps, then, after untimed warm-up steps,
the time from the end of one optimizer step to the end of the next, every rank synchronised at each
step end; the slowest rank's times and the largest rank's memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dsauto.engines.megatron import qk_layernorm
from dsauto.plan import Plan
from dsauto.profile.memory import MemoryTracker
from dsauto.profile.run import bind_cpu_rank, current_device, max_over_ranks
from dsauto.profile.steps import StepMeasurement, measure_plans, slowest_rank, sync_ranks


class StepMeter:
    """Measures the optimizer steps of one training run, told of each step's end.

    The tracker must run from before the model is built; :meth:`model_built` marks the end of the
    build (the peak counts from there: building on CPU makes full-size master weights that a
    tensor-parallel rank then slices, which no training step holds), and each
    :meth:`optimizer_step_done` one optimizer step. The first ``memory_steps`` steps are tracked,
    then the tracker stops (it slows every operator down), ``warmup_steps`` more pass untimed, and
    the next ``steps`` are timed. The step that completes the run returns the measurement (a
    collective: every rank must report the same steps).
    """

    def __init__(self, tracker: MemoryTracker, device: torch.device, steps: int, warmup_steps: int,
                 memory_steps: int):
        if steps < 1 or memory_steps < 1 or warmup_steps < 0:
            raise ValueError(f"steps ({steps}) and memory_steps ({memory_steps}) must be at least 1 and "
                             f"warmup_steps ({warmup_steps}) at least 0")
        self.tracker = tracker
        self.device = device
        self.steps, self.warmup_steps, self.memory_steps = steps, warmup_steps, memory_steps
        self.optimizer_steps = 0
        self.step_seconds: list[float] = []
        self.losses: list[float] = []
        self._regions: list[Any] = []
        self._clock = 0.0
        self._enter("trial")  # from the start, for a script that never says when its model is built

    @property
    def total_steps(self) -> int:
        """Optimizer steps the run needs before it is measured."""
        return self.memory_steps + self.warmup_steps + self.steps

    def _enter(self, name: str) -> None:
        region = self.tracker.region(name)
        region.__enter__()
        self._regions.append(region)

    def model_built(self) -> None:
        """The model is built: the step peak counts from here (once; later calls do nothing)."""
        if self.optimizer_steps == 0 and len(self._regions) == 1:
            with self.tracker.region("static"):
                pass
            self._enter("step")

    def optimizer_step_done(self, loss: float | None = None) -> StepMeasurement | None:
        """One optimizer step ended (``loss``: its loss, where this rank knows it); the measurement
        once the last timed step has ended, else None."""
        self.optimizer_steps += 1
        done = self.optimizer_steps
        if done == self.memory_steps:
            for region in reversed(self._regions):
                region.__exit__(None, None, None)
            with self.tracker.region("static"):  # parameters, gradients and optimizer states
                pass
            self.tracker.__exit__(None, None, None)
        sync_ranks(self.device)
        now = time.perf_counter()
        if done > self.memory_steps + self.warmup_steps:
            self.step_seconds.append(now - self._clock)
            if loss is not None:
                self.losses.append(loss)
        self._clock = now
        if done != self.total_steps:
            return None
        peak = self.tracker.peak_bytes("step" if len(self._regions) > 1 else "trial")
        losses = self.losses if len(self.losses) == self.steps else []
        return slowest_rank(self.step_seconds, peak, self.tracker.peak_bytes("static"), losses, self.device)


def build(plan: Plan, on_cpu: bool, lr: float = 1e-4) -> tuple[list[torch.nn.Module], Any]:
    """This rank's model chunks, wrapped for data parallelism, and their optimizer, as Megatron-LM's
    ``get_model`` and ``setup_model_and_optimizer`` build them with the plan's settings."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from dsauto.runtime import megatron as dm

    # The local spec's attention is Megatron-core's own (unfused) DotProductAttention, the one that
    # runs without Transformer Engine; apply() recomputes its scores for a plan made for flash attention.
    config = dm.apply(plan, TransformerConfig(**dm.transformer_config_kwargs(plan.model),
                                              use_cpu_initialization=on_cpu, attention_backend=AttnBackend.local))
    spec = get_gpt_layer_local_spec(num_experts=plan.model.num_experts or None, qk_layernorm=qk_layernorm(plan.model),
                                    normalization=config.normalization)
    chunks = dm.model_chunks(plan, lambda **where: GPTModel(
        config=config, transformer_layer_spec=spec, mtp_block_spec=dm.mtp_block_spec(config, spec, where["vp_stage"]),
        **dm.gpt_model_kwargs(plan), **where))
    if config.bf16 or config.fp16:
        # As get_model: every parameter in 16 bits, inputs cast on the first stage, the loss in fp32.
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    if not on_cpu:
        chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
    ddp_config = dm.ddp_config(plan, megatron_fsdp=not on_cpu)
    if ddp_config.use_megatron_fsdp:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel as Wrapper
    else:
        Wrapper = DistributedDataParallel
    # One gradient bucket for every chunk after the first, as get_model does: the interleaved
    # schedule overlaps their reduction with the other chunks' backward anyway.
    model = [Wrapper(config, ddp_config, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(dm.optimizer_config(plan, lr=lr), model)
    if ddp_config.overlap_grad_reduce:  # reduce gradients once, after each chunk's last micro-batch
        config.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads  # DP, tied-embedding and SP reductions
    return model, optimizer


def random_batches(plan: Plan, seed: int, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of random tokens, as GPTModel inputs: the same on
    every tensor-parallel and pipeline rank of the replica (each draws every micro-batch)."""
    from megatron.core import parallel_state

    generator = torch.Generator().manual_seed(seed * 1000003 + parallel_state.get_data_parallel_rank())
    positions = torch.arange(plan.seq_len, device=device).unsqueeze(0).expand(plan.micro_batch, -1)
    while True:
        tokens = torch.randint(0, plan.model.vocab_size, (plan.micro_batch, plan.seq_len + 1), generator=generator)
        tokens = tokens.to(device)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": positions}


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    batch = next(data_iterator)

    def loss_func(output: torch.Tensor):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), loss_func


def train_step(plan: Plan, model: list[torch.nn.Module], optimizer: Any, data: list[Iterator]) -> float | None:
    """One optimizer step over the plan's micro-batches; the mean loss on the last pipeline stage,
    None elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=data, model=model, num_microbatches=plan.grad_accum,
        seq_length=plan.seq_len, micro_batch_size=plan.micro_batch, forward_only=False)
    optimizer.step()
    return float(torch.stack([item["lm loss"] for item in losses]).mean()) if losses else None


def measure_plan(plan: Plan, steps: int = 5, warmup: int = 2, memory_steps: int = 2,
                 seed: int = 0) -> StepMeasurement:
    """Train ``plan`` for ``memory_steps`` tracked steps, ``warmup`` more, then ``steps`` timed ones
    (a collective over the job's ranks, which must be ``plan.world_size``)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from dsauto.runtime import megatron as dm

    device = current_device()
    dm.initialize_model_parallel(plan)
    try:
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        tracker = MemoryTracker(device)
        tracker.__enter__()
        meter = StepMeter(tracker, device, steps, warmup, memory_steps)
        model, optimizer = build(plan, on_cpu=device.type == "cpu")
        meter.model_built()
        data = [random_batches(plan, seed, device) for _ in model]  # one iterator per model chunk
        # The loss of one rank (the last stage's first), so that rank 0 can report it.
        reporter = (parallel_state.is_pipeline_last_stage() and parallel_state.get_data_parallel_rank() == 0
                    and parallel_state.get_tensor_model_parallel_rank() == 0)
        measured = None
        while measured is None:
            loss = train_step(plan, model, optimizer, data)
            measured = meter.optimizer_step_done(loss if reporter else float("-inf"))
        losses = max_over_ranks(measured.losses, device) if measured.losses else []
        del model, optimizer, data
        gc.collect()
        return StepMeasurement(measured.step_seconds, measured.step_seconds_samples, measured.peak_bytes,
                               measured.static_bytes, tuple(losses))
    finally:
        parallel_state.destroy_model_parallel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=Path, required=True, help="JSON list of plans (engine megatron)")
    parser.add_argument("--out", type=Path, required=True, help="where rank 0 writes the measurements")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # DeepSpeed's launcher
    args = parser.parse_args(argv)

    import torch.distributed as dist

    on_cpu = not torch.cuda.is_available()
    shim = None
    if on_cpu:
        from dsauto.compat import megatron_cpu

        shim = megatron_cpu.enable()
        bind_cpu_rank()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    else:
        torch.cuda.set_device(current_device())
    dist.init_process_group("gloo" if on_cpu else "nccl")
    plans = [Plan.from_dict(p, f"{args.plans} entry {i}") for i, p in enumerate(json.loads(args.plans.read_text()))]
    try:
        measure_plans(plans, lambda plan: measure_plan(plan, steps=args.steps, warmup=args.warmup,
                                                       memory_steps=args.memory_steps), args.out)
    finally:
        dist.destroy_process_group()
        if shim is not None:
            shim.disable()


if __name__ == "__main__":
    main()
