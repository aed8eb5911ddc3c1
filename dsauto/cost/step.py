"""Time and memory of a whole training step: stages, the 1F1B pipeline, gradient sync, optimizer.

1F1B (Narayanan et al. 2021, Sec. 2.2; PipeDream-Flush): with m micro-batches and stage times
t_i = forward + backward of one micro-batch on stage i, the pipeline time is simulated operation by
operation (dsauto.cost.pipeline); for equal stages it is the familiar (m + p - 1) * t, a bubble
fraction of (p - 1) / m. The step reports m * max_i t_i as compute and the rest as bubble. Stage i
holds the activations of min(p - i, m) micro-batches at once (Narayanan et al. 2021, Sec. 2.2.1).

After the last backward, each stage reduces the gradients ZeRO 0/1 kept whole (overlapped with the
last micro-batch's backward when there is no pipeline: DeepSpeed's overlap_comm, PyTorch DDP's
bucketing), gathers the parameters ZeRO sharded and updates its optimizer shard.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dsauto.cost.calibration import Calibration
from dsauto.cost.layer import CostModel, LayerCost, gathered_unit_params
from dsauto.cost.measured import MeasuredCosts
from dsauto.cost.pipeline import interleaved_pipeline_seconds, pipeline_seconds
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import (
    local_params,
    megatron_boundary_bytes_per_token,
    megatron_score_buffer_bytes,
    megatron_tied_output_table,
    megatron_weight_grad_bytes,
    model_state,
    selective_recompute_flops_per_token,
    sharded_gather_bytes,
    tp_comm_passes,
)
from dsauto.cost.zero3 import (
    gathered_params_bytes,
    head_moment_bytes,
    layer_backward_bytes,
    sharded_param_bytes,
    zero3_moment_peak,
    zero3_moments_apply,
)
from dsauto.engines.deepspeed import SUB_GROUP_SIZE
from dsauto.plan import Basis, Prediction, StagePrediction, rank_chunks, rank_layers
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.model import LayerGroup, ModelSpec, layer_group_per_layer, layer_groups
from dsauto.spec.training import TrainSpec


def layer_group_of(groups: Sequence[LayerGroup], layer: int, num_layers: int) -> LayerGroup:
    """The group descriptor of a layer in flat numbering (0 embedding, 1..L blocks, L+1 head): the
    groups cover the flat layers in order, ``count`` layers each."""
    first = 0
    for group in groups:
        if layer < first + group.count:
            return group
        first += group.count
    raise IndexError(f"layer {layer} is outside the {first} layers of the groups (0..{num_layers + 1})")


def in_flight(stage: int, pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations stage ``stage`` holds at once, counted in whole passes through
    the stage: min(pp - stage, m) under 1F1B. Under the interleaved schedule a rank runs
    ``(pp - stage - 1) * 2 + (v - 1) * pp`` warm-up forwards of one chunk (1/v of its layers where
    they divide) before its first backward (megatron/core/pipeline_parallel/schedules.py,
    ``forward_backward_pipelining_with_interleaving``: num_warmup_microbatches), so it holds that
    many plus one chunk passes, at most all m * v of them, which is pp + (pp - 1) / v passes through
    the stage on the first rank: more than 1F1B's pp (Narayanan et al. 2021, Sec. 2.2.2). That is
    the count where every chunk keeps alike; where a rank's first chunks keep more, its peak is
    :func:`interleaved_peak`'s, which the prediction takes (the layer DP takes this count, and the
    prediction checks its plans: dsauto.search.planner, _fit_tighter)."""
    if virtual_stages == 1:
        return min(pp - stage, micro_batches)
    chunk_passes = (pp - stage - 1) * 2 + (virtual_stages - 1) * pp + 1
    return min(chunk_passes, micro_batches * virtual_stages) / virtual_stages


def interleaved_peak(stage: int, pp: int, micro_batches: int, virtual_stages: int,
                     chunks: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(kept activations, the moment's transient) of rank ``stage`` at the peak of its interleaved
    schedule; ``chunks``: for each of its model chunks, what one pass keeps, the transient at the
    end of its forward (the loss, in the chunk holding the head) and the largest in its backward.

    Megatron-core runs forwards chunk after chunk in groups of pp micro-batches and backwards in the
    reverse chunk order, a forward then a backward in each step of the steady state
    (megatron/core/pipeline_parallel/schedules.py: ``get_schedule_table``, ``get_model_chunk_id``,
    ``microbatch_group_size_per_vp_stage`` pp, Megatron-LM's default), so a rank's first chunks gain
    passes while its last ones drain: where its chunks keep alike, the kept bytes peak at
    :func:`in_flight` passes of each; where its first chunks keep more (more layers, the embedding),
    higher. The steady state repeats every pp x v steps, so one round of it, and the cool-down from
    the state it ends in, are simulated."""
    v = virtual_stages
    keeps = [keep for keep, _, _ in chunks]
    passes = micro_batches * v
    warm_up = min((pp - stage - 1) * 2 + (v - 1) * pp, passes)
    if len(set(chunks)) == 1:  # alike chunks: the most passes held at once, at a forward's end or a backward
        keep, forward, backward = chunks[0]
        return min(warm_up + 1, passes) * keep, max(forward, backward)
    period = pp * v

    def chunk(k: int, forward: bool) -> int:
        c = (k % period) // pp
        return c if forward else v - 1 - c

    held, kept = [0] * v, 0.0  # passes each chunk holds, and the bytes they keep
    best = (-1.0, 0.0, 0.0)  # (kept + transient, kept, transient)

    def hold(c: int, passes: int) -> None:
        nonlocal kept
        held[c] += passes
        kept += passes * keeps[c]

    def moment(transient: float) -> None:
        nonlocal best
        if kept + transient > best[0]:
            best = (kept + transient, kept, transient)

    for k in range(warm_up):
        hold(chunk(k, True), 1)
        moment(chunks[chunk(k, True)][1])
    steady = passes - warm_up
    states = []
    for i in range(min(steady, period)):
        hold(chunk(warm_up + i, True), 1)
        moment(chunks[chunk(warm_up + i, True)][1])
        moment(chunks[chunk(i, False)][2])
        hold(chunk(i, False), -1)
        states.append((list(held), kept))
    if steady > period:  # a whole round changes nothing: the steady state ends as after steady mod period steps
        held, kept = states[steady % period - 1] if steady % period else states[-1]
        held = list(held)
    for k in range(steady, passes):  # the cool-down's backwards
        moment(chunks[chunk(k, False)][2])
        hold(chunk(k, False), -1)
    return best[1], best[2]


def executed_flops_per_token(group: LayerGroup, flash_attention: bool) -> float:
    """Forward FLOPs per token of a layer as its kernels run them: a fused causal attention kernel
    skips the masked half of the score matrix and what sliding windows leave out (Dao 2023,
    FlashAttention-2, Sec. 4.1 counts causal attention at half), eager attention computes all of it.
    Counting the full square would put long-sequence plans above the device's peak."""
    attention = group.attention_flops_per_token
    if flash_attention and group.causal:
        attention *= 0.5 * group.attention_window_fraction
    return group.matmul_flops_per_token + attention


def mtp_flops_per_token(group: LayerGroup, engine: str, flash_attention: bool) -> float:
    """Forward FLOPs per token of the multi-token-prediction layers a Megatron-core head runs beside it
    (:attr:`LayerGroup.mtp_block`, each with its loss through the head's output weight), as
    :func:`executed_flops_per_token` counts them; 0 for any other layer or engine (transformers, which
    DeepSpeed plans train, does not build them). Megatron-LM's own FLOPs count includes them."""
    if engine != "megatron" or group.mtp_block is None:
        return 0.0
    return group.mtp_layers * (executed_flops_per_token(group.mtp_block, flash_attention)
                               + group.matmul_flops_per_token)


def first_chunk_share(layers: int, virtual_stages: int) -> float:
    """The share of a pipeline rank's transformer layers in its first model chunk: ceil(n / v) of its
    n layers, the earlier chunks taking the remainder (:func:`dsauto.plan.chunk_layers`); 1/v when
    they divide, 1 for one chunk, 0 for a rank without transformer layers."""
    if virtual_stages == 1:
        return 1.0
    return math.ceil(layers / virtual_stages) / layers if layers > 0 else 0.0


def p2p_hidden_fraction(strategy: Strategy, comm_overlap_efficiency: float) -> float:
    """How much of a pipeline rank's steady-state transfers its compute hides: the device's overlap
    efficiency under Megatron-core's interleaved schedule with overlapped transfers
    (:attr:`Strategy.p2p_overlap`), else 0 (every transfer waited on)."""
    overlaps = strategy.engine == "megatron" and strategy.virtual_stages > 1 and strategy.p2p_overlap
    return comm_overlap_efficiency if overlaps else 0.0


def p2p_exposed_seconds(stage_seconds: float | np.ndarray, sends_seconds: float,
                        hidden: float) -> float | np.ndarray:
    """The steady-state time a pipeline rank waits for its transfers of one micro-batch
    (``sends_seconds``: its chunks' inputs received and outputs sent, forward and backward) beside
    ``stage_seconds`` of its compute, a fraction ``hidden`` of the overlapped part hidden
    (:func:`p2p_hidden_fraction`; :meth:`dsauto.cost.terms.DeviceModel.overlapped`): all of it when
    nothing overlaps, at least (1 - hidden) of it. Takes numbers or arrays."""
    return (np.maximum(stage_seconds, sends_seconds) + (1 - hidden) * np.minimum(stage_seconds, sends_seconds)
            - stage_seconds)


def interleaved_makespan(stage_seconds: Sequence[float], micro_batches: int, virtual_stages: int,
                         first_chunk_seconds: Sequence[float] | None = None) -> float:
    """Closed form of a pipeline step: m times the slowest stage plus the fill and drain of the
    others. The interleaved schedule cuts them to one chunk's pass per rank (Narayanan et al. 2021,
    Sec. 2.2.2: bubble (p - 1) / v of a micro-batch's pass): the first micro-batch's forward and the
    last one's backward cross every rank in its first chunk (``first_chunk_seconds``, which holds the
    most layers when they do not divide, :func:`first_chunk_share`; None: 1/v of each stage). With
    one chunk this is 1F1B's sum_i t_i + (m - 1) max_i t_i. The layout search's objective; predictions
    simulate the schedules (:mod:`dsauto.cost.pipeline`), which uneven chunks (the head's) cost more."""
    slowest = max(stage_seconds)
    index = list(stage_seconds).index(slowest)
    chunks = ([t / virtual_stages for t in stage_seconds] if first_chunk_seconds is None
              else list(first_chunk_seconds))
    return micro_batches * slowest + sum(t for i, t in enumerate(chunks) if i != index)


def bucket_bytes(groups: Sequence[LayerGroup], tp: int, dtype_bytes: int) -> int:
    """Bucket size for gradient reduction: one transformer layer's local
    parameters, between 16 MiB and 1 GiB (DeepSpeed's default is 5e8 elements)."""
    block = max((g for g in groups if g.kind == "transformer"), key=lambda g: g.params)
    local = (block.tp_params / tp + block.params - block.tp_params) * dtype_bytes
    return int(min(2**30, max(2**24, local)))


DEEPSPEED_ALLREDUCE_ELEMENTS = 500_000_000
"""Elements DeepSpeed flattens into one all-reduce without ZeRO (engine.py, ``allreduce_gradients``'s
``MEMORY_OPT_ALLREDUCE_SIZE``)."""


def held_bucket_bytes(strategy: Strategy, bucket: int, dtype_bytes: int) -> int:
    """Memory of one reduction bucket of ``bucket`` bytes in the training dtype as the engine
    allocates it: ZeRO-3's persistent bucket takes its communication dtype (deepspeed/runtime/zero/
    stage3.py, ``ipg_buckets`` by dtype, each ``buffer`` of ``reduce_bucket_size`` elements), fp32
    under DeepSpeed-Ulysses (the engine passes ``seq_parallel_communication_data_type``, fp32 by
    default: engine.py); measured on two CPU ranks at sequence-parallel size 2, bf16, a bucket of
    2**20 elements: 2 MiB more at every moment of the step than without. ZeRO 1-2 keep their
    buckets in the training dtype (``_gradient_reduction_buffer_dtype``)."""
    if strategy.engine == "deepspeed" and strategy.zero_stage == 3 and strategy.dims.cp > 1:
        return bucket * 4 // dtype_bytes
    return bucket


def prefetch_bytes(groups: Sequence[LayerGroup], tp: int, dtype_bytes: int,
                   options: Sequence[LayerOption], num_layers: int, experts_whole: bool = False) -> int:
    """ZeRO-3 prefetch bucket: the largest unit any sharded layer gathers at once, so that one unit
    is gathered ahead of the one in use; the emitted ``stage3_max_live_parameters`` is twice it,
    the gathered parameters the cost model prices (:func:`dsauto.cost.zero3.gathered_params_bytes`);
    0 when nothing is sharded."""
    units = [gathered_unit_params(layer_group_of(groups, j, num_layers), option, tp, experts_whole)
             for j, option in enumerate(options) if option.shard_params]
    return int(max(units, default=0) * dtype_bytes)


@dataclass(frozen=True)
class StepPrediction:
    """The prediction of one complete assignment."""

    prediction: Prediction
    stages: tuple[StagePrediction, ...]


def stage_constant_bytes(strategy: Strategy, bucket: int, grads_bytes: float) -> int:
    """Memory a rank holds besides its layers at the peak of a step, when there is data parallelism
    to reduce over (``grads_bytes``: the stage's gradients on this rank).

    DeepSpeed's buffers differ by ZeRO stage:
    - ZeRO-0 all-reduces the gradients flattened into one copy per bucket of up to 5e8 elements
      (``DeepSpeedEngine.allreduce_bucket``), so a second copy of the gradients exists meanwhile;
    - ZeRO-1/2 with ``overlap_comm`` fill two reduction buckets alternately during backward
      (``ipg_buffer`` in stage_1_and_2.py); on one pipeline stage each moment of the step holds its
      own share of them (:func:`deepspeed_moment_peak`; this returns what all of them hold at
      least), under the pipeline engine ZeRO-1 holds them only when it accumulates micro-batches;
    - ZeRO-3 keeps one contiguous gradient bucket for the whole run (``__ipg_bucket_flat_buffer``
      in stage3.py).

    Megatron-core reduces each bucket in place in its contiguous gradient buffer, which the
    gradient bytes already count (megatron/core/distributed/param_and_grad_buffer.py: a bucket's
    ``grad_data`` is a view of the buffer): nothing more.
    """
    if deepspeed_pipeline_applies(strategy):
        # DeepSpeed's pipeline engine over one data-parallel rank: its moments
        # (:func:`deepspeed_pipeline_moment_peak`) include one where no gradient exists yet (the
        # loss of a step's first micro-batch), so, as a lower bound, none of the gradient column.
        return -int(grads_bytes)
    if strategy.dims.replicas <= 1 or strategy.engine == "megatron":
        return 0
    if strategy.zero_stage == 0:
        return int(grads_bytes)
    if deepspeed_moments_apply(strategy):
        # ZeRO-1/2 on one stage: what every backward moment holds beyond the layers' columns
        # (:func:`deepspeed_moment_peak`), at least: a lower bound of the peak for the layer DP,
        # whose plans the prediction then checks. From the second micro-batch on, ZeRO-1 holds its
        # buckets at every moment and ZeRO-2 its gradient partition (counted in the layers'
        # columns); in a step's only micro-batch the loss comes before any gradient exists, so the
        # gradient column the layers count is not there yet (a negative constant).
        if strategy.grad_accum > 1 and strategy.offload == "none":
            return 2 * bucket if strategy.zero_stage == 1 else 0
        # In a step's only micro-batch, or with offload at every moment (no gradient stays on the
        # device), the gradient column is not there.
        return -int(grads_bytes)
    if strategy.zero_stage == 1 and strategy.grad_accum == 1:
        # ZeRO-1 under the pipeline engine without accumulation reduces once, after the flush, when
        # the activations are freed (stage_1_and_2.py, ``reduce_gradients(pipeline_parallel=True)``).
        return 0
    return (2 if strategy.zero_stage < 3 else 1) * bucket


def gradient_transient_bytes(strategy: Strategy, bucket: int, largest_grad_bytes: float,
                             local_grads_bytes: float) -> int:
    """Gradients autograd has produced that ZeRO has not taken in yet, at the start of backward when
    the activations are still alive. Measured with :class:`dsauto.profile.memory.MemoryTracker`
    regions around forward, backward and step on two CPU ranks (DeepSpeed 0.19.8; the 17M-parameter
    GPT of benchmarks/plan_quality.py, whose largest matrix is its 16 MiB tied embedding), backward
    peaked at 305.2, 305.5 and 281.8 MiB under ZeRO-1 (micro-batch 1 x 8), ZeRO-2 (1 x 8) and
    ZeRO-3 (2 x 4), against forward peaks of 281.8, 217.7 and 258.0 MiB; tests/cost/test_cost.py
    holds the prediction to those peaks:

    - a fresh weight gradient exists next to the one it is added to (ZeRO-1 accumulating into
      ``.grad``), or next to the bucket it is copied into (ZeRO-2/3 reduction hooks);
    - ZeRO-2 with ``overlap_comm`` keeps the raw gradients of the two buckets in flight until their
      reduction finishes (``ipg_buffer`` double buffering in stage_1_and_2.py).

    Never more than the stage's unpartitioned gradients, ``local_grads_bytes`` (a 1M-parameter GPT
    has 4 MiB of them, less than one 16 MiB bucket).

    Megatron-core: 0 here; autograd's gradient of a weight, in the parameter dtype until the DDP
    hook folds it into the fp32 ``main_grad`` buffer, belongs to the moment of that weight's
    backward, which each layer's transient prices (:func:`dsauto.cost.terms.megatron_weight_grad_bytes`).
    """
    if strategy.engine == "megatron":
        return 0
    if strategy.dims.replicas <= 1 or strategy.zero_stage == 0:
        return 0  # ZeRO-0's gradients are priced by phase in predict_step
    if deepspeed_moments_apply(strategy):
        return 0  # ZeRO-1/2 on one stage: by moment in deepspeed_moment_peak
    if zero3_moments_apply(strategy):
        return 0  # ZeRO-3 on one stage: by moment in dsauto.cost.zero3.zero3_moment_peak
    if strategy.zero_stage == 1:
        awaiting = largest_grad_bytes if strategy.grad_accum > 1 else 0.0
    elif strategy.zero_stage == 2:
        awaiting = largest_grad_bytes + 2 * bucket
    else:
        awaiting = largest_grad_bytes
    return int(min(awaiting, local_grads_bytes))


def deepspeed_moments_apply(strategy: Strategy) -> bool:
    """Whether :func:`deepspeed_moment_peak` prices the strategy's stage: DeepSpeed with data
    parallelism, without ZeRO, or with ZeRO-1/2 on one pipeline stage, with or without the
    optimizer offloaded (the pipeline engine reduces ZeRO-1 gradients after the flush: its buffers
    differ)."""
    if strategy.engine != "deepspeed" or strategy.dims.replicas <= 1:
        return False
    if strategy.zero_stage == 0:
        return True
    return strategy.zero_stage in (1, 2) and strategy.pp == 1


def offload_staging_bytes(strategy: Strategy, largest_param_bytes: float, partition_grads_bytes: float
                          ) -> tuple[float, float]:
    """(device, host) bytes ZeRO-1/2 with ``offload_optimizer`` keeps besides the optimizer state
    (deepspeed/runtime/zero/stage_1_and_2.py, DeepSpeed 0.19.8, ``DeepSpeedZeroOptimizer.__init__``):
    ``temp_grad_buffer_for_gpu_offload`` on the device and ``temp_grad_buffer_for_cpu_offload`` on
    the host, each the size of the model's largest parameter, for the whole run; and under ZeRO-2,
    when a step accumulates micro-batches, the host copies of the gradients of this rank's
    partition (``async_accumulate_grad_in_cpu_via_gpu``: one buffer per parameter in the partition,
    from the first micro-batch's reduction on, kept for the run). Measured tensor by tensor on two
    CPU ranks (benchmarks/accuracy.py --plans variants): 4 + 4 MiB for the 4 MiB table of
    bench-gpt, and under ZeRO-2 8.25 MiB of accumulated gradients for its 8.15 MiB partition (the
    parameter at the partition's edge counts whole); ZeRO-1, which reduces only at the last
    micro-batch, kept none. (0, 0) without offload or ZeRO-1/2."""
    if strategy.engine != "deepspeed" or strategy.offload == "none" or strategy.zero_stage not in (1, 2):
        return 0.0, 0.0
    accumulated = partition_grads_bytes if strategy.grad_accum > 1 and strategy.zero_stage == 2 else 0.0
    return largest_param_bytes, largest_param_bytes + accumulated


def ulysses_cast_bytes(strategy: Strategy, bucket: int, local_grads: float, grads_in_16_bits: bool,
                       largest_grad: float = 0.0) -> float:
    """The fp32 copy a reduction of DeepSpeed without ZeRO or with ZeRO-1/2 holds under
    DeepSpeed-Ulysses with 16-bit gradients, which all-reduces in fp32 (the communication dtype it
    forces): each flattened 16-bit bucket is cast to fp32 for its reduction (engine.py and
    stage_1_and_2.py, ``allreduce_bucket``), twice its bytes. ZeRO-0 flattens ``local_grads`` after
    backward in buckets of at most 5e8 elements (``allreduce_no_retain``), one at a time; ZeRO-1/2
    reduce two buckets of ``bucket`` bytes at once, the two ``overlap_comm`` keeps in flight while a
    layer's backward fills the next (measured on CPU ranks, where gloo's threads free a reduced copy
    when they finish with it: one or two copies from run to run), and a gradient larger than a bucket
    (``largest_grad``: the stage's largest) whole, beside the bucket in flight (``average_tensor`` of
    ``extra_large_param_to_reduce``). 0 otherwise (ZeRO-3 keeps its bucket in fp32:
    :func:`held_bucket_bytes`)."""
    if strategy.engine != "deepspeed" or strategy.dims.cp <= 1 or not grads_in_16_bits or strategy.zero_stage > 2:
        return 0.0
    if strategy.zero_stage == 0:
        return 2.0 * min(local_grads, DEEPSPEED_ALLREDUCE_ELEMENTS * 2)
    return 2.0 * min(local_grads, 2 * bucket if largest_grad <= bucket else bucket + largest_grad)


def deepspeed_moment_peak(strategy: Strategy, params: float, grads: float, optim: float, activation: float,
                          head_transient: float, layers: Sequence[tuple[float, float]], bucket: int,
                          awaiting_grad: float, local_grads: float, embedding_grad: float, tied_grad: float,
                          backward_working: float, single_tensor: bool, staging: float = 0.0,
                          grads_in_16_bits: bool = False, accumulator: float = 0.0,
                          largest_grad: float = 0.0) -> float:
    """Peak bytes of a DeepSpeed rank over the moments of a step, each with what the engine holds
    then. ``grads``: the gradient column (whole under ZeRO 0/1, this rank's partition under ZeRO-2);
    ``activation``: the kept activations; ``layers``: per transformer layer of the stage, in
    backward order, (the activations held while its backward runs: those of the layers before it,
    its own and its transient, such as its recomputed activations; the unpartitioned gradients of
    the layers after it); ``local_grads``: the unpartitioned gradients; ``bucket``: the emitted
    ``reduce_bucket_size`` in bytes; ``awaiting_grad``: a weight gradient autograd holds through
    backward before a hook takes it (the output layer's gradient of a tied embedding table);
    ``embedding_grad``: the embedding's gradients; ``tied_grad``: the output layer's share of a tied
    embedding table (0 if untied); ``backward_working``: what a layer's backward creates on top of
    its saved activations at its fullest (:func:`mlp_backward_bytes`).

    The moments, ``params`` and ``optim`` held at each:

    - the loss (``head_transient``: the logits' log-softmax and its gradients, before any weight
      gradient exists) on top of the kept activations;
    - each layer's backward, with the engine's reduction buffers and the gradients it holds then;
    - the embedding's backward, the last, when the activations are gone: the embedding's gradient,
      and under tied embeddings the output layer's gradient of the table, which waited since the
      loss (a weight's hook fires once its gradient is whole), and their sum (``tied_grad`` twice);
    - after backward: ZeRO-0's flattened all-reduce copy, and the optimizer update
      (:func:`optimizer_step_bytes`: ZeRO-1/2's, or 16-bit ZeRO-0's FP16_UnfusedOptimizer's).

    Under DeepSpeed-Ulysses with 16-bit gradients each reduction also holds an fp32 copy of what
    it reduces (ZeRO-0: the flat gradients; ZeRO-1/2: two buckets, :func:`ulysses_cast_bytes`).
    Measured on two CPU ranks (benchmarks/deepspeed_update.py, bf16, sequence-parallel size 2, 8M
    parameters, buckets of 2**20 elements): backward's peak 32 MiB (ZeRO-0) and 4 or 8 MiB (ZeRO-1,
    -2; priced 8) above the same step without Ulysses.

    What the engine holds besides (DeepSpeed 0.19.8; measured tensor by tensor on two CPU ranks,
    benchmarks/results/accuracy.md):

    - Without ZeRO, gradients stay in ``.grad``: those of the layers after the one in backward, and
      from a step's second micro-batch on all of them (accumulated); after backward
      ``allreduce_no_retain`` flattens them into one copy per 5e8 elements (engine.py,
      ``allreduce_bucket``): twice the gradients. ZeRO-1 keeps them in ``.grad`` the same way in
      the micro-batches before the last (it reduces only at the accumulation boundary).
    - ZeRO-1/2 with the emitted ``overlap_comm`` and ``contiguous_gradients`` allocate both
      ``reduce_bucket_size`` buffers at the first gradient hook of a backward (stage_1_and_2.py,
      ``setup_buckets`` from ``process_gradients``) and free them when the backward's reduction
      ends (``independent_gradient_partition_epilogue`` -> ``_release_ipg_buffers``): ZeRO-2 after
      every backward, ZeRO-1 only after the last micro-batch's, so from its second micro-batch on
      ZeRO-1 holds them at the loss too.
    - A bucket reduced during backward, once the gradients of the layers after the one in backward
      exceed a bucket, is copied into ``grads_in_partition`` (``copy_grads_in_partition``: this
      rank's partition). ZeRO-2 moves it into ``all_grad_tensors`` at the end of each backward and
      adds the next micro-batches' to it (the epilogue's ``get_all_grad_tensors``): from the second
      micro-batch on it holds the accumulated partition and the one being filled.

    The loss before any gradient, the tied table's three copies at the embedding's backward and
    ``backward_working`` are autograd's, not the engine's: ZeRO-3 has them too
    (:mod:`dsauto.cost.zero3` prices its own moments).
    """
    m = strategy.grad_accum
    later = m > 1  # a micro-batch after the first holds what the earlier ones left
    buffers = 2.0 * bucket if strategy.zero_stage else 0.0
    # Under DeepSpeed-Ulysses, a reduction's fp32 copy (ulysses_cast_bytes), at the moments a bucket
    # is reduced: a layer's backward once a bucket's worth of gradients came after it, the last
    # reduction at the embedding's backward.
    reducing = ulysses_cast_bytes(strategy, bucket, local_grads, grads_in_16_bits, largest_grad)
    bucket_reducing = reducing if strategy.zero_stage else 0.0
    if strategy.offload != "none" and strategy.zero_stage in (1, 2):
        # ZeRO-Offload: ``optim`` is on the host, and no gradient stays on the device: each is
        # copied into the reduction buckets by its hook (``contiguous_gradients`` is forced on) and
        # from there to the host's fp32 partition, or under accumulation to the host copies
        # (stage_1_and_2.py, ``copy_grads_in_partition``). Measured tensor by tensor (see
        # :func:`offload_staging_bytes`): the parameters, both buckets from the first gradient
        # hook on, the device staging buffer and the activations of the moment, no gradients;
        # ZeRO-1 with offload measured the same peak as ZeRO-2 in one micro-batch. ZeRO-1 reduces
        # only at the last micro-batch, so before it the gradients accumulate in ``.grad`` and it
        # keeps its buckets, as without offload: measured at the second micro-batch's loss, the
        # whole 16.3 MiB of gradients beside the two buckets.
        kept = grads if later and strategy.zero_stage == 1 else 0.0
        held = max((h + backward_working + awaiting_grad + (bucket_reducing if after > bucket else 0.0)
                    for h, after in layers), default=0.0)
        loss = activation + head_transient + (buffers if later and strategy.zero_stage == 1 else 0.0)
        return params + staging + kept + max(loss, held + buffers,
                                             buffers + embedding_grad + 2 * tied_grad + bucket_reducing)
    partition = local_grads / strategy.dims.replicas  # ZeRO-1's partition (ZeRO-2's is ``grads``)
    layer = 0.0
    for held_activation, after in layers:
        if strategy.zero_stage == 0:
            kept = grads if later else after
        elif strategy.zero_stage == 1:
            kept = grads if later else (partition if after > bucket else 0.0)
        else:
            kept = (grads if later else 0.0) + (grads if after > bucket else 0.0)
        layer = max(layer, held_activation + backward_working + awaiting_grad + buffers + kept
                    + (bucket_reducing if after > bucket else 0.0))
    reduces = local_grads > bucket  # a bucket is reduced (and copied out) during backward
    embedding = buffers + embedding_grad + 2 * tied_grad + bucket_reducing
    if strategy.zero_stage == 0:
        loss = activation + head_transient + (grads if later else 0.0)
        embedding = grads + 2 * tied_grad
        stepping = optimizer_step_bytes(strategy, params, grads, optim, bucket, single_tensor,
                                        grads_in_16_bits=grads_in_16_bits, accumulator=accumulator)
        return max(params + optim + max(loss, layer, embedding, 2 * grads + reducing), stepping)
    if strategy.zero_stage == 1:
        loss = activation + head_transient + (grads + buffers if later else 0.0)
        embedding += grads if later else partition if reduces else 0.0
    else:
        loss = activation + head_transient + (grads if later else 0.0)
        embedding += (grads if later else 0.0) + (grads if reduces else 0.0)
    stepping = optimizer_step_bytes(strategy, params, grads, optim, bucket, single_tensor,
                                    grads_in_16_bits=grads_in_16_bits)
    return max(params + optim + max(loss, layer, embedding), stepping)


def deepspeed_pipeline_applies(strategy: Strategy) -> bool:
    """Whether :func:`deepspeed_pipeline_moment_peak` prices the strategy's stages: DeepSpeed's
    pipeline engine (pp > 1, ZeRO 0 or 1) over one data-parallel rank (over more, ZeRO-0 stages keep
    the data-parallel moments, ZeRO-1 the columns)."""
    return (strategy.engine == "deepspeed" and strategy.pp > 1 and strategy.dims.replicas == 1
            and strategy.zero_stage <= 1)


def deepspeed_pipeline_moment_peak(strategy: Strategy, stage: int, flight: float, params: float, grads: float,
                                   optim: float, activation: float, head_transient: float,
                                   layers: Sequence[tuple[float, float]], bucket: int, boundary: float,
                                   logits: float, backward_working: float, stepping: float = 0.0) -> float:
    """Peak bytes of a rank of DeepSpeed's pipeline engine over the moments of a step (1F1B,
    deepspeed/runtime/pipe/schedule.py ``TrainSchedule``; engine.py ``PipelineEngine``, DeepSpeed
    0.19.8). ``activation``: what one micro-batch keeps on this stage; ``flight``: micro-batches in
    flight (:func:`in_flight`); ``layers`` as in :func:`deepspeed_moment_peak` for one micro-batch;
    ``boundary``: one micro-batch's activation between stages; ``logits``: one micro-batch's logits
    (the head's output).

    What the engine holds besides the layers' own:

    - ``pipe_buffers['outputs']``: a stage's output of each micro-batch in flight, until its
      backward ends (``_exec_backward_pass`` frees it); on the last stage the logits, which its
      backward never frees (it returns after the loss's backward): each of the
      ``num_pipe_buffers()`` = max(2, min(pp - stage, m)) slots keeps the logits of the last
      micro-batch that used it, across steps, so min(2, m) of them at every moment;
    - ``pipe_recv_buf`` on every stage but the first and ``grad_layer`` on every stage but the last:
      one boundary activation each, allocated once (``_exec_recv_activations``, ``_exec_recv_grads``);
      and on every stage but the first a copy of each received activation in
      ``pipe_buffers['inputs']`` (``recvd``, cloned again by ``_exec_forward_pass`` for the layers,
      which the layers' activations count), until its gradient is sent back: as many as the slots
      the micro-batches fill, min(max(2, pp - stage), m) (measured: two on the last stage of pp 2
      with 2 micro-batches);
    - gradients: ``.grad`` accumulates over the micro-batches (the engine's gradient-accumulation
      boundary is forced only in ``_exec_reduce_grads``); after the flush ZeRO-0 all-reduces them
      flattened into one copy (``allreduce_gradients`` -> ``buffered_allreduce_fallback``), even
      over one data-parallel rank: twice the gradients. ZeRO-1 runs without ``overlap_comm`` under
      the pipeline engine (engine.py ``_configure_zero_optimizer`` turns it off for a
      ``PipelineModule``), so it allocates one ``reduce_bucket_size`` buffer at the first gradient
      hook of the step (stage_1_and_2.py ``setup_buckets``; the second is for overlap only) and
      keeps it until the reduction after the flush, whose ``reduce_gradients(pipeline_parallel=True)``
      appends another before releasing both. Measured tensor by tensor on two CPU ranks: one 16 MiB
      bucket in backward.

    The moments: each layer's backward in the first micro-batch (the others in flight kept, the
    gradients of the layers after it) and in the second (as many in flight as remain, every
    gradient); the loss on the last stage; the reduction after the flush; the update (``stepping``,
    :func:`optimizer_step_bytes`, beside the kept buffers).
    """
    m = strategy.grad_accum
    last = stage == strategy.pp - 1
    out = 0.0 if last else boundary  # this stage's output, kept until its backward
    received = (1 + min(max(2, strategy.pp - stage), m)) * boundary if stage > 0 else 0.0
    pipe = received + (0.0 if last else boundary) + (logits * min(2, m) if last else 0.0)
    buffers = float(bucket) if strategy.zero_stage == 1 else 0.0
    working = max((held + backward_working for held, _ in layers), default=0.0)
    after = max((held + backward_working + later for held, later in layers), default=0.0)
    first = (flight - 1) * (activation + out) + out + after + buffers
    moments = [first]
    if m > 1:
        moments.append(min(flight - 1, m - 2) * (activation + out) + out + working + grads + buffers)
    if last:
        moments.append(activation + head_transient + (grads + buffers if m > 1 else 0.0))
    moments.append(2 * grads if strategy.zero_stage == 0 else grads + 2 * bucket)
    return max(params + optim + pipe + max(moments), stepping + pipe)


def mlp_backward_bytes(model: ModelSpec, tokens: int, tp: int, dtype_bytes: int) -> float:
    """What a transformer layer's backward holds at its fullest beside its saved activations, under
    DeepSpeed: in the MLP output projection's backward, the gradient of the MLP's inner activation
    (tokens x ffn / tp; a gated MLP's gradients of its gate and up projections at once, from the
    backward of their product) next to the projection's weight gradient (ffn / tp x hidden), which
    its hook then copies into a reduction bucket (torch.autograd's linear and elementwise
    backward formulas; measured tensor by tensor on two CPU ranks: 2 x 1 MiB + 0.4 MiB for
    the llama-shaped model of benchmarks/accuracy.py at 2 x 256 tokens). A mixture of experts'
    layers are counted with the dense width (``ffn_hidden_size``)."""
    ffn = model.ffn_hidden_size / tp
    return (tokens * ffn * (2 if model.gated_mlp else 1) + ffn * model.hidden_size) * dtype_bytes


def optimizer_step_bytes(strategy: Strategy, params: float, grads: float, optim: float, bucket: int,
                         single_tensor: bool, largest_main_param_bytes: float = 0.0,
                         grads_in_16_bits: bool = False, optimizer_bytes_per_param: int = 12,
                         sub_group_size: int = SUB_GROUP_SIZE, accumulator: float = 0.0) -> float:
    """Memory of a rank during the optimizer update, when the activations are gone, or 0 where the
    update holds nothing the other moments of the step do not (DeepSpeed: fp32 without ZeRO). The
    ZeRO optimizers, over any number of data-parallel ranks (one included: a pipeline's ZeRO-1),
    hand torch's AdamW (the emitted ``torch_adam`` with ``fused``) one flat fp32 partition (``optim``
    holds it and the two moments, 12 bytes per parameter) and, as its gradient, the partition's
    gradients flattened into one new tensor of their dtype and cast to fp32
    (deepspeed/runtime/zero/stage_1_and_2.py, ``step``: ``flatten`` then ``.to``; stage3.py,
    ``_prepare_fp32_grad_for_sub_group``, the same). In fp32 the cast returns the flat copy itself:
    one partition-sized fp32 temporary. With 16-bit gradients (``grads_in_16_bits``) the flat 16-bit
    copy and its fp32 cast are both alive while the cast runs, beside the gradients they were made
    from: 6 bytes per element of the partition. ZeRO-3 does this per sub-group of its partition,
    releasing each fp32 copy after its update (``_release_sub_group``); a sub-group closes once it
    holds ``sub_group_size`` elements (``_create_fp16_sub_groups``; by default DeepSpeed's default,
    which dsauto's configs write out), so its temporaries are those of at most that many elements
    plus one parameter's partition (``largest_main_param_bytes``, in fp32) less one. The fused update
    works in place, on a CPU as on CUDA (``torch._fused_adamw_``), and makes none (torch's default
    multi-tensor and per-tensor updates made one and two more). ZeRO-3 also keeps its gradient
    bucket. ZeRO-1 has reduce-scattered its gradients into the partition by then.
    Measured (the 17M-parameter GPT of tests/cost/test_cost.py, 2 CPU ranks, fp32, DeepSpeed 0.19.8,
    torch 2.13, a tracker region around the update): 225.4 MiB under ZeRO-1 and -2, 209.1 MiB under
    ZeRO-3, which this reproduces to 0.1 MiB. In bf16 and fp32, eight 1024 x 1024 linear layers
    (benchmarks/deepspeed_update.py): ZeRO-1 and -2 96 and 112 MiB, ZeRO-3 90 and 100 MiB, each as
    this prices it; with sub-groups of 2**20 elements (two layers' partitions) 72 and 88 MiB, which
    the bound of one partition more prices 3 and 2 MiB over; without ZeRO, bf16's update 160 MiB
    (16-bit parameters and gradients, 12 bytes of state and the 4-byte copies of the gradients).

    Megatron-core's distributed optimizer steps its fp32 main-parameter shards with the gradient
    buffer's shard as their gradient (no copy under bf16's fp32 buffer) and a fused multi-tensor
    Adam (Transformer Engine's or Apex's FusedAdam), then copies the updated shards into the 16-bit
    parameters in place (megatron/core/optimizer/distrib_optimizer.py): no partition-sized
    temporaries, so the update is never the peak (0). Without Transformer Engine and Apex (a CPU),
    Megatron-core falls back to torch's AdamW (megatron/core/optimizer/__init__.py), whose per-tensor
    implementation on CPU tensors makes two temporaries the size of each fp32 main parameter (or
    shard) it updates, one tensor at a time (torch/optim/adamw.py, ``_single_tensor_adamw``: the
    second moment's square root and its quotient by the bias correction): ``largest_main_param_bytes``
    twice. Measured
    (benchmarks/megatron_memory.py, bf16, tp 1): the update peaked 8 MiB above the model state,
    twice the 4 MiB fp32 word embedding.

    A 16-bit gradient buffer (fp16 training, or bf16 with ``--grad-reduce-in-bf16``:
    ``grads_in_16_bits``) is no fp32 gradient the main parameters can take as theirs: both Megatron-core
    optimizers hand each fp32 main parameter (or shard) ``.float()`` of its gradient, a new fp32 tensor
    that lives from the update to the next step's ``zero_grad`` (megatron/core/optimizer/optimizer.py,
    ``Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads``; distrib_optimizer.py, the
    same method, which Megatron-FSDP skips, as the precision-aware optimizer of an offloaded plan
    does with its ``decoupled_grad``): 4 bytes per main parameter of the rank (``optim`` over
    ``optimizer_bytes_per_param``).
    Measured (benchmarks/megatron_memory.py, bf16 gradients, DP 2): the update peaked 16.3 MiB (ZeRO 0)
    and 8.2 MiB (ZeRO 1) above the model state, the fp32 copies of 4.3M and 2.1M gradients.

    The precision-aware optimizer (``optimizer_bytes_per_param`` then its state's bytes) hands
    Transformer Engine's FusedAdam the gradient shard itself (``decoupled_grad``: no fp32 copy), except
    under FP8 current scaling, where Megatron-core keeps the fp32 main weights and copies as above
    (optimizer_config.py, ``use_precision_aware_optimizer_no_fp8_or_ds_fp8``). FusedAdam makes fp32
    copies of fp16 and fp8 moments for a whole parameter group before its kernel runs (transformer_engine/
    pytorch/optimizers/fused_adam.py, ``step`` and ``get_unscaled_state``; bf16 and fp32 ones are used
    as they are): 2 x 4 bytes per main parameter of the rank."""
    if strategy.engine == "megatron":
        main = optim / optimizer_bytes_per_param  # the main parameters (or shards) the rank updates
        moments = strategy.precision_aware_optimizer
        decoupled = moments is not None and not (strategy.fp8 and strategy.fp8_recipe == "tensorwise")
        copies = (4 * main if grads_in_16_bits and strategy.zero_stage <= 1 and strategy.offload == "none"
                  and not decoupled else 0.0)
        copies += 2 * 4 * main if moments in ("fp16", "fp8") else 0.0
        if single_tensor:
            return params + grads + optim + copies + 2 * largest_main_param_bytes
        return params + grads + optim + copies if copies else 0.0
    elements = (optim - accumulator) / optimizer_bytes_per_param  # of the fp32 partition the rank updates
    if strategy.zero_stage == 0:
        # Without ZeRO, 16-bit training casts the gradients of the rank's fp32 main weights to fp32
        # before the update, beside the 16-bit gradients: FP16_UnfusedOptimizer, which DeepSpeed wraps
        # torch's AdamW in (engine.py, _do_optimizer_sanity_check and _configure_fp16_optimizer),
        # every parameter's gradient at once (runtime/fp16/unfused_optimizer.py, ``step``); under a
        # bf16 pipeline BF16_Optimizer, its partition of the accumulator (``accumulator``: its bytes,
        # which ``optim`` holds; dsauto.plan.deepspeed_bf16_optimizer).
        return params + grads + optim + 4 * elements if grads_in_16_bits else 0.0
    if strategy.zero_stage == 3:  # one sub-group at a time
        elements = min(elements, sub_group_size + largest_main_param_bytes / 4 - 1)
    temporaries = elements * (2 + 4 if grads_in_16_bits else 4)  # the flat copy, and its fp32 cast
    kept_grads = grads / strategy.dims.replicas if strategy.zero_stage == 1 else grads
    return params + kept_grads + optim + temporaries + (bucket if strategy.zero_stage == 3 else 0)


def deepspeed_step_bytes(strategy: Strategy, cost: CostModel, params: float, grads: float, optim: float,
                         bucket: int, single_tensor: bool, held: Sequence[LayerGroup]) -> float:
    """:func:`optimizer_step_bytes` of a DeepSpeed stage holding the layer groups ``held``: its
    gradients' dtype, and the fp32 partition of its largest parameter, which bounds a ZeRO-3
    sub-group (each parameter is partitioned over the data-parallel ranks)."""
    largest = max((g.largest_op_params for g in held), default=0.0) / strategy.tp / strategy.dims.replicas
    return optimizer_step_bytes(strategy, params, grads, optim, bucket, single_tensor, 4 * largest,
                                cost.context.grad_bytes_per_param < 4, cost.context.optimizer_bytes_per_param,
                                accumulator=grads if cost.context.bf16_optimizer else 0.0)


def megatron_stage_bytes(model: ModelSpec, train: TrainSpec, strategy: Strategy, cost: CostModel,
                         by_layer: Sequence[LayerGroup], held: Sequence[int], options: Sequence[LayerOption],
                         costs: Sequence[LayerCost], flight: float, bucket: int,
                         single_tensor: bool, interleaved: tuple[float, float] | None = None
                         ) -> tuple[float, float, float, float, float, float]:
    """(params, grads, optimizer, activation, transient, peak) bytes of a Megatron-core pipeline rank
    that holds the flat layers ``held`` (``by_layer``: each flat layer's group,
    :func:`dsauto.spec.model.layer_group_per_layer`; ``costs``: their layer costs), ``flight`` micro-batches in
    flight (each chunk's output kept per pass); ``interleaved``: the layers' kept activations and
    the moment's transient at the rank's peak under the interleaved schedule (:func:`interleaved_peak`),
    in place of ``flight`` passes of every layer and the largest layer moment.

    The layer costs are Megatron's already (:func:`dsauto.cost.terms.state_bytes_per_param`, and in
    :func:`dsauto.cost.terms.activation_memory` the unfused softmax, the loss and each weight's
    gradient); each layer's transient is a moment of the step (the loss, or the backward of that
    layer), and the peak is the largest of them on top of every kept activation. This adds what
    Megatron-core allocates per rank rather than per layer (the ``megatron_*`` terms of
    :mod:`dsauto.cost.terms`, each with its source and measurement): the tied output copy on a last
    stage, a tied table's gradient at the transformer layers' backward on a rank holding both ends,
    the score buffer of unfused attention, the pipeline outputs the schedule keeps and the
    gradient a stage receives in backward, and the optimizer update's temporaries on a CPU
    (:func:`optimizer_step_bytes`). Measured with tracker regions around forward, backward and the
    optimizer step (benchmarks/megatron_memory.py). ``transient`` is what the other columns miss.
    """
    tp, b, tokens, ctx = strategy.tp, train.dtype_bytes, cost.tokens, cost.context
    dynamic = cost.calibration.activation_memory
    num_layers = model.num_layers
    params = sum(c.params_bytes for c in costs)
    grads = sum(c.grads_bytes for c in costs)
    optim = sum(c.optimizer_bytes for c in costs)
    holds_head = num_layers + 1 in held
    if model.tied_embeddings and holds_head and 0 not in held:
        table = megatron_tied_output_table(by_layer[0])
        copy = model_state(table, options[num_layers + 1], ctx)
        params, grads, optim = params + copy.params_bytes, grads + copy.grads_bytes, optim + copy.optimizer_bytes

    boundary = megatron_boundary_bytes_per_token(model.hidden_size, b, ctx.replicated_div) * tokens * dynamic
    chunks = strategy.virtual_stages
    outputs = (chunks - 1 if holds_head else chunks) * flight if strategy.pp > 1 else 0.0
    kept = sum(c.activation_bytes for c in costs) * flight if interleaved is None else interleaved[0]
    activation = kept + outputs * boundary
    blocks = [by_layer[j] for j in held]
    blocks = [g for g in blocks if g.kind == "transformer"]
    buffer = (max(megatron_score_buffer_bytes(g, tokens, tp, b) for g in blocks) * dynamic
              if blocks and not train.flash_attention else 0.0)
    received = boundary if strategy.pp > 1 and not holds_head else 0.0
    # On a rank that holds both ends of a tied word embedding, the table's gradient lives from the
    # head's backward to the embedding's, through every transformer layer's backward moment
    # (megatron_weight_grad_bytes).
    tied_grad = (megatron_weight_grad_bytes(by_layer[0], tp, b) * dynamic
                 if model.tied_embeddings and holds_head and 0 in held else 0.0)
    moments = [c.transient_bytes + (tied_grad if by_layer[j].kind == "transformer" else 0.0)
               for j, c in zip(held, costs)]
    transient = buffer + received + (max(moments, default=0.0) if interleaved is None else interleaved[1])
    peak = params + grads + optim + activation + transient

    # The update's temporaries follow the largest fp32 main parameter, or its shard under the
    # distributed optimizer (at most this rank's share of the stage).
    largest = max((g.largest_op_params / tp for g in (by_layer[j] for j in held)),
                  default=0.0)
    if strategy.zero_stage >= 1 and strategy.dims.replicas > 1:  # sharded over dp x cp (or an instance)
        largest = min(largest, params / b / (strategy.dims.replicas // strategy.dist_opt_instances))
    grads_in_16_bits = train.dtype != "fp32" and ctx.grad_bytes_per_param == 2
    stepping = optimizer_step_bytes(strategy, params, grads, optim, bucket, single_tensor, 4 * largest,
                                    grads_in_16_bits, ctx.optimizer_bytes_per_param) + buffer
    if stepping > peak:
        peak = stepping
        transient = peak - (params + grads + optim + activation)
    return params, grads, optim, activation, transient, peak


def predict_step(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, strategy: Strategy,
                 stage_layers: Sequence[int], options: Sequence[LayerOption],
                 profile: MeasuredCosts | None = None, calibration: Calibration | None = None,
                 reduce_bucket: int | None = None, prefetch_bucket: int | None = None) -> StepPrediction:
    """Predicts a step of ``strategy`` with ``stage_layers`` transformer layers per stage and one
    option per flat layer (``len(options) == num_layers + 2``), from measured layer costs where
    ``profile`` has them, corrected by ``calibration`` (default: the profile's).

    ``reduce_bucket`` and ``prefetch_bucket`` (bytes) price other buffer sizes than the ones the
    search picks (:func:`bucket_bytes`, :func:`prefetch_bytes`): the refiner tries both."""
    num_layers = model.num_layers
    if len(options) != num_layers + 2:
        raise ValueError(f"{len(options)} options for {num_layers + 2} layers")
    groups = layer_groups(model, train.seq_len, train.dtype_bytes, strategy.tp)
    by_layer = layer_group_per_layer(model, groups, train.seq_len, train.dtype_bytes, strategy.tp)
    cost = CostModel(cluster, train, strategy, model.hidden_size, profile, calibration)
    layer_cost = functools.cache(cost.layer)  # pure: the layers of one group and option cost the same
    m, pp = strategy.grad_accum, strategy.pp
    p2p = cost.p2p_seconds() if pp > 1 else 0.0
    hidden = p2p_hidden_fraction(strategy, cluster.device.comm_overlap_efficiency)
    exposures: list[float] = []  # each stage's transfers per micro-batch that the step waits for
    bucket = bucket_bytes(groups, strategy.tp, train.dtype_bytes) if reduce_bucket is None else reduce_bucket
    held_bucket = held_bucket_bytes(strategy, bucket, train.dtype_bytes)  # what one takes in memory
    # The emitted ZeRO-3 prefetch bucket, which bounds the parameters held gathered (dsauto.cost.zero3).
    default_prefetch = prefetch_bytes(groups, strategy.tp, train.dtype_bytes, options, num_layers,
                                      strategy.experts_gathered_whole)

    stages, tails, times = [], [], []
    dispatch: list[float] = []  # each stage's expert all-to-alls per micro-batch
    tp_comm: list[float] = []  # each stage's tensor-parallel collectives per micro-batch
    offloaded: list[float] = []  # each stage's host bytes per rank (offload)
    plain_bubble: float | None = None
    hardware_flops = 0.0
    v = strategy.virtual_stages
    for i, held in enumerate(rank_layers(stage_layers, v, strategy.chunk_layout)):
        first, last = held[0], held[-1]
        costs: list[LayerCost] = []
        for j in held:
            group = by_layer[j]
            costs.append(layer_cost(group, options[j]))
            passes = 4 if options[j].checkpoint else 3  # forward, backward (2x), recomputation
            hardware_flops += passes * executed_flops_per_token(group, train.flash_attention) * cost.tokens
            hardware_flops += selective_recompute_flops_per_token(group, options[j], train.flash_attention) * cost.tokens
            hardware_flops += 3 * mtp_flops_per_token(group, strategy.engine, train.flash_attention) * cost.tokens
        # the multi-token-prediction layers beside a Megatron-core head (priced in its layer cost)
        beside = [block for j in held if strategy.engine == "megatron" and (block := by_layer[j].mtp_block)
                  for _ in range(by_layer[j].mtp_layers)]
        if model.moe:
            dispatch.append(sum(cost.expert_dispatch_seconds(by_layer[j])  # a recomputed forward's again
                                * (1.5 if options[j].checkpoint or "moe" in options[j].recompute_modules else 1.0)
                                for j in held)
                            + sum(cost.expert_dispatch_seconds(g) for g in beside))
        tp_passes = [tp_comm_passes(by_layer[j], options[j], cost.context) for j in held]
        tp_passes += [tp_comm_passes(g, LayerOption(False, False, 1, strategy.recompute_modules), cost.context)
                      for g in beside]
        tp_comm.append(sum(t.forward_seconds + t.backward_seconds for t in tp_passes))
        # Each of the rank's v chunks receives its input and sends its output once per micro-batch,
        # in forward and in backward; what the step waits for of them, half in each.
        forward = sum(c.forward_seconds for c in costs)
        backward = sum(c.backward_seconds for c in costs)
        waits = float(p2p_exposed_seconds(forward + backward, 2 * v * p2p, hidden))
        exposures.append(waits)
        forward, backward = forward + waits / 2, backward + waits / 2
        flight = in_flight(i, pp, m, v)
        activation = sum(c.activation_bytes for c in costs) * flight
        interleaved = None
        passes_f: list[float] = []  # interleaved: each chunk's forward and backward, the waits spread evenly
        passes_b: list[float] = []
        if v > 1:
            chunk_of = rank_chunks(stage_layers, v, i, strategy.chunk_layout)
            passes_f, passes_b = [waits / (2 * v)] * v, [waits / (2 * v)] * v
            for k, c in zip(chunk_of, costs):
                passes_f[k] += c.forward_seconds
                passes_b[k] += c.backward_seconds
            per_chunk = [[0.0, 0.0, 0.0] for _ in range(v)]  # kept, at the end of forward, in backward
            for k, j, c in zip(chunk_of, held, costs):
                per_chunk[k][0] += c.activation_bytes
                per_chunk[k][1] = max(per_chunk[k][1], c.transient_bytes if j == num_layers + 1 else 0.0)
                per_chunk[k][2] = max(per_chunk[k][2], c.transient_bytes)
            interleaved = interleaved_peak(i, pp, m, v, [tuple(row) for row in per_chunk])
            activation = interleaved[0]
        params = sum(c.params_bytes for c in costs)
        grads = sum(c.grads_bytes for c in costs)
        optim = sum(c.optimizer_bytes for c in costs)
        layer_transient = max((c.transient_bytes for c in costs), default=0.0)  # a stage may be empty
        largest_grad = max((gathered_unit_params(by_layer[j], options[j], strategy.tp, strategy.experts_gathered_whole)
                            for j in held), default=0.0) * train.dtype_bytes
        largest_param = max((by_layer[j].largest_op_params for j in held), default=0.0) \
            / strategy.tp * train.dtype_bytes * cost.calibration.static_memory  # its gradient's bytes too
        staging, host_staging = offload_staging_bytes(
            strategy, largest_param,
            grads * (strategy.dims.replicas if strategy.zero_stage >= 2 else 1) / max(1, strategy.dims.replicas))
        transient = (layer_transient + stage_constant_bytes(strategy, held_bucket, grads)
                     + gradient_transient_bytes(strategy, bucket, largest_grad * cost.calibration.static_memory,
                                                grads * (strategy.dims.replicas if strategy.zero_stage >= 2 else 1)))
        if strategy.engine == "deepspeed" and any(cost.context.shards(options[j]) for j in held):
            # ZeRO-3 beyond the moments (offload): the gathered parameters at every moment, beside
            # the unit in use each layer counts (dsauto.cost.zero3).
            sharded = sharded_param_bytes([by_layer[j] for j in held], options, held,
                                          strategy.tp, train.dtype_bytes)
            transient += (gathered_params_bytes(sharded, prefetch_bucket or default_prefetch)
                          * cost.calibration.activation_memory)
        if strategy.engine == "megatron":
            params, grads, optim, activation, transient, peak = megatron_stage_bytes(
                model, train, strategy, cost, by_layer, held, options, costs, flight, bucket,
                cluster.device.name == "cpu", interleaved)
        elif deepspeed_moments_apply(strategy):
            # DeepSpeed without ZeRO or with ZeRO-1/2: the peak of the moments of the step, each
            # with what the engine holds then (deepspeed_moment_peak).
            head = num_layers + 1
            table = by_layer[0]
            scale = train.dtype_bytes * cost.calibration.static_memory
            embedding_grad = local_params(table, strategy.tp) * scale if 0 in held else 0.0
            tied_grad = (table.largest_op_params / strategy.tp * scale
                         if model.tied_embeddings and 0 in held and head in held else 0.0)
            unpartitioned = strategy.dims.replicas if strategy.zero_stage >= 2 else 1
            layers, later_activation, later_grads = [], 0.0, 0.0
            for j, c in reversed(list(zip(held, costs))):  # backward order
                if 1 <= j <= num_layers:
                    layers.append((activation - later_activation + c.transient_bytes, later_grads))
                later_activation += c.activation_bytes  # freed once its backward is done
                later_grads += c.grads_bytes * unpartitioned
            peak = deepspeed_moment_peak(
                strategy, params, grads, optim, activation,
                head_transient=max((c.transient_bytes for j, c in zip(held, costs) if j == head), default=0.0),
                layers=layers, bucket=bucket, awaiting_grad=tied_grad,
                local_grads=grads * unpartitioned,
                embedding_grad=embedding_grad, tied_grad=tied_grad,
                backward_working=mlp_backward_bytes(model, cost.tokens, strategy.tp, train.dtype_bytes)
                * cost.calibration.activation_memory if any(1 <= j <= num_layers for j in held) else 0.0,
                single_tensor=cluster.device.name == "cpu", staging=staging,
                grads_in_16_bits=cost.context.grad_bytes_per_param < 4,
                accumulator=grads if cost.context.bf16_optimizer else 0.0,
                largest_grad=largest_param)
            transient = max(0.0, peak - (params + grads + optim + activation))  # what the columns miss
        elif deepspeed_pipeline_applies(strategy):
            # DeepSpeed's pipeline engine: the moments of its 1F1B step (deepspeed_pipeline_moment_peak).
            head = num_layers + 1
            if model.tied_embeddings and head in held and 0 not in held:
                # A tied table is a TiedLayerSpec at both ends: the last stage builds the embedding
                # module too, which its optimizer updates like its own layers, and DeepSpeed keeps the
                # copies equal by all-reducing their gradients (deepspeed/runtime/pipe/module.py,
                # _index_tied_modules; engine.py, _exec_reduce_tied_grads).
                copy = model_state(by_layer[0], options[0], cost.context)
                params, grads, optim = params + copy.params_bytes, grads + copy.grads_bytes, optim + copy.optimizer_bytes
            dynamic = cost.calibration.activation_memory
            one = sum(c.activation_bytes for c in costs)  # one micro-batch's
            layers, later_activation, later_grads = [], 0.0, 0.0
            for j, c in reversed(list(zip(held, costs))):  # backward order
                if 1 <= j <= num_layers:
                    layers.append((one - later_activation + c.transient_bytes, later_grads))
                later_activation += c.activation_bytes
                later_grads += c.grads_bytes
            head_group = by_layer[head]
            peak = deepspeed_pipeline_moment_peak(
                strategy, i, flight, params, grads, optim, one,
                head_transient=max((c.transient_bytes for j, c in zip(held, costs) if j == head), default=0.0),
                layers=layers, bucket=bucket,
                boundary=cost.tokens * model.hidden_size * train.dtype_bytes * dynamic,
                logits=cost.tokens * head_group.largest_op_params / model.hidden_size / strategy.tp
                * train.dtype_bytes * dynamic,
                backward_working=mlp_backward_bytes(model, cost.tokens, strategy.tp, train.dtype_bytes) * dynamic
                if any(1 <= j <= num_layers for j in held) else 0.0,
                stepping=deepspeed_step_bytes(strategy, cost, params, grads, optim, bucket,
                                              cluster.device.name == "cpu", [by_layer[j] for j in held]))
            transient = max(0.0, peak - (params + grads + optim + activation))  # what the columns miss
        elif zero3_moments_apply(strategy):
            # DeepSpeed ZeRO-3: the moments of the step, with the parameters the coordinator holds
            # gathered at each of them in place of each sharded layer's unit in use (dsauto.cost.zero3).
            head = num_layers + 1
            dynamic = cost.calibration.activation_memory
            held_groups = [by_layer[j] for j in held]
            working = dynamic * layer_backward_bytes(cost.tokens, model.hidden_size, model.ffn_hidden_size,
                                                     strategy.tp, train.dtype_bytes)
            own = [c.transient_bytes - dynamic * sharded_gather_bytes(g, options[j], cost.context)
                   + (working if g.kind == "transformer" else 0.0) for j, g, c in zip(held, held_groups, costs)]
            sharded = sharded_param_bytes(held_groups, options, held, strategy.tp, train.dtype_bytes)
            table_sharded = options[0 if model.tied_embeddings else head].shard_params
            head_group = by_layer[head]
            peak = zero3_moment_peak(
                params, grads, optim, stage_constant_bytes(strategy, held_bucket, grads),
                gathered_params_bytes(sharded, prefetch_bucket or default_prefetch) * dynamic, activation,
                head_activation=sum(c.activation_bytes for j, c in zip(held, costs) if j == head) * flight,
                head_transient=max((head_moment_bytes(t, head_group, options[head], table_sharded, cost.tokens,
                                                      strategy.tp, train.dtype_bytes, dynamic)
                                    for j, t in zip(held, own) if j == head), default=0.0),
                body_transient=max((t for j, t in zip(held, own) if j != head), default=0.0),
                awaiting_grad=min(largest_grad * cost.calibration.static_memory, grads * strategy.dims.replicas),
                stepping=deepspeed_step_bytes(strategy, cost, params, grads, optim, held_bucket,
                                              cluster.device.name == "cpu", [by_layer[j] for j in held]))
            transient = max(0.0, peak - (params + grads + optim + activation))  # what the columns miss
        else:
            peak = params + grads + optim + activation + transient
            stepping = deepspeed_step_bytes(strategy, cost, params, grads, optim, held_bucket,
                                            cluster.device.name == "cpu", [by_layer[j] for j in held])
            if stepping > peak:  # the optimizer update, after the activations are gone, is the peak
                peak = stepping
                transient = peak - (params + grads + optim + activation)
        stages.append(StagePrediction(
            stage=i, first_layer=first, last_layer=last, micro_batches_in_flight=math.ceil(flight),
            forward_seconds=forward, backward_seconds=backward, params_bytes=int(params),
            grads_bytes=int(grads), optimizer_bytes=int(optim), activation_bytes=int(activation),
            transient_bytes=int(transient), peak_bytes=int(peak), basis=_basis(costs),
            chunk_forward_seconds=tuple(passes_f), chunk_backward_seconds=tuple(passes_b),
        ))
        times.append(forward + backward)
        sync_bytes = sum(c.grad_sync_bytes for c in costs)
        bucket_share = bucket / max(sync_bytes, grads, 1.0)
        if strategy.engine == "megatron" and v > 1:
            # Each model chunk's own passes and traffic.
            chunk_sync, chunk_gather = [0.0] * v, [0.0] * v
            for k, c in zip(chunk_of, costs):
                chunk_sync[k] += c.grad_sync_bytes
                chunk_gather[k] += c.step_seconds
            exposed = _interleaved_exposed(cost, passes_f, passes_b,
                                           [cost.grad_sync_seconds(b) if b else 0.0 for b in chunk_sync],
                                           chunk_gather, pp, bucket_share, *_megatron_overlaps(strategy))
        else:
            sync = cost.grad_sync_seconds(sync_bytes)
            gather = sum(c.step_seconds for c in costs)
            if strategy.engine == "megatron":
                exposed = _megatron_exposed(cost, forward, backward, sync, gather, bucket_share,
                                            *_megatron_overlaps(strategy))
            elif pp == 1:  # reduced in buckets during the last micro-batch's backward
                exposed = cost.overlapped(backward, sync) - backward + gather
            else:  # DeepSpeed's pipeline engine reduces after the flush
                exposed = sync + gather
        tails.append((exposed, sum(c.optimizer_seconds for c in costs)))
        offloaded.append(sum(c.offloaded_bytes for c in costs) + host_staging)

    slowest = max(times)
    compute = m * slowest
    if v == 1:  # the 1F1B schedule, simulated
        makespan = pipeline_seconds([st.forward_seconds for st in stages],
                                    [st.backward_seconds for st in stages], m)
    else:
        # Megatron-core's interleaved schedule, simulated over each rank's chunk passes (the closed
        # form misses what uneven chunks cost, the head's chunk above all); the fill and drain also
        # wait for each boundary's transfers, once each way (the steady state's share is in the passes).
        makespan = (interleaved_pipeline_seconds([list(st.chunk_forward_seconds) for st in stages],
                                                 [list(st.chunk_backward_seconds) for st in stages], m,
                                                 int(strategy.expert_a2a_overlap))
                    + 2 * (pp - 1) * p2p)
        # The same stages as one chunk each (1F1B, whose transfers are waited on): one boundary to
        # cross per micro-batch each way.
        plain = [t - waits + 2 * p2p for t, waits in zip(times, exposures)]
        plain_bubble = max(0.0, interleaved_makespan(plain, m, 1) - m * max(plain)) * cost.calibration.pipeline_bubble
    # The slowest stage runs all m micro-batches, so the makespan is at least m of them; max() drops
    # the rounding of a schedule whose other stages all fit in its gaps.
    bubble = max(0.0, makespan - compute) * cost.calibration.pipeline_bubble
    exposed, optimizer = max(tails, key=lambda e: e[0] + e[1])
    step = compute + bubble + exposed + optimizer
    # Per data-parallel replica the stages above run concurrently; scale FLOPs to the cluster.
    # hardware_flops covers one micro-batch over all stages of one replica, split over tp ranks.
    step_hardware_flops = hardware_flops * m * strategy.dims.replicas  # each cp rank its share
    tokens = train.global_batch * train.seq_len
    model_flops = 3 * tokens * sum(g.count * executed_flops_per_token(g, train.flash_attention)
                                   + mtp_flops_per_token(g, strategy.engine, train.flash_attention)
                                   for g in layer_groups(model, train.seq_len, train.dtype_bytes, 1,
                                                         pad_vocab=False))
    world = cluster.world_size
    peak_flops = cluster.device.flops(train.dtype)
    prediction = Prediction(
        step_seconds=step,
        tokens_per_second=tokens / step,
        mfu=model_flops / (step * world * peak_flops),
        tflops_per_device=step_hardware_flops / (step * world) / 1e12,
        peak_memory_bytes=max(s.peak_bytes for s in stages),
        compute_seconds=compute,
        bubble_seconds=bubble,
        exposed_comm_seconds=exposed,
        optimizer_seconds=optimizer,
        basis=_basis([st for st in stages]),
        profile=cost.profile.key if cost.profile is not None else "",
        plain_bubble_seconds=plain_bubble,
        offloaded_bytes=int(max(offloaded)),
        expert_all_to_all_seconds=m * dispatch[times.index(slowest)] if dispatch else 0.0,
        tp_comm_seconds=m * tp_comm[times.index(slowest)],
        p2p_seconds=m * exposures[times.index(slowest)],
    )
    return StepPrediction(prediction, tuple(stages))


def _megatron_overlaps(strategy: Strategy) -> tuple[bool, bool]:
    """Whether Megatron-core overlaps the gradient reduction and the parameter gather with compute
    (:attr:`Strategy.overlap_grad_reduce`, :attr:`Strategy.overlap_param_gather`); Megatron-FSDP
    (ZeRO 2-3) is priced with both, as dsauto's plans run it."""
    fsdp = strategy.zero_stage >= 2
    return strategy.overlap_grad_reduce or fsdp, strategy.overlap_param_gather or fsdp


def _megatron_exposed(cost: CostModel, forward: float, backward: float, sync: float, gather: float,
                      bucket_share: float, overlap_grads: bool = True, overlap_params: bool = True) -> float:
    """The data-parallel communication Megatron-core leaves exposed once per step, with the
    ``--overlap-grad-reduce`` and ``--overlap-param-gather`` the emitted plan turns on, for one model
    chunk a rank (interleaved pipelines: :func:`_interleaved_exposed`).

    - Gradients: each bucket's reduction starts as soon as its gradients are final, during the last
      micro-batch's backward on every stage (1F1B runs the gradient sync only for that micro-batch:
      megatron/core/pipeline_parallel/schedules.py, ``no_sync_func`` / ``finalize_model_grads``);
      the bucket that fills last (the first layers) can only start when backward ends, so at
      least its share is exposed.
    - Parameters (distributed optimizer, Megatron-FSDP): the all-gather of the updated shards is
      dispatched bucket by bucket before the next step's forward uses them
      (distributed_data_parallel.py, ``start_param_sync`` with the forward pre-hooks), so it hides
      behind the first micro-batch's forward except for the first bucket.

    ``bucket_share``: one bucket's fraction of the stage's gradients (the last-bucket exposure).
    Without ``overlap_grads`` (``--overlap-grad-reduce``) the reduction runs whole after the backward,
    without ``overlap_params`` (``--overlap-param-gather``) the gather whole after the optimizer step:
    each then exposed whole.
    """
    share = min(1.0, max(0.0, bucket_share))
    grads = max(cost.overlapped(backward, sync) - backward, share * sync) if overlap_grads else sync
    params = max(cost.overlapped(forward, gather) - forward, share * gather) if overlap_params else gather
    return grads + params


def _interleaved_exposed(cost: CostModel, forward: Sequence[float], backward: Sequence[float],
                         sync: Sequence[float], gather: Sequence[float], group: int, bucket_share: float,
                         overlap_grads: bool = True, overlap_params: bool = True) -> float:
    """:func:`_megatron_exposed` for a rank of ``len(forward)`` model chunks, each with its own
    buffers: one micro-batch's ``forward`` and ``backward`` per chunk, and its once-per-step
    gradient reduction ``sync`` and parameter gather ``gather`` (seconds alone on the network),
    as Megatron-LM runs the interleaved schedule with --overlap-grad-reduce and
    --overlap-param-gather and their default alignment (schedules.py,
    ``forward_backward_pipelining_with_interleaving``, with ``grad_sync_func`` and ``param_sync_func``
    set by megatron/training/training.py).

    - Gradients: a chunk's reduction is launched whole once the backward of its last micro-batch is
      done (on the first pipeline rank, the step's critical one, without delay). The backward ends
      chunk by chunk, the last chunk first, each ``group`` (pp) passes of a chunk after the one
      before it; so each reduction runs beside the later chunks' passes, queued behind the earlier
      reductions on the one data-parallel group, and the first chunk's, launched as the backward
      ends, is exposed whole.
    - Parameters: the first chunk is gathered bucket by bucket as its forward starts (its first
      bucket, ``bucket_share`` of the stage's traffic, exposed); the second is launched at the
      step's start and each later one as the chunk before it starts its forward, queued likewise,
      and the forward waits where one is not through when its chunk starts (the warm-up runs
      ``group`` passes of a chunk before the next).

    What runs beside compute slows it at the device's overlap efficiency, as in
    :meth:`~dsauto.cost.terms.DeviceModel.overlapped`. Without ``overlap_grads`` or ``overlap_params``
    every chunk's reduction, or gather, runs after the backward, or the optimizer step: exposed whole
    (finalize_model_grads, and the distributed optimizer's ``step_with_ready_grads``)."""
    lag = 1.0 - cost.device.comm_overlap_efficiency
    # Gradients, from the start of the last group of backward passes.
    clock, free = 0.0, 0.0
    for b, s in zip(reversed(backward), reversed(sync)):
        clock += group * b  # this chunk's last micro-batch is through its backward
        free = max(free, clock) + s
    tail = max(0.0, free - clock)
    grads = tail + lag * (sum(sync) - tail) if overlap_grads else sum(sync)
    if not overlap_params:
        return grads + sum(gather)
    # Parameters, from the step's start.
    share = min(1.0, max(0.0, bucket_share))
    first = max(cost.overlapped(forward[0], gather[0]) - forward[0], min(share * sum(gather), gather[0]))
    starts = [group * sum(forward[:k]) for k in range(len(forward))]  # each chunk's first forward, on time
    free, late, stalls = gather[0], first, 0.0  # late: how far the forward runs behind its schedule
    for k in range(1, len(forward)):
        free = max(free, starts[k - 1] + late if k > 1 else 0.0) + gather[k]
        wait = max(0.0, free - (starts[k] + late))  # at most gather[k]: the one before was through
        stalls, late = stalls + wait, late + wait
    params = first + stalls + lag * (sum(gather[1:]) - stalls)
    return grads + params


def _basis(parts: Sequence[LayerCost] | Sequence[StagePrediction]) -> Basis:
    """``measured`` when every part was, ``analytic`` when none was, else ``mixed``."""
    kinds = {("measured" if p.measured else "analytic") if isinstance(p, LayerCost) else p.basis
             for p in parts}
    if not kinds:
        return "analytic"  # an empty pipeline stage prices nothing
    return kinds.pop() if len(kinds) == 1 else "mixed"
