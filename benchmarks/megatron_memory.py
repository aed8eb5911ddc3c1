"""Predicted vs measured peak memory per rank of real Megatron-core training, on two CPU ranks.

    python benchmarks/megatron_memory.py              # 23 plans, one torchrun launch each; ~6 minutes
    python benchmarks/megatron_memory.py --only pp2   # the plans whose label contains "pp2"

Megatron-core's own modules train a small GPT in bf16 (GPTModel with the local layer spec, wrapped in
Float16Module, DistributedDataParallel, get_megatron_optimizer, the schedules of
get_forward_backward_func) through dsauto's Megatron plugin (:mod:`dsauto.megatron`:
initialize_model_parallel, apply, model_chunks, ddp_config, optimizer_config), on two CPU ranks
(torchrun, gloo, one thread each) with :mod:`dsauto.compat.megatron_cpu`. The plans: TP=2, PP=2
(1F1B over 4 micro-batches), DP=2 with the distributed optimizer (ZeRO-1) and DP=2 with plain DDP
(ZeRO-0), each with full recomputation of every layer and with none, and the four DP=2 plans again
with their gradients kept and reduced in bf16 (``--grad-reduce-in-bf16``), an interleaved PP=2, and
PP=2 and TP=2 with a multi-token-prediction layer and an untied head (GPTModel given the decoder's
layer spec for it, ``get_gpt_mtp_block_spec``), and a mixture of experts over expert parallelism 2
(alltoall dispatcher) without recomputation, with ``moe`` and with every layer recomputed, and with
gated GeLU experts and with SwiGLU experts beside a shared expert, and DP=2 of a gated GeLU MLP without
recomputation and recomputing the MLP. Each is
built and priced by
dsauto's planner with engine ``megatron``. Every rank tracks the bytes of live tensors
(:class:`dsauto.profile.memory.MemoryTracker`, started before the model is built) over
:data:`STEPS` optimizer steps, with regions around each forward and backward of a micro-batch (as the
schedule runs them) and around the optimizer step, so that the moment of each peak shows.

Results go to ``benchmarks/results/megatron_memory.md`` and ``megatron_memory.png``; the last line
printed is

    median_memory_error=X% max_under_prediction=Y% plans=N

(errors of the largest rank's peak against the largest stage's prediction; an under-prediction is a
measured peak above the predicted one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SEQ_LEN = 256
MICRO_BATCH = 2
GLOBAL_MICRO_BATCHES = 4
"""Every plan trains on the same global batch: 4 micro-batches of 2 sequences, split over dp."""
DTYPE = "bf16"
"""Megatron-core trains in bf16 on CPU here (torch's CPU kernels take bf16; Float16Module casts)."""
STEPS = 3
"""Tracked optimizer steps: the first creates Adam's moments, the later ones run with them."""
LAUNCH_TIMEOUT_SECONDS = 600
MiB = 2**20


@dataclass(frozen=True)
class Case:
    """One plan of the benchmark (also the model-parallel plans of benchmarks/accuracy.py)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 0
    recompute: bool = False
    """Every transformer layer recomputed."""
    micro_batch: int = MICRO_BATCH
    micro_batches: int = GLOBAL_MICRO_BATCHES
    """Micro-batches per step over all data-parallel ranks."""
    layout: tuple[int, ...] = ()
    """Transformer layers per pipeline stage; () splits them evenly."""
    recompute_first: int = 0
    """Without ``recompute``: the first N transformer layers of every stage recomputed (Megatron's
    block method)."""
    dtype: str = DTYPE
    grad_reduce_in_fp32: bool = True
    """False: gradients kept and reduced in bf16 (``--grad-reduce-in-bf16``)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (Megatron-core's interleaved 1F1B)."""
    mtp_layers: int = 0
    """Multi-token-prediction layers on the last stage (ModelSpec.mtp_layers, Megatron's mtp_num_layers)."""
    tied: bool = True
    """The head reuses the word embedding (False: an output weight of its own, as DeepSeek-V3's)."""
    ep: int = 1
    """Expert-parallel degree; above 1 the model's MLPs are mixtures of experts (:data:`EXPERTS`)."""
    recompute_modules: tuple[str, ...] = ()
    """Without ``recompute``: the modules every layer recomputes (Megatron-core's selective method)."""
    mlp: str = "gelu"
    """The MLP's (or the experts') activation: GeLU, or without biases (as Gemma and Llama; Megatron-core
    recomputes no MLP with biases) a gated GeLU (``geglu``, which Megatron-core runs unfused) or SwiGLU
    (fused with the experts' weighting, as on a GPU)."""
    shared_expert: int = 0
    """Width of a shared expert beside the routed ones (Megatron-core's SharedExpertMLP); 0: none."""
    capacity: float = 0.0
    """Above 0: every expert filled to this times its mean share of a rank's tokens (Megatron-core's
    --moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity); 0: dropless."""

    def label(self) -> str:
        degrees = f"tp{self.tp}" if self.tp > 1 else f"pp{self.pp}" if self.pp > 1 else f"dp{self.dp}"
        degrees += f" vpp{self.virtual_stages}" if self.virtual_stages > 1 else ""
        degrees += f" ep{self.ep}" if self.ep > 1 else ""
        zero = f" zero{self.zero_stage}" if self.dp > 1 else ""
        recompute = ("recompute-all" if self.recompute else
                     f"recompute-first{self.recompute_first}" if self.recompute_first else
                     f"recompute-{','.join(self.recompute_modules)}" if self.recompute_modules else "no-recompute")
        extra = ""
        if self.layout:
            extra += f" layers-{'+'.join(map(str, self.layout))}"
        if (self.micro_batch, self.micro_batches) != (MICRO_BATCH, GLOBAL_MICRO_BATCHES):
            extra += f" mb{self.micro_batch}x{self.micro_batches // self.dp}"
        if not self.grad_reduce_in_fp32:
            extra += " bf16-grads"
        if self.mtp_layers:
            extra += f" mtp{self.mtp_layers}"
        if not self.tied:
            extra += " untied"
        if self.mlp != "gelu":
            extra += f" {self.mlp}"
        if self.shared_expert:
            extra += " shared"
        if self.capacity:
            extra += f" capacity{self.capacity:g}-padded"
        return f"{degrees}{zero}{extra} {recompute}"

    def stage_layers(self, num_layers: int) -> list[int]:
        return list(self.layout) if self.layout else [num_layers // self.pp] * self.pp

    def checkpointed(self, layer: int, num_layers: int) -> bool:
        """Whether flat layer ``layer`` (0 embedding, 1..L blocks, L+1 head) is recomputed."""
        if not 1 <= layer <= num_layers:
            return False
        if self.recompute:
            return True
        first = 1
        for count in self.stage_layers(num_layers):
            if first <= layer < first + count:
                return layer - first < self.recompute_first
            first += count
        return False


CASES = tuple(Case(**dims, recompute=recompute)
              for dims in ({"tp": 2}, {"pp": 2}, {"dp": 2, "zero_stage": 1}, {"dp": 2, "zero_stage": 0})
              for recompute in (False, True)) + tuple(
    Case(dp=2, zero_stage=zero, recompute=recompute, grad_reduce_in_fp32=False)
    for zero in (1, 0) for recompute in (False, True)) + (
    Case(pp=2, virtual_stages=2, layout=(1, 3)),) + tuple(
    Case(**dims, mtp_layers=1, tied=False) for dims in ({"pp": 2}, {"tp": 2}, {"pp": 2, "recompute": True})) + tuple(
    Case(dp=2, zero_stage=1, ep=2, recompute_modules=modules) for modules in ((), ("moe",))) + (
    Case(dp=2, zero_stage=1, ep=2, recompute=True), Case(dp=2, zero_stage=1, ep=2, mlp="geglu"),
    Case(dp=2, zero_stage=1, ep=2, mlp="swiglu", shared_expert=512),
    Case(dp=2, zero_stage=1, ep=2, capacity=1.0)) + tuple(
    Case(dp=2, zero_stage=1, mlp="geglu", recompute_modules=modules) for modules in ((), ("mlp",)))
"""TP 2, PP 2, DP 2 with and without the distributed optimizer, each with and without recomputation;
the DP plans again with bf16 gradients (recomputed, their optimizer update is the peak); and PP 2
interleaved over 2 chunks a rank with 1 and 3 layers, whose first rank's second chunk holds none
(the warm-up's passes fall unevenly on the chunks: dsauto.cost.step.chunk_passes); and PP 2 and TP 2
with one multi-token-prediction layer (its layer, projection and second loss on the last stage) and
an untied head and rotary positions, as DeepSeek-V3 has (the last stage then holds a word table for the
layer's lookups),
PP 2 also with every layer recomputed (the plugin's recompute_method block, under which Megatron-core
0.16.1 does not checkpoint the prediction layer: MultiTokenPredictionLayer._checkpointed_forward); and
a mixture of experts (:data:`EXPERTS`) over expert parallelism 2 with the distributed optimizer, with
Megatron-core's alltoall dispatcher (the one dsauto plans and prices), without recomputation, with
each MoE layer recomputed (``moe``) and with every layer recomputed (``moe_act`` needs grouped GEMMs,
which Megatron-core runs only with Transformer Engine or the grouped_gemm package, neither on a CPU),
and again without recomputation with gated GeLU experts (their unfused gated unit keeps more) and with
SwiGLU experts (fused with the weighting) beside a shared expert; and
the dense model with a gated GeLU MLP over DP 2, without recomputation and recomputing the MLP."""

EXPERTS = {"num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 512, "linear_bias": False}
"""The mixture of experts of the ep plans: 4 experts of half the dense MLP's width in every layer, top 2,
no biases (at ep 1 Megatron-core's experts add their biases in place on a view, which autograd refuses;
the plans keep one shape)."""


def bench_model(mtp_layers: int = 0, tied: bool = True, experts: bool = False, mlp: str = "gelu",
                shared_expert: int = 0):
    from dsauto.spec.model import ModelSpec

    # GPT-2 shaped (GeLU, LayerNorm, learned positions, tied head, biases), no dropout so that the
    # runs are deterministic. The vocabulary is a multiple of 128 x 2: tp 1 and 2 pad it alike. With
    # prediction layers, rotary positions (Megatron-LM runs multi-token prediction with no others).
    return ModelSpec(name="bench-gpt", architecture="decoder", num_layers=4, hidden_size=256,
                     num_attention_heads=4, ffn_hidden_size=1024, vocab_size=4096,
                     max_position_embeddings=SEQ_LEN, dropout=False, mtp_layers=mtp_layers,
                     tied_embeddings=tied, position_embedding="rope" if mtp_layers else "learned",
                     **{**(EXPERTS if experts else {}),
                        **({"mlp": mlp, "linear_bias": False} if mlp != "gelu" else {})},
                     **({"shared_expert_ffn_hidden_size": shared_expert} if shared_expert else {}))


def planner_of(case: Case, profile=None):
    """dsauto's planner for ``case``'s cluster and batch, engine megatron (pricing with the measured
    costs of ``profile`` when given)."""
    from dsauto.search.planner import Planner
    from dsauto.search.space import Constraints
    from dsauto.spec.loaders import load_cluster
    from dsauto.spec.training import TrainSpec

    cluster = load_cluster("cpu", nodes=1, gpus_per_node=case.tp * case.pp * case.dp)
    # The local layer spec's attention is Megatron-core's own unfused DotProductAttention, which
    # keeps the s x s scores: priced as eager attention.
    train = TrainSpec(global_batch=case.micro_batch * case.micro_batches, seq_len=SEQ_LEN, dtype=case.dtype,
                      flash_attention=False)
    model = bench_model(case.mtp_layers, case.tied, case.ep > 1, case.mlp, case.shared_expert)
    return Planner(model, cluster, train, Constraints(engine="megatron"), profile=profile)


def build_plan(case: Case, profile=None):
    """The plan of ``case``, built and priced by :func:`planner_of`."""
    from dsauto.cost.strategy import LayerOption, Strategy
    from dsauto.parallel import ParallelDims

    model = bench_model(case.mtp_layers, case.tied, case.ep > 1, case.mlp, case.shared_expert)
    strategy = Strategy(dims=ParallelDims(dp=case.dp, tp=case.tp, pp=case.pp, ep=case.ep), zero_stage=case.zero_stage,
                        micro_batch=case.micro_batch, grad_accum=case.micro_batches // case.dp,
                        sequence_parallel=False, engine="megatron", grad_reduce_in_fp32=case.grad_reduce_in_fp32,
                        virtual_stages=case.virtual_stages, recompute_modules=case.recompute_modules,
                        expert_capacity_factor=case.capacity or None, expert_pad_to_capacity=bool(case.capacity))
    options = [LayerOption(checkpoint=case.checkpointed(layer, model.num_layers), shard_params=False, split=1,
                           recompute_modules=case.recompute_modules if 1 <= layer <= model.num_layers else ())
               for layer in range(model.num_layers + 2)]
    return planner_of(case, profile).build_plan(strategy, case.stage_layers(model.num_layers), options)


# ---- the worker: one rank of a torchrun launch ------------------------------------------------------

def batches(plan, seed: int, device: str = "cpu") -> Iterator[dict]:
    """This data-parallel rank's micro-batches of random tokens, as GPTModel inputs on ``device``."""
    import torch
    from megatron.core import parallel_state

    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{parallel_state.get_data_parallel_rank()}".encode()))
    positions = torch.arange(plan.seq_len).unsqueeze(0).expand(plan.micro_batch, -1)
    while True:
        tokens = torch.randint(0, plan.model.vocab_size, (plan.micro_batch, plan.seq_len + 1), generator=generator)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": positions}
        yield {name: tensor.to(device) for name, tensor in batch.items()}


def forward_step(data_iterator, model):
    batch = next(data_iterator)  # every stage draws, so that all stay on the same micro-batch

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), loss_func


def build(plan, cuda: bool = False):
    """The rank's model (one module, or a list of its chunks under the interleaved schedule) and
    optimizer, as a Megatron-LM training script builds them with the plugin; ``cuda``: on this
    process's GPU (else on the CPU, through dsauto's Megatron CPU shim)."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    import dsauto.megatron as dm

    # On a GPU the parameters are created on it, as Megatron-LM's get_model does.
    config = dm.apply(plan, TransformerConfig(**dm.transformer_config_kwargs(plan.model),
                                              use_cpu_initialization=not cuda,
                                              attention_backend=AttnBackend.local))
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization=config.normalization)
    chunks = dm.model_chunks(plan, lambda **where: GPTModel(
        config=config, transformer_layer_spec=spec, mtp_block_spec=dm.mtp_block_spec(config, spec, where["vp_stage"]),
        **dm.gpt_model_kwargs(plan), **where))
    if config.bf16 or config.fp16:
        # As Megatron-LM's get_model: every parameter (the norms and the position table too) in 16
        # bits, inputs cast on the first stage, the loss returned in fp32 (transformer/module.py).
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = dm.ddp_config(plan, megatron_fsdp=cuda)
    # As Megatron-LM: one gradient bucket for every chunk after the first.
    model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
             for i, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(dm.optimizer_config(plan, lr=1e-4), model)
    if ddp_config.overlap_grad_reduce:  # reduce gradients once, after each chunk's last micro-batch
        config.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return (model if len(model) > 1 else model[0]), optimizer


@contextlib.contextmanager
def tracked_schedules(tracker) -> Iterator[None]:
    """Regions "forward" and "backward" of ``tracker`` around each micro-batch's forward (the loss
    included) and backward, wherever Megatron-core's schedules (no pipelining, or 1F1B) call them."""
    from megatron.core.pipeline_parallel import schedules

    forward, backward = schedules.forward_step, schedules.backward_step

    def tracked_forward(*args, **kwargs):
        with tracker.region("forward"):
            return forward(*args, **kwargs)

    def tracked_backward(*args, **kwargs):
        with tracker.region("backward"):
            return backward(*args, **kwargs)

    schedules.forward_step, schedules.backward_step = tracked_forward, tracked_backward
    try:
        yield
    finally:
        schedules.forward_step, schedules.backward_step = forward, backward


def train_step(plan, data: Iterator[dict], model, optimizer, tracker=None) -> float | None:
    """One optimizer step as Megatron-LM's train_step runs it, the optimizer's update in ``tracker``'s
    region "optimizer" when one is given; the mean loss on the last stage."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model if isinstance(model, list) else [model]:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=model,
        num_microbatches=plan.grad_accum, seq_length=plan.seq_len,
        micro_batch_size=plan.micro_batch, forward_only=False)
    with tracker.region("optimizer") if tracker is not None else contextlib.nullcontext():
        optimizer.step()
    return float(torch.stack([o["lm loss"] for o in out]).mean()) if out else None


def tracked_training(plan, data: Iterator[dict], tracker, steps: int) -> tuple[object, object, list[float]]:
    """Builds the rank's model and optimizer and trains ``steps`` steps under ``tracker`` (started
    here, before the model is built), with regions "built", "step", "forward", "backward",
    "optimizer" and "between"; returns the model, the optimizer and the last stage's losses."""
    losses = []
    with tracker, tracked_schedules(tracker):
        model, optimizer = build(plan, cuda=tracker.device.type == "cuda")
        with tracker.region("built"):
            pass
        for _ in range(steps):
            with tracker.region("step"):
                loss = train_step(plan, data, model, optimizer, tracker)
            with tracker.region("between"):
                pass
            if loss is not None:
                losses.append(loss)
    return model, optimizer, losses


@contextlib.contextmanager
def received_tokens(plan) -> Iterator[list[int]]:
    """The routed token copies this rank's experts receive, one entry per MoE layer run (forward and
    recomputation, in order), while the context is open; nothing without experts. Read off the
    input of Megatron-core's SequentialMLP (the experts of the local layer spec), which allocates
    nothing more."""
    received: list[int] = []
    if not plan.model.moe:
        yield received
        return
    from megatron.core.transformer.moe.experts import SequentialMLP

    forward = SequentialMLP.forward

    def counted(self, permuted_local_hidden_states, *args, **kwargs):
        received.append(int(permuted_local_hidden_states.shape[0]))
        return forward(self, permuted_local_hidden_states, *args, **kwargs)

    SequentialMLP.forward = counted
    try:
        yield received
    finally:
        SequentialMLP.forward = forward


def expert_load(row) -> float | None:
    """The busiest rank's routed token copies over the balanced mean, in the micro-batch and rank
    that received the most over the model's layers (what the activations at a forward's end hold);
    None without experts."""
    model = row.plan.model
    if not model.moe:
        return None
    layers = len(model.moe_layers())
    mean = row.plan.micro_batch * row.plan.seq_len * model.moe_top_k * layers  # a rank's own tokens' copies
    busiest = max(sum(counts[i:i + layers]) for counts in (r["expert_tokens"] for r in row.ranks)
                  for i in range(0, len(counts), layers))
    return busiest / mean


def worker(plan_path: Path, out_path: Path, timed_steps: int = 0, warmup_steps: int = 2) -> None:
    """Trains the plan in ``plan_path`` for :data:`STEPS` steps under the memory tracker, then (when
    ``timed_steps``) ``warmup_steps`` untimed and ``timed_steps`` timed steps without it; rank 0
    writes every rank's peaks and step times to ``out_path``."""
    import torch
    import torch.distributed as dist

    import dsauto.megatron as dm
    from dsauto.compat import megatron_cpu
    from dsauto.profile.memory import MemoryTracker
    from dsauto.profile.resources import busy_seconds, run_queue_seconds
    from dsauto.profile.run import bind_cpu_rank

    shim = megatron_cpu.enable()
    if timed_steps:
        bind_cpu_rank()  # as dsauto profile timed the layers: one core per rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    plan = dm.load_plan(plan_path)
    dm.initialize_model_parallel(plan)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    # one iterator per model chunk, each yielding the same micro-batches
    data = [batches(plan, 1234) for _ in range(plan.virtual_stages)] if plan.virtual_stages > 1 else batches(plan, 1234)
    tracker = MemoryTracker("cpu")
    with received_tokens(plan) as received:
        model, optimizer, losses = tracked_training(plan, data, tracker, STEPS)
    # Timed steps: the tracker is off (its hooks cost time), the schedules are Megatron's own; each
    # step starts and ends with a barrier, so its time is the slowest rank's. On a machine other
    # processes share, their time slices stretch the step: each step also records the ranks' time
    # on a core and waiting for one (all their threads, summed over the ranks), and the time other
    # processes ran on the core a rank is bound to (its core's busy time less its own threads' time
    # on it; ``others_seconds``: the most of any rank). A rank's gloo threads share its core and wait
    # for it while the step computes, time the step does not lose to other work, so that
    # benchmarks/accuracy.py takes wall - others as the step on cores of the ranks' own. Under load it
    # removes too much where a rank idles (waiting for the other) while other work runs on its core.
    cores = sorted(os.sched_getaffinity(0))
    steps = []
    for _ in range(warmup_steps if timed_steps else 0):
        train_step(plan, data, model, optimizer)
    for _ in range(timed_steps):
        dist.barrier()
        start, (on, waiting), busy = time.perf_counter(), run_queue_seconds(whole_process=True), busy_seconds(cores)
        train_step(plan, data, model, optimizer)
        dist.barrier()
        own = [a - b for a, b in zip(run_queue_seconds(whole_process=True), (on, waiting))]
        others = busy_seconds(cores) - busy - own[0] if len(cores) == 1 else 0.0
        wall = torch.tensor([time.perf_counter() - start, max(0.0, others)], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        cpu = torch.tensor(own, dtype=torch.float64)
        dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
        steps.append({"wall_seconds": float(wall[0]), "on_core_seconds": float(cpu[0]),
                      "waiting_seconds": float(cpu[1]), "others_seconds": float(wall[1])})
    mine = {"rank": dist.get_rank(), "stage": parallel_state.get_pipeline_model_parallel_rank(),
            "losses": losses, "timed_steps": steps, "expert_tokens": received,
            **{name: tracker.peak_bytes(name)
               for name in ("built", "step", "forward", "backward", "optimizer", "between")}}
    ranks: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        out_path.write_text(json.dumps(ranks, indent=1))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    shim.disable()


def layer_times(plan_path: Path, out_path: Path, repeats: int = 15) -> None:
    """On one rank, forward and backward of one micro-batch through a transformer layer, its core
    attention and the loss head, as Megatron-core's local layer spec runs them (the modules this
    benchmark trains) and as dsauto's reference layers run them (what ``dsauto profile`` times):
    the median of runs, each scaled to its time on the core (:func:`dsauto.profile.layers.uncontended`),
    in seconds, written to ``out_path``."""
    import statistics

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import dsauto.megatron as dm
    from dsauto.compat import megatron_cpu
    from dsauto.models.gpt import Block, Head
    from dsauto.profile.layers import uncontended

    shim = megatron_cpu.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    plan = dm.load_plan(plan_path)
    dm.initialize_model_parallel(plan)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = dm.apply(plan, TransformerConfig(**dm.transformer_config_kwargs(plan.model),
                                              use_cpu_initialization=True, attention_backend=AttnBackend.local))
    [gpt] = dm.model_chunks(plan, lambda **where: GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
        **dm.gpt_model_kwargs(plan), **where))
    b, s, h, heads = plan.micro_batch, plan.seq_len, plan.model.hidden_size, plan.model.num_attention_heads
    d = h // heads
    labels = torch.randint(0, plan.model.vocab_size, (b, s))
    block, head = Block(plan.model, tp=1), Head(plan.model, plan.padded_vocab_size, tied_weight=None)
    core = gpt.decoder.layers[0].self_attention.core_attention

    def megatron_layer():
        x = torch.randn(s, b, h, requires_grad=True)  # Megatron's [sequence, batch, hidden]
        out, _ = gpt.decoder.layers[0](x, attention_mask=None)
        out.backward(torch.ones_like(out))

    def reference_layer():
        x = torch.randn(b, s, h, requires_grad=True)
        out = block(x)
        out.backward(torch.ones_like(out))

    def megatron_attention():
        q, k, v = (torch.randn(s, b, heads, d, requires_grad=True) for _ in range(3))
        out = core(q, k, v, attention_mask=None)
        out.backward(torch.ones_like(out))

    def reference_attention():
        q, k, v = (torch.randn(b, heads, s, d, requires_grad=True) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    def megatron_head():
        x = torch.randn(s, b, h, requires_grad=True)
        logits, _ = gpt.output_layer(gpt.decoder.final_layernorm(x), weight=gpt.shared_embedding_or_output_weight())
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.transpose(0, 1).contiguous())
        loss.sum().backward()

    def reference_head():
        x = torch.randn(b, s, h, requires_grad=True)
        loss = head(x, labels)
        loss.backward(torch.ones_like(loss))

    def timed(run):
        def once():
            start = time.perf_counter()
            run()
            return time.perf_counter() - start, 0.0
        for _ in range(3):
            run()
        return statistics.median(t for t, _ in uncontended(once, torch.device("cpu"), repeats))

    runs = {"megatron_layer": megatron_layer, "reference_layer": reference_layer,
            "megatron_attention": megatron_attention, "reference_attention": reference_attention,
            "megatron_head": megatron_head, "reference_head": reference_head}
    out_path.write_text(json.dumps({name: timed(run) for name, run in runs.items()}, indent=1))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    shim.disable()


# ---- the driver -------------------------------------------------------------------------------------

def launch(plan_path: Path, out_path: Path, log: Path, nproc: int, timed_steps: int = 0,
           layers: bool = False) -> None:
    """Runs :func:`worker` (or with ``layers`` :func:`layer_times`) on ``nproc`` CPU ranks with
    torchrun, killed after the timeout (``timed_steps``: steps to time after the tracked ones)."""
    from dsauto.profile.launch import free_port

    port = free_port()  # for the rendezvous
    command = ["timeout", "--signal=KILL", str(LAUNCH_TIMEOUT_SECONDS), sys.executable, "-m",
               "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
               __file__, "--worker", str(plan_path), str(out_path), "--timed-steps", str(timed_steps),
               *(["--layer-times"] if layers else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("a") as out:
        out.write(f"$ {shlex.join(command)}\n")
        out.flush()
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=LAUNCH_TIMEOUT_SECONDS + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this launch started, and only it
            code = proc.wait()
    if code != 0 or not out_path.exists():
        sys.exit(f"{shlex.join(command)} failed (exit {code}); see {log}")


@dataclass(frozen=True)
class Row:
    """One plan's measurement and prediction."""

    case: Case
    plan: object
    ranks: list[dict]

    @property
    def measured(self) -> int:
        return max(r["step"] for r in self.ranks)

    @property
    def predicted(self) -> int:
        return self.plan.prediction.peak_memory_bytes

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def moment(rank: dict) -> str:
    """The region in which a rank's step peaked."""
    return max(("forward", "backward", "optimizer"), key=lambda name: rank[name])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only the plans whose label contains this")
    parser.add_argument("--work", type=Path, default=None, help="folder for plans and logs (default: temporary)")
    parser.add_argument("--worker", nargs=2, type=Path, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--timed-steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--layer-times", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker and args.layer_times:
        layer_times(*args.worker)
        return
    if args.worker:
        worker(*args.worker, timed_steps=args.timed_steps)
        return
    from dsauto.plan_io import write_plan_yaml

    work = args.work or Path(tempfile.mkdtemp(prefix="dsauto-megatron-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    started = time.perf_counter()
    rows = []
    for case in CASES:
        if args.only not in case.label():
            continue
        name = case.label().replace(" ", "_")
        plan = build_plan(case)
        out_path = work / f"{name}.json"
        out_path.unlink(missing_ok=True)
        print(f"{case.label()}: training on {plan.world_size} ranks", file=sys.stderr, flush=True)
        launch(write_plan_yaml(plan, work / f"{name}.yaml"), out_path, log, plan.world_size)
        row = Row(case, plan, json.loads(out_path.read_text()))
        rows.append(row)
        load = expert_load(row)
        print(f"  measured {row.measured / MiB:.2f} MiB, predicted {row.predicted / MiB:.2f} MiB "
              f"({row.error:+.1%})" + (f"; busiest expert rank {load:.3f}x the mean" if load else ""),
              file=sys.stderr, flush=True)
    wall = time.perf_counter() - started
    if not rows:
        sys.exit(f"no plan's label contains {args.only!r}")
    under = max([-row.error for row in rows if row.error < 0], default=0.0)
    summary = (f"median_memory_error={statistics.median(abs(row.error) for row in rows):.1%} "
               f"max_under_prediction={under:.1%} plans={len(rows)}")
    command = "python benchmarks/megatron_memory.py" + (f" --only {shlex.quote(args.only)}" if args.only else "")
    write_results(rows, summary, command, wall)
    print(summary)


def write_results(rows: list[Row], summary: str, command: str, wall: float) -> None:
    from importlib.metadata import version

    RESULTS.mkdir(exist_ok=True)
    model = bench_model()
    lines = [
        "# Megatron-core memory: predicted vs measured peak per rank on 2 CPU ranks",
        "",
        (f"Command: `{command}` (wall {wall:.0f} s; Megatron-core {version('megatron-core')}, torch "
         f"{version('torch')}, gloo, one thread per rank)."),
        "",
        (f"Model: GPT of {model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads, "
         f"FFN {model.ffn_hidden_size}, vocabulary {model.vocab_size} (tied head, learned positions; the mtp plans: "
         f"one multi-token-prediction layer, an untied head, rotary positions; the ep2 plans: "
         f"{EXPERTS['num_experts']} experts of FFN {EXPERTS['moe_ffn_hidden_size']} in every layer, top "
         f"{EXPERTS['moe_top_k']}, no biases, Megatron-core's SequentialMLP experts and alltoall dispatcher; "
         "geglu: a gated GeLU MLP, or experts; swiglu shared: SwiGLU experts and a shared expert of FFN 512), "
         f"{SEQ_LEN} tokens per sequence; "
         f"micro-batches of {MICRO_BATCH}, {GLOBAL_MICRO_BATCHES} per step over all data-parallel ranks; "
         f"**{DTYPE}** (Megatron-core trains in bf16 on CPU: Float16Module, fp32 main gradients, bf16 ones in the "
         "bf16-grads plans, fp32 main weights, torch's AdamW); Megatron-core's unfused local attention, no dropout, no sequence "
         "parallelism. Plans built and priced by `Planner.build_plan` with engine `megatron`. Memory is the "
         "peak of live tensor bytes per rank (`dsauto.profile.memory.MemoryTracker`, every storage an "
         f"operator creates until it is freed; not RSS) over {STEPS} optimizer steps, tracked from before "
         "the model is built."),
        "",
        "| plan | measured peak | predicted peak | error |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row.case.label()} | {row.measured / MiB:.2f} MiB | {row.predicted / MiB:.2f} MiB | "
                     f"{row.error:+.1%} |")
    loads = [(row.case.label(), expert_load(row)) for row in rows if row.plan.model.moe]
    if loads:
        from dsauto.cost.terms import EXPERT_LOAD_IMBALANCE

        lines += ["", ("The ep2 plans price the busiest expert-parallel rank at "
                       f"{EXPERT_LOAD_IMBALANCE}x the mean routed load (dsauto.cost.terms.EXPERT_LOAD_IMBALANCE, "
                       "a stated factor); measured, the most copies any rank's experts received in one "
                       "micro-batch over the layers: "
                       + "; ".join(f"{label} {load:.3f}x" for label, load in loads) + ".")]
    lines += [
        "",
        "Per pipeline stage (largest rank of the stage): the model state measured between steps against",
        "the prediction's parameters, gradients and optimizer states, the peaks of the step's moments, and",
        "the predicted peak.",
        "",
        ("| plan | stage | state between steps | predicted state | forward peak | backward peak | optimizer peak "
         "| predicted peak | error |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for stage in row.plan.stages:
            ranks = [r for r in row.ranks if r["stage"] == stage.stage]
            measured = max(r["step"] for r in ranks)
            state = stage.params_bytes + stage.grads_bytes + stage.optimizer_bytes
            peaks = " | ".join(f"{max(r[name] for r in ranks) / MiB:.2f}" for name in ("forward", "backward", "optimizer"))
            lines.append(f"| {row.case.label()} | {stage.stage} | {max(r['between'] for r in ranks) / MiB:.2f} | "
                         f"{state / MiB:.2f} | {peaks} | {stage.peak_bytes / MiB:.2f} | "
                         f"{(stage.peak_bytes - measured) / measured:+.1%} |")
    losses = {row.case.label(): next(r["losses"] for r in row.ranks if r["losses"]) for row in rows}
    lines += [
        "",
        "(MiB. The state between steps includes the score buffer of unfused attention, which Megatron-core",
        "keeps from the first forward on (1 MiB at tp 1), and on the last pipeline stage the last micro-batch's",
        "received input and its gradient (0.5 MiB); the predicted state has neither, the prediction's",
        "transient has the buffer.)",
        "",
        "Before the Megatron-core terms these measurements led to (`megatron_*` in dsauto/cost/terms.py,",
        "`megatron_stage_bytes` in dsauto/cost/step.py), the same plans were predicted at +0.4%, +9.9%,",
        "-12.2%, -9.1%, +0.8%, +14.1%, +0.6% and +10.2% (median 9.5%, under-prediction up to 12.2%).",
        "Before Megatron-core's routed copies and unfused gated units were priced as it keeps them",
        "(`megatron_routed_copy_change_bytes_per_token`, `megatron_activation_widths`), the ep2",
        "plans came out at -2.6%, -0.3% and -1.5%, the gated GeLU experts at -5.6% with the weighting's term",
        "alone, and the gated GeLU MLP at -7.2%.",
        "",
        "Losses of the tracked steps (last stage): "
        + "; ".join(f"{label}: {', '.join(f'{x:.3f}' for x in values)}" for label, values in losses.items()),
        "",
        "```",
        summary,
        "```",
        "",
    ]
    (RESULTS / "megatron_memory.md").write_text("\n".join(lines))
    plot(rows, summary)


def plot(rows: list[Row], summary: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.5, 5.5))
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    top = max(max(row.measured, row.predicted) for row in rows) / MiB * 1.08
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8)
    ax.fill_between([0, top], [0, top * 0.97], [0, top * 1.03], color="grey", alpha=0.2, label="±3%")
    for row in rows:
        marker = "o" if not row.case.recompute else "s"
        ax.scatter(row.measured / MiB, row.predicted / MiB, marker=marker)
        ax.annotate(row.case.label(), (row.measured / MiB, row.predicted / MiB), fontsize=7,
                    xytext=(4, -10), textcoords="offset points")
    low = min(min(row.measured, row.predicted) for row in rows) / MiB * 0.9
    ax.set_xlim(low, top)
    ax.set_ylim(low, top)
    ax.set_xlabel("measured peak per rank (MiB)")
    ax.set_ylabel("predicted peak per rank (MiB)")
    ax.set_title(f"Megatron-core on 2 CPU ranks, {DTYPE}\n{summary}", fontsize=8)
    ax.legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    figure.savefig(RESULTS / "megatron_memory.png", dpi=120)


if __name__ == "__main__":
    main()
