"""The terms of one layer's cost, each a pure function of the layer group, its option and a context.

Compute is a roofline on the device spec: matrix multiplies at a size-dependent fraction of peak
FLOP/s, bandwidth-bound kernels at a fraction of memory bandwidth (Williams, Waterman and Patterson
2009, "Roofline"). Backward costs twice the forward FLOPs (the gradients with respect to inputs and
to weights; Kaplan et al. 2020, Sec. 2.1) and twice the forward memory traffic.

Memory per rank follows ZeRO (Rajbhandari et al. 2020, Sec. 3 and 5): mixed-precision Adam keeps
2 bytes of parameters, 2 of gradients and 12 of optimizer state (fp32 master, momentum, variance)
per parameter; stage 1 shards the 12 over the data-parallel ranks, stage 2 the gradients too, stage 3
the parameters too. Activations per token follow :mod:`dsauto.spec.model` (Korthikanti et al. 2022).

Every term returns calibrated numbers: compute times carry ``calibration.compute``, the collectives'
groups carry ``calibration.communication`` already, memory carries the two memory factors.
:meth:`dsauto.cost.layer.CostModel.layer` composes the terms into a :class:`LayerCost`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsauto.cost.calibration import Calibration
from dsauto.cost.collectives import AllToAll, Group
from dsauto.cost.measured import MeasuredCosts, MeasuredLayer
from dsauto.cost.strategy import LayerOption
from dsauto.engines.deepspeed import MOE_CAPACITY_FACTOR
from dsauto.plan import MOMENT_BYTES, AttentionKernel, CpCommType, Engine, ExpertDispatcher, Fp8Recipe, MomentsDtype
from dsauto.spec.cluster import DeviceSpec
from dsauto.spec.model import LayerGroup

# Weight matrices of a transformer layer as Megatron and the reference model fuse them: QKV, the
# attention output projection, the MLP input (gate and up fused for SwiGLU) and the MLP output.
MATRICES_PER_LAYER = 4

# Modules of the embedding (tables, dropout and the container) and of the head (norm, LM head and
# the container) in the reference implementation, hooked by ZeRO-3 like any other.
EDGE_LAYER_MODULES = 4

# A fused attention kernel's backward over its forward in FLOPs: five matrix multiplies against two
# (FlashAttention-2, Dao 2023, Sec. 3.1.2 and 4.1).
FUSED_ATTENTION_BACKWARD = 2.5

# FP8 training (Transformer Engine): bytes moved per element of a linear layer's input when it is
# quantized, read in 16 bits (2) and written in FP8 as it is and transposed (1 + 1); current
# (tensorwise) scaling first reads it once more for its maximum (Float8CurrentScalingQuantizer).
FP8_CAST_BYTES = 4
FP8_AMAX_BYTES = 2
FP32_BYTES = 4
"""Bytes of an fp32 element."""
FP8_BYTES = 1
# Transformer Engine keeps a linear layer's weight in FP8 twice, as it is and transposed (Hopper's
# FP8 GEMMs take K-major operands, so the input gradient needs the transpose).
FP8_WEIGHT_COPIES = 2

# Mixture of experts. Megatron-core routes dropless by default (``moe_expert_capacity_factor``
# None: no token is dropped), so the expert-parallel rank that receives the most tokens sets the
# pace of the grouped GEMM and of the all-to-all. A capacity factor bounds that load: GShard
# (Lepikhin et al. 2021, Sec. 2.2) and Switch Transformer (Fedus et al. 2022, Sec. 2.2) train with
# 1.0-1.25 and drop little; with the load-balancing loss or DeepSeek-V3's bias-based balancing
# (DeepSeek-V3 report, Sec. 2.1.2) the busiest rank carries about a tenth more than the mean.
EXPERT_LOAD_IMBALANCE = 1.1
"""Busiest expert-parallel rank's token load over the mean (a stated factor, not measured here)."""


def expert_load_factor(ctx: LayerContext) -> float:
    """The busiest rank's routed-expert work over the balanced mean: 1 without expert parallelism
    (every rank holds every expert and runs the top-k copies of its own tokens, however they
    route); DeepSpeed-MoE's capacity factor under DeepSpeed (its gate gives each expert a buffer of
    that factor times the mean, every slot computed: MOE_CAPACITY_FACTOR); otherwise Megatron-core's
    dropless routing, :data:`EXPERT_LOAD_IMBALANCE`, or 1 where the routing is forced to balance. With
    Megatron-core's capacity factor an expert takes at most that factor times its mean share, so the
    busiest rank carries the lesser of the two (of 1 and the factor without expert parallelism);
    filled to capacity, every expert takes exactly it (``apply_router_token_dropping``), the factor,
    on every rank and without expert parallelism too. (A capacity beyond a rank's tokens, a factor
    over experts / top-k, would cap it at those tokens; dsauto.api refuses filling past them.)"""
    if filled := filled_capacity(ctx):
        return filled
    if ctx.engine == "deepspeed" and ctx.ep > 1:
        return MOE_CAPACITY_FACTOR
    dropless = 1.0 if ctx.expert_load_balanced or ctx.ep == 1 else EXPERT_LOAD_IMBALANCE
    capped = ctx.engine == "megatron" and ctx.expert_capacity_factor is not None
    return min(dropless, ctx.expert_capacity_factor) if capped else dropless


def filled_capacity(ctx: LayerContext) -> float | None:
    """The capacity factor every expert is filled to (Megatron-core's --moe-expert-capacity-factor with
    --moe-pad-expert-input-to-capacity), or None where the experts take what is routed to them."""
    padded = ctx.engine == "megatron" and ctx.expert_pad_to_capacity
    return ctx.expert_capacity_factor if padded else None


@dataclass(frozen=True)
class DeviceModel:
    """The device as the terms see it: a roofline for compute and how much communication hides."""

    peak_flops: float
    """Peak FLOP/s in the training dtype."""
    matmul_efficiency: float
    """Fraction of peak that large matrix multiplies reach."""
    matmul_half_dim: float
    """Smallest GEMM dimension at which a matrix multiply reaches half of ``matmul_efficiency``."""
    memory_bytes_per_second: float
    """Memory bandwidth that bandwidth-bound kernels achieve."""
    kernel_launch_seconds: float
    """Cost of launching one more kernel."""
    comm_overlap_efficiency: float
    """Fraction of the shorter of compute and communication that hides under the longer."""
    attention_efficiency: float = 0.0
    """Fraction of peak that the fused attention kernel reaches; 0: priced as a GEMM."""
    fused_attention_efficiency: float = 0.0
    """Fraction of peak that cuDNN's fused attention reaches; 0: the device has none, and that
    kernel is priced at ``attention_efficiency``."""
    grouped_gemm_knee_tokens: float = 0.0
    """Tokens per expert at which a grouped GEMM takes twice a large GEMM's time (0: no penalty)."""
    fp8_peak_flops: float = 0.0
    """Peak FP8 FLOP/s (0: the device has no FP8 tensor cores)."""
    fp8_matmul_efficiency: float = 0.0
    """Fraction of ``fp8_peak_flops`` that large FP8 GEMMs reach."""
    softmax_backward_fp32_scores: int = 4
    """fp32 score-sized tensors at the backward of Megatron-core's unfused 16-bit softmax
    (:attr:`dsauto.spec.cluster.DeviceSpec.softmax_backward_fp32_scores`)."""

    @classmethod
    def of(cls, device: DeviceSpec, dtype: str) -> DeviceModel:
        return cls(peak_flops=device.flops(dtype), matmul_efficiency=device.matmul_efficiency,
                   matmul_half_dim=device.matmul_half_dim,
                   memory_bytes_per_second=device.memory_bandwidth_gbps * 1e9 * device.memory_bandwidth_efficiency,
                   kernel_launch_seconds=device.kernel_launch_seconds,
                   comm_overlap_efficiency=device.comm_overlap_efficiency,
                   attention_efficiency=device.attention_efficiency,
                   fused_attention_efficiency=device.fused_attention_efficiency or 0.0,
                   grouped_gemm_knee_tokens=device.grouped_gemm_knee_tokens,
                   fp8_peak_flops=device.peak_flops.get("fp8", 0.0),
                   fp8_matmul_efficiency=device.fp8_matmul_efficiency or device.matmul_efficiency,
                   softmax_backward_fp32_scores=device.softmax_backward_fp32_scores)

    def matmul_seconds(self, flops: float, dim: float, fp8: bool = False) -> float:
        """A GEMM of ``flops`` whose smallest dimension is ``dim``: efficiency saturates with size.
        ``fp8``: at the FP8 peak and efficiency."""
        if flops <= 0:
            return 0.0
        peak, top = (self.fp8_peak_flops, self.fp8_matmul_efficiency) if fp8 else (self.peak_flops,
                                                                                    self.matmul_efficiency)
        efficiency = top * dim / (dim + self.matmul_half_dim)
        return flops / (peak * efficiency)

    def memory_seconds(self, num_bytes: float) -> float:
        return num_bytes / self.memory_bytes_per_second

    def overlapped(self, compute_seconds: float, comm_seconds: float) -> float:
        """Compute and communication issued together: the longer of the two, plus the part of the
        shorter one that does not hide (see DeviceSpec.comm_overlap_efficiency)."""
        hidden = self.comm_overlap_efficiency
        return max(compute_seconds, comm_seconds) + (1 - hidden) * min(compute_seconds, comm_seconds)


@dataclass(frozen=True)
class LayerContext:
    """What the terms read besides the layer group and its option: one strategy on one cluster and
    workload (built by :class:`dsauto.cost.layer.CostModel`)."""

    device: DeviceModel
    """The device's compute and overlap figures."""
    tp: int
    """Tensor-parallel degree."""
    dp: int
    """Data-parallel degree."""
    zero_stage: int
    """ZeRO stage 0-3."""
    tokens: int
    """Tokens of one micro-batch: micro-batch size x sequence length."""
    replicated_div: int
    """What divides the activations tensor parallelism replicates: tp under sequence parallelism,
    else 1."""
    flash_attention: bool
    """Fused attention: no s x s scores kept, no eager softmax traffic, causal half skipped."""
    dtype_bytes: int
    """Bytes of a 16-bit (or fp32) activation and parameter."""
    optimizer_bytes_per_param: int
    """Optimizer-state bytes per parameter before ZeRO shards them."""
    grad_bytes_per_param: int
    """Bytes of a gradient as the engine keeps and reduces it (Megatron's fp32 main gradients under
    bf16, else the parameter dtype)."""
    resident_keeps_partition: bool
    """Under ZeRO-3, whether a resident layer also keeps its partition (DeepSpeed's ds_persist)."""
    tp_group: Group
    """The tensor-parallel group, calibrated."""
    dp_group: Group
    """The data-parallel group, calibrated."""
    calibration: Calibration
    """Correction factors; the terms apply those of compute, ZeRO-3 hooks and memory."""
    cp: int = 1
    """Context-parallel degree; ``tokens`` is then this rank's share of the sequences."""
    cp_group: Group | None = None
    """The context-parallel group (its all-gather and reduce-scatter), calibrated; None without
    context parallelism."""
    cp_ring: Group | None = None
    """The context-parallel ring's point-to-point link (:func:`dsauto.cost.collectives.ring_link`),
    calibrated; None without context parallelism."""
    cp_all_to_all: AllToAll | None = None
    """The all-to-all over the context-parallel group, calibrated: DeepSpeed-Ulysses' (a DeepSpeed
    strategy with cp > 1) or Transformer Engine's ``a2a`` (a Megatron-core one); None otherwise."""
    cp_comm_type: CpCommType = "p2p"
    """How a Megatron-core strategy's context parallelism exchanges the shards
    (:attr:`dsauto.cost.strategy.Strategy.cp_comm_type`)."""
    expert_a2a_overlap_fraction: float = 0.0
    """Under Megatron-core's ``--overlap-moe-expert-parallel-comm``, the share of a rank's forward
    passes that run beside another micro-batch's backward (:func:`steady_pair_fraction`); 0 without it."""
    engine: Engine = "deepspeed"
    """The engine that runs the strategy: Megatron-core's activation and gradient transients differ
    from DeepSpeed's (the ``megatron_*`` terms)."""
    ep: int = 1
    """Expert-parallel degree (mixtures of experts)."""
    etp: int = 1
    """Expert tensor-parallel degree."""
    expert_dp: int = 0
    """Expert data-parallel degree: ranks holding the same experts, over which their gradients are
    reduced and ZeRO / the distributed optimizer shards their states; 0: ``dp`` (no experts)."""
    ep_group: AllToAll | None = None
    """The expert-parallel all-to-all, calibrated; None without expert parallelism."""
    hpz_group: Group | None = None
    """ZeRO++ hpZ: the ranks of a node sharing a secondary partition of the sharded parameters, over
    which backward gathers them (:func:`data_parallel_cost`); None without hpZ."""
    dist_opt_instances: int = 1
    """Megatron-core's partial distributed optimizer: the instances the dp x cp replicas (and the
    expert data-parallel ranks) split into, each sharding the optimizer state over its own ranks
    (:func:`model_state`); 1: one instance over all of them."""
    dist_opt_group: Group | None = None
    """The ranks of one distributed-optimizer instance, calibrated: gradients are reduce-scattered
    and parameters all-gathered over it (:func:`partial_dist_opt_sync_seconds`); None with one."""
    dist_opt_inter_group: Group | None = None
    """The ranks holding the same shard in every instance, calibrated: the shard's all-reduce runs
    over it; None with one instance."""
    reference_layers_measured: bool = False
    """The profile measured dsauto's reference transformer layers (a ``deepspeed`` profile), which
    keep what Hugging Face's modeling code keeps (``LayerGroup.unfused_*``), not Megatron-core's
    fused kernels."""
    bf16_optimizer: bool = False
    """DeepSpeed's BF16_Optimizer runs the update (:func:`dsauto.plan.deepspeed_bf16_optimizer`): the
    fp32 main weights and moments partitioned over the data-parallel ranks without ZeRO, beside a
    16-bit gradient accumulator of every parameter (:func:`model_state`)."""
    softmax_fp32: bool = True
    """Megatron-core's unfused attention computes its softmax on an fp32 copy of 16-bit scores and
    keeps its fp32 output (:attr:`dsauto.cost.strategy.Strategy.attention_softmax_in_fp32`); False:
    the softmax keeps its 16-bit output alone."""
    recompute_early_stop: bool = False
    """A checkpointed layer's recomputation stops before its last matrix multiply (PyTorch's
    non-reentrant checkpoint: :attr:`dsauto.cost.strategy.Strategy.recompute_early_stop`)."""
    expert_dispatcher: ExpertDispatcher = "alltoall"
    """The MoE token dispatcher (:attr:`dsauto.cost.strategy.Strategy.expert_dispatcher`)."""
    expert_load_balanced: bool = False
    """Routing forced to balance (:attr:`dsauto.cost.strategy.Strategy.expert_load_balanced`)."""
    expert_capacity_factor: float | None = None
    """Experts' token capacity (:attr:`dsauto.cost.strategy.Strategy.expert_capacity_factor`)."""
    expert_pad_to_capacity: bool = False
    """Experts filled to their capacity (:attr:`dsauto.cost.strategy.Strategy.expert_pad_to_capacity`)."""
    experts_gathered_whole: bool = False
    """ZeRO-3 gathers an MoE layer's experts as one unit
    (:attr:`dsauto.cost.strategy.Strategy.experts_gathered_whole`)."""
    tp_comm_overlap: bool = False
    """Tensor-parallel collectives overlapped with the linear layers' matrix multiplies
    (:attr:`dsauto.cost.strategy.Strategy.tp_comm_overlap`)."""
    attention_kernel: AttentionKernel = "flash"
    """The fused attention kernel (:attr:`dsauto.cost.strategy.Strategy.attention_kernel`)."""
    fp8: bool = False
    """The transformer layers' linear layers run in FP8 (:attr:`dsauto.cost.strategy.Strategy.fp8`)."""
    fp8_recipe: Fp8Recipe = "delayed"
    """The FP8 scaling recipe (:attr:`dsauto.cost.strategy.Strategy.fp8_recipe`)."""
    fp8_param_gather: bool = False
    """FP8 weights gathered at one byte a parameter (:attr:`dsauto.cost.strategy.Strategy.fp8_param_gather`)."""

    def fp8_params(self, group: LayerGroup) -> bool:
        """Whether ``group``'s weights are FP8 tensors (FP8 training with ``--fp8-param-gather``)."""
        return self.fp8 and self.fp8_param_gather and group.kind == "transformer"

    def shards(self, option: LayerOption) -> bool:
        """Whether ZeRO-3 keeps this layer's parameters sharded (gathered per use)."""
        return self.zero_stage == 3 and option.shard_params and self.dp > 1


@dataclass(frozen=True)
class Passes:
    """Time of one micro-batch's forward and backward through a layer."""

    forward_seconds: float
    """Forward time."""
    backward_seconds: float
    """Backward time."""

    def plus(self, other: Passes) -> Passes:
        return Passes(self.forward_seconds + other.forward_seconds, self.backward_seconds + other.backward_seconds)


@dataclass(frozen=True)
class DataParallelCost:
    """A layer's times once data-parallel (ZeRO) traffic is added."""

    forward_seconds: float
    """Forward time of one micro-batch, parameter gathers not hidden by compute included."""
    backward_seconds: float
    """Backward time of one micro-batch, gathers and gradient reductions not hidden included."""
    step_seconds: float
    """Once per optimizer step, not hidden: gathering updated parameters that ZeRO sharded."""
    grad_sync_bytes: float
    """Gradient bytes reduced once per step over the data-parallel group (ZeRO 0/1)."""


@dataclass(frozen=True)
class ModelState:
    """A layer's parameters, gradients and optimizer state on one rank."""

    params_bytes: float
    """Resident parameter bytes."""
    grads_bytes: float
    """Gradient bytes."""
    optimizer_bytes: float
    """Optimizer-state bytes."""
    optimizer_params: float
    """Parameters whose optimizer update this rank runs."""


@dataclass(frozen=True)
class Activations:
    """A layer's activation memory on one rank."""

    activation_bytes: float
    """Bytes kept for backward per micro-batch in flight."""
    transient_bytes: float
    """Short-lived peak while the layer runs: recomputed activations, gathered parameters, logits."""


def local_params(group: LayerGroup, tp: int) -> float:
    """Parameters of one layer on one tensor-parallel rank: its share of the split ones, all the
    replicated ones (routed experts counted whole; see :func:`expert_local_params`)."""
    return group.tp_params / tp + (group.params - group.tp_params)


def expert_local_params(group: LayerGroup, ctx: LayerContext) -> float:
    """Of :func:`local_params`, the routed experts' parameters on one rank: 1/ep of the experts,
    1/etp of each (Megatron-core's expert grid)."""
    return group.expert_params / (ctx.ep * ctx.etp)


def dense_local_params(group: LayerGroup, ctx: LayerContext) -> float:
    """Of one layer on one rank, the parameters outside the routed experts."""
    if not group.expert_params:
        return local_params(group, ctx.tp)
    return local_params(group, ctx.tp) - group.expert_params


def rank_params(group: LayerGroup, ctx: LayerContext) -> float:
    """Parameters of one layer on one rank: its tensor-parallel share, and 1/(ep x etp) of the routed
    experts."""
    return dense_local_params(group, ctx) + expert_local_params(group, ctx)


def gathered_unit_params(group: LayerGroup, option: LayerOption, tp: int, experts_whole: bool = False) -> float:
    """Parameters ZeRO-3 gathers at once for a sharded layer: its largest matrix, or one slice of it
    when split (OSDP); with ``experts_whole`` (Strategy.experts_gathered_whole) an MoE layer's whole
    sparse block. The head's split chunks its loss, not its matrix, which is gathered whole."""
    split = 1 if group.kind == "head" else option.split
    unit = max(group.largest_op_params, group.expert_block_params if experts_whole else 0)
    return unit / tp / split


def sharded_gather_bytes(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> float:
    """Gathered parameter bytes a sharded layer's own moment holds (uncalibrated; 0 unless ZeRO-3
    shards it).

    DeepSpeed: the unit in use (:func:`gathered_unit_params`), at most the layer's own parameters (a
    tied LM head's weight is the embedding's table, gathered only when the embedding is sharded).
    What the coordinator holds besides is the stage's, whichever layer runs
    (:mod:`dsauto.cost.zero3`, which ``predict_step`` puts in place of this unit); per layer it is a
    lower bound, for the layer DP.

    Megatron-FSDP: the unit in use and the next one prefetched. Its unit is a whole transformer
    layer (megatron/core/distributed/fsdp/mcore_fsdp_adapter.py: ``fsdp_unit_modules`` is
    ``[TransformerLayer]`` under ``optim_grads_params``), gathered in one buffer: the layer's
    parameters on this rank, its 1/(ep x etp) of the routed experts (which Megatron-FSDP shards and
    gathers over the expert data-parallel group); the embedding and the head are not units and
    gather their largest matrix. Under FP8 a gathered transformer layer holds its weights' FP8
    copies too (:func:`fp8_weight_bytes`), or with ``--fp8-param-gather`` its FP8 weights alone, as
    gathered and transposed."""
    if not ctx.shards(option):
        return 0.0
    unit = gathered_unit_params(group, option, ctx.tp, ctx.experts_gathered_whole)
    if ctx.engine != "deepspeed":
        unit_bytes = ctx.dtype_bytes
        if group.kind == "transformer":
            unit = rank_params(group, ctx)
            if ctx.fp8_params(group):
                unit_bytes = FP8_WEIGHT_COPIES * FP8_BYTES
            elif ctx.fp8:
                unit_bytes += FP8_WEIGHT_COPIES * FP8_BYTES
        return 2 * unit * unit_bytes
    return min(unit, local_params(group, ctx.tp)) * ctx.dtype_bytes


# ---- compute --------------------------------------------------------------------------------------

def linear_seconds(group: LayerGroup, ctx: LayerContext, flops: float, dim: float) -> float:
    """Linear-layer GEMMs of ``flops`` whose smallest dimension is ``dim``, uncalibrated: in FP8 in a
    transformer layer of an FP8 strategy (Transformer Engine's linear layers: the fused QKV, the
    attention's output projection, the MLP's and the routed experts' matrices), else in the
    training dtype. The embedding is a lookup and the output layer (Megatron-core's
    ``ColumnParallelLinear``, not a Transformer Engine module: megatron/core/models/gpt/gpt_model.py)
    stays in the training dtype, as does the attention core (:func:`attention_passes`)."""
    return ctx.device.matmul_seconds(flops, dim, fp8=ctx.fp8 and group.kind == "transformer")


def fp8_cast_bytes_per_token(group: LayerGroup, ctx: LayerContext) -> float:
    """Forward memory traffic per token of an FP8 transformer layer's casts (before tensor
    parallelism divides it): each linear layer's input read in 16 bits and written in FP8 twice,
    as it is and transposed (Hopper's FP8 GEMMs take both operands K-major, so the weight gradient
    needs the input's transpose), 4 bytes per element. The backward's casts of the output
    gradients are priced as twice this, as every compute term of backward is (:func:`compute_passes`);
    the linear layers' outputs and inputs are of like widths. Casts fused into a preceding norm or
    activation are priced as unfused. Tensorwise (current) scaling reads each input once more for
    its maximum first (:data:`FP8_AMAX_BYTES`)."""
    if not ctx.fp8 or group.kind != "transformer":
        return 0.0
    per_element = FP8_CAST_BYTES + (FP8_AMAX_BYTES if ctx.fp8_recipe == "tensorwise" else 0)
    return per_element * group.linear_input_elements_per_token


def matmul_seconds(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> float:
    """The forward matrix multiplies (linear layers) of one micro-batch on the roofline, uncalibrated."""
    t, tokens = ctx.tp, ctx.tokens
    # Splitting a matrix into k slices shrinks the sliced dimension (OSDP, Jiang et al. 2023,
    # Sec. 4.2), which costs matmul efficiency; the head splits over tokens instead.
    gemm_dim = min(group.gemm_dim / t if group.gemm_dim else 0, tokens)
    if option.split > 1:
        gemm_dim = min(gemm_dim, tokens / option.split) if group.kind == "head" else gemm_dim / option.split
    dense_flops = group.matmul_flops_per_token - group.expert_matmul_flops_per_token
    matmul = linear_seconds(group, ctx, dense_flops * tokens / t, gemm_dim)
    if group.expert_matmul_flops_per_token:
        matmul += expert_gemm_seconds(group, ctx)
    return matmul


def roofline_seconds(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> float:
    """Forward compute of one micro-batch on the roofline, uncalibrated: matrix multiplies,
    attention and bandwidth-bound kernels."""
    t, tokens, device = ctx.tp, ctx.tokens, ctx.device
    matmul = matmul_seconds(group, option, ctx)
    attention = attention_passes(group, ctx).forward_seconds
    elementwise_bytes = tokens * (
        group.elementwise_bytes_per_token / ctx.replicated_div
        + group.elementwise_tp_bytes_per_token / t
        + (0.0 if ctx.flash_attention else group.softmax_bytes_per_token / t)
        + fp8_cast_bytes_per_token(group, ctx) / t
    )
    elementwise = device.memory_seconds(elementwise_bytes)
    return matmul + attention + elementwise


def expert_gemm_seconds(group: LayerGroup, ctx: LayerContext) -> float:
    """The routed experts' forward GEMMs of one micro-batch on the busiest rank, uncalibrated.

    Balanced, the expert work of a stage splits evenly over its ranks: this rank's tokens (1/tp of
    the micro-batch under sequence parallelism, which Megatron-core requires with MoE and tp > 1)
    times the top-k experts' FLOPs. Megatron-core's grouped GEMM (``--moe-grouped-gemm``) runs a
    rank's E / ep local experts in one kernel, each a [tokens_e x h] by [h x f / etp] product with
    tokens_e = tokens x k x ep x etp / E on average, so the per-expert token count, when smaller than
    the widths, sets the efficiency (the device's size roofline). Short groups cost the grouped
    kernel more than that: 1 + (knee / tokens per expert)^2 times the time, the device's measured
    ``grouped_gemm_knee_tokens`` (H100: 1.2-1.3x at 512 tokens per expert, 1.6-2.0x at 256-272;
    benchmarks/results/device_experts_h100-80gb.md). Filled to capacity, every expert holds exactly
    the capacity factor times that average."""
    tokens = ctx.tokens / ctx.tp
    per_expert = max(tokens * group.moe_top_k * ctx.ep * ctx.etp / group.num_experts, 1.0)
    per_expert *= filled_capacity(ctx) or 1.0
    dim = min(group.gemm_dim, group.expert_gemm_dim / ctx.etp, per_expert)
    flops = group.expert_matmul_flops_per_token * tokens * expert_load_factor(ctx)
    short_groups = 1.0 + (ctx.device.grouped_gemm_knee_tokens / per_expert) ** 2
    return linear_seconds(group, ctx, flops, dim) * short_groups


def remote_node_share(experts: int, top_k: int, ep: int, members_per_node: int) -> float:
    """Of a token's top-k copies' bytes, the share that crosses the network when each goes once to
    every other node holding one of its experts: the expected count of such nodes over top-k. The
    experts split evenly over the ep ranks, ``members_per_node`` of them to a node; balanced routing
    picks the top-k experts uniformly without replacement, so a given node holds none of them with
    probability C(E - E/N, k) / C(E, k) over the N nodes."""
    nodes = -(-ep // members_per_node)
    per_node = experts / nodes
    missed = 1.0
    for i in range(top_k):
        missed *= max(0.0, experts - per_node - i) / (experts - i)
    return (nodes - 1) * (1.0 - missed) / top_k


def expert_dispatch_seconds(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> Passes:
    """Expert parallelism's token dispatch and combine in one micro-batch (Megatron-core's
    ``alltoall`` dispatcher, megatron/core/transformer/moe/token_dispatcher.py; Lepikhin et al. 2021,
    GShard, Sec. 2.2): each rank sends the top-k copies of its tokens to the experts' ranks and gets
    the outputs back, two all-to-alls in forward and two in backward (the gradients), not hidden by
    compute (unless ``--overlap-moe-expert-parallel-comm``: :func:`overlapped_dispatch`). Under sequence
    parallelism a rank dispatches its 1/tp of the tokens; the busiest rank receives
    :data:`EXPERT_LOAD_IMBALANCE` times the mean. A checkpointed layer dispatches again when it is
    recomputed, and so does an MoE layer under ``moe`` recomputation (its checkpoint re-runs the
    dispatcher). The tensor-parallel all-gather and reduce-scatter around a dense MLP are not run for
    an MoE layer (``LayerGroup.tp_comm_bytes_per_token``); with etp > 1 the experts' own are here.

    Under DeepEP (``ctx.expert_dispatcher`` deepep) a group spanning nodes sends a token over the
    network once per other node holding any of its top-k experts (:func:`remote_node_share`), not
    once per copy, and forwards the copies over NVLink inside the node.

    A group averaging dense and MoE layers (``LayerGroup.moe_layer_fraction``) pays its MoE layers'
    share of their exchanges, latencies included: the mean of its layers, as its other terms are."""
    if not group.dispatch_bytes_per_token or (ctx.ep_group is None and ctx.etp == 1):
        return Passes(0.0, 0.0)
    share_of_layers = group.moe_layer_fraction or 1.0
    size = (ctx.tokens / ctx.replicated_div * group.dispatch_bytes_per_token / share_of_layers
            * expert_load_factor(ctx))  # an MoE layer's
    exchange, ep = 0.0, ctx.ep_group
    if ep is not None and ctx.expert_dispatcher == "deepep" and ep.members_per_node < ep.size:
        share = remote_node_share(group.num_experts, group.moe_top_k, ep.size, ep.members_per_node)
        exchange = 2 * ep.node_deduplicated(size, share)
    elif ep is not None:
        exchange = 2 * ep.all_to_all(size)
    if ctx.etp > 1:
        # Expert tensor parallelism: the etp ranks of an expert all-gather the tokens they received
        # and reduce-scatter the experts' outputs (token_dispatcher.py, the tp part of the tp-ep
        # group), one all-reduce's volume of etp x the received tokens; the group lies inside a node
        # like the tensor-parallel one, whose link prices it.
        exchange += dataclasses.replace(ctx.tp_group, size=ctx.etp).all_reduce(size * ctx.etp)
    exchange *= share_of_layers
    again = option.checkpoint or "moe" in option.recompute_modules
    return Passes(exchange, exchange * (2 if again else 1))


def attention_passes(group: LayerGroup, ctx: LayerContext) -> Passes:
    """QK^T and attention-times-V of one micro-batch, forward and backward, uncalibrated.

    Fused causal kernels skip the masked upper triangle, and sliding-window ones the keys outside
    the window (LayerGroup.attention_window_fraction); eager attention computes all. Eager
    attention's four backward GEMMs cost twice the forward's two, like any matrix multiply. A fused
    kernel priced at the device's ``attention_efficiency`` runs five in backward, recomputing the
    scores instead of reading them (FlashAttention-2, Dao 2023, Sec. 3.1.2; its Sec. 4.1 counts the
    backward at 2.5x the forward FLOPs, as that efficiency is quoted). cuDNN's fused attention
    (``ctx.attention_kernel`` cudnn) runs at the device's ``fused_attention_efficiency`` where it
    has one, counted the same way."""
    flops = group.attention_flops_per_token * ctx.tokens / ctx.tp
    if ctx.flash_attention and group.causal:
        flops *= group.attention_window_fraction / 2
    device = ctx.device
    efficiency = device.attention_efficiency
    if ctx.attention_kernel == "cudnn" and device.fused_attention_efficiency > 0:
        efficiency = device.fused_attention_efficiency
    if ctx.flash_attention and efficiency > 0:
        forward = flops / (device.peak_flops * efficiency)
        return Passes(forward, FUSED_ATTENTION_BACKWARD * forward)
    forward = device.matmul_seconds(flops, group.head_dim)
    return Passes(forward, 2 * forward)


def steady_pair_fraction(pp: int, virtual_stages: int, micro_batches: int) -> float:
    """The share of the first pipeline rank's forward passes that Megatron-core's combined 1F1B
    schedule runs beside another micro-batch's backward (``--overlap-moe-expert-parallel-comm``).

    Without pipelining, the first micro-batch's forward runs alone, then each forward beside the
    previous micro-batch's backward (megatron/core/pipeline_parallel/combined_1f1b.py,
    ``combined_1f1b_schedule_for_no_pipelining``): m - 1 of m. With the interleaved schedule, which
    the overlap needs when pp > 1, the warm-up forwards run alone: (pp - 1) x 2 + (v - 1) x pp on the
    first rank, the most of any, and one more under the overlap so that every paired forward and
    backward are independent (schedules.py, ``get_pp_rank_microbatches``; the group of micro-batches
    per virtual stage is pp, its default), of its m x v."""
    forwards = micro_batches * virtual_stages
    alone = 1 if pp == 1 else (pp - 1) * 2 + (virtual_stages - 1) * pp + 1
    return max(0, forwards - min(alone, forwards)) / forwards


def overlapped_dispatch(compute: Passes, dispatch: Passes, ctx: LayerContext) -> Passes:
    """A layer's expert all-to-alls (``dispatch``) under ``--overlap-moe-expert-parallel-comm``: in
    the combined 1F1B phase a layer's forward and another micro-batch's backward of it run together,
    each one's all-to-alls on their own stream beside the other's compute ("EP A2A in forward step is
    hidden by the attention/mlp computation in the backward step, and vice versa", combined_1f1b.py),
    so a pair costs the device's overlap of their compute and their all-to-alls; the passes outside
    that phase (:func:`steady_pair_fraction`) keep theirs exposed. Returned as the exposed part of
    ``dispatch``, forward and backward in its proportions."""
    fraction = ctx.expert_a2a_overlap_fraction
    total = dispatch.forward_seconds + dispatch.backward_seconds
    if fraction <= 0 or total <= 0:
        return dispatch
    work = compute.forward_seconds + compute.backward_seconds
    paired = ctx.device.overlapped(work, total) - work
    scale = ((1 - fraction) * total + fraction * paired) / total
    return Passes(dispatch.forward_seconds * scale, dispatch.backward_seconds * scale)


def split_launch_seconds(option: LayerOption, ctx: LayerContext) -> float:
    """Each extra slice launches its matmul and the accumulation of partial results again."""
    return (option.split - 1) * 2 * ctx.device.kernel_launch_seconds


def recompute_seconds(option: LayerOption, forward_seconds: float) -> float:
    """Recomputation: a checkpointed layer runs its forward once more inside backward."""
    return forward_seconds if option.checkpoint else 0.0


def early_stop_saved_seconds(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> float:
    """What PyTorch's non-reentrant checkpoint does not recompute in a checkpointed transformer
    layer, calibrated: its last matrix multiply, the MLP output projection.

    ``torch.utils.checkpoint`` with ``use_reentrant=False`` re-runs the forward until the last
    tensor saved for backward has been re-created, then stops (``_StopRecomputationError`` with
    early stop, the default since PyTorch 2.1: pytorch/pytorch#96866). Autograd saves a matrix
    multiply's inputs before running it, and nothing after the output projection saves a tensor
    (the residual add keeps none; dropout with p = 0 none), so the projection is never re-run."""
    if not ctx.recompute_early_stop or not option.checkpoint or group.kind != "transformer":
        return 0.0
    t = ctx.tp
    gemm_dim = min(group.gemm_dim / t, ctx.tokens)
    flops = group.mlp_out_matmul_flops_per_token * ctx.tokens / t
    return ctx.calibration.compute * linear_seconds(group, ctx, flops, gemm_dim)


# ---- selective recomputation -----------------------------------------------------------------------
# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), Sec. 4.1
# and Table 2: a GPT layer keeps sbh(34 + 5as/h) bytes for backward, of which 5as^2b are the attention
# core's (the softmax output, its dropout mask and the dropout output, 2 + 1 + 2 bytes per score);
# Sec. 5 recomputes that core alone ("selective activation recomputation"), keeping its Q, K and V
# inputs, for 34sbh, at the price of re-running QK^T and attention over V. Megatron-core 0.16 names
# the parts it can re-run (TransformerConfig.recompute_modules; transformer_layer.py and
# attention.py): ``core_attn`` checkpoints the core attention call (Attention._checkpointed_attention
# _forward), ``layernorm`` drops the outputs of input_layernorm and pre_mlp_layernorm and recomputes
# them in backward (tensor_parallel.CheckpointWithoutOutput), ``mlp`` checkpoints the dense MLP
# (its input, the norm's output, stays; dense layers only: an MoE layer's MLP is ``moe``).
# The DeepSpeed hook recomputes the same modules the same way (dsauto.runtime.recompute), so the
# terms below price both engines. Under ZeRO-3 with the emitted config, DeepSpeed 0.19.8 all-gathers
# no more elements per step with the recomputation than without once its first step has recorded the
# modules' order (counted on CPU ranks: tests/runtime/test_deepspeed_selective.py; the first step
# gathers the recomputed MLP's first matrix again): the coordinator's trace keeps those parameters
# gathered until the module's backward (PartitionedParameterCoordinator.release_sub_module), so no
# gather term is added to the steady-state step.

def selective_saved_bytes_per_token(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> float:
    """Activation bytes per token (of this rank's tokens) that recomputing ``option.recompute_modules``
    frees in a transformer layer.

    ``core_attn``: under eager attention, the scores' bytes (:attr:`LayerGroup.
    attention_score_bytes_per_token`, Korthikanti's 5as/h share) and, on Megatron-core, its fp32
    softmax output (:func:`megatron_softmax_fp32_bytes_per_token`) and the repeated keys and values
    (:func:`megatron_eager_qkv_bytes_per_token`). A fused (flash) attention kernel
    keeps no scores: only its inputs, its output and two fp32 statistics per head and token, and
    under the checkpoint Q, K and V stay as its inputs and the output as the projection's input, so
    re-running it frees a few bytes per head and token, which the model counts as nothing (and it
    costs a whole attention forward). ``layernorm``: the pre-norms' outputs
    (:attr:`LayerGroup.norm_output_bytes_per_token`; split like them under sequence parallelism).
    ``mlp``: the dense MLP's inner activations (:attr:`LayerGroup.mlp_act_bytes_per_token`, and what
    the engine's MLP keeps besides). ``moe_act``: the routed experts' activation outputs (:attr:`LayerGroup.
    expert_act_output_bytes_per_token`), at the busiest rank's load like the experts' other
    activations (:func:`expert_load_factor`). ``mla_up_proj``: latent attention's queries, keys and
    values (:attr:`LayerGroup.mla_up_output_bytes_per_token`), which the attention core keeps as its
    inputs until Megatron-core drops their storage after it has run. ``moe``: everything an MoE
    layer's MLP keeps but its input (the pre-MLP norm's output, kept as the checkpoint's): the routed
    experts' top-k copies and inner activations (``moe_act``'s among them), the shared experts' inner
    activations and the router's fp32 logits and probabilities. ``shared_experts``: the shared
    experts' inner activations (:attr:`LayerGroup.shared_expert_act_bytes_per_token`)."""
    modules = option.recompute_modules
    if not modules or option.checkpoint or group.kind != "transformer":
        return 0.0
    saved = 0.0
    if "core_attn" in modules and not ctx.flash_attention:
        saved += group.attention_score_bytes_per_token / ctx.tp
        if ctx.engine == "megatron":
            saved += (megatron_softmax_fp32_bytes_per_token(group, ctx.tp, ctx.dtype_bytes, ctx.softmax_fp32)
                      + megatron_eager_qkv_bytes_per_token(group, ctx.tp)
                      - megatron_eager_qkv_bytes_per_token(group, ctx.tp, core_recomputed=True))
    # Under FP8 the norms' outputs and the MLP output projections' inputs are kept in FP8
    # (fp8_activation_change_bytes_per_token), so recomputing them frees that much.
    shrink = FP8_BYTES / ctx.dtype_bytes if ctx.fp8 else 1.0
    if "layernorm" in modules:
        saved += group.norm_output_bytes_per_token * shrink / ctx.replicated_div
    megatron = ctx.engine == "megatron"
    if "mlp" in modules:
        kept_in_fp8 = fp8_mlp_out_saved_bytes(group, ctx) * mlp_out_input_elements(group)
        # what the engine's MLP keeps beyond the count: Megatron-core's unfused activations, or under
        # DeepSpeed Hugging Face's (the checkpointed MLP keeps its input alone)
        unfused = group.megatron_mlp_extra_bytes_per_token if megatron else group.unfused_mlp_extra_bytes_per_token
        saved += (group.mlp_act_bytes_per_token + unfused - kept_in_fp8) / ctx.tp
    fp8_saved = ctx.dtype_bytes - FP8_BYTES if ctx.fp8 else 0  # per element kept in FP8
    if "moe" in modules or "shared_experts" in modules:  # 'moe' recomputes the shared experts too
        shared_inputs = group.shared_expert_out_input_elements_per_token
        unfused = group.megatron_shared_expert_extra_bytes_per_token if megatron else 0.0
        saved += (group.shared_expert_act_bytes_per_token + unfused
                  - fp8_mlp_out_saved_bytes(group, ctx) * shared_inputs) / ctx.tp
    load = expert_load_factor(ctx)
    if "moe" in modules:  # the routed experts' at the busiest rank's load, and the router's
        routed_inputs = (group.expert_out_input_elements_per_token - group.shared_expert_out_input_elements_per_token
                         + routed_in_elements(group, ctx))
        routed = group.expert_act_bytes_per_token + routed_copy_change_bytes_per_token(group, ctx)
        saved += ((routed - fp8_saved * routed_inputs) * load + group.router_act_bytes_per_token) / ctx.tp
    elif "moe_act" in modules:
        # Megatron-core checkpoints the activation with its weighting (experts.py, bias_act_func),
        # so an unfused weighting's input goes too; an input weighted before the experts stays.
        unfused = (group.megatron_expert_extra_bytes_per_token
                   - (group.dispatch_bytes_per_token if group.moe_probs_on_input else 0.0)) if megatron else 0.0
        saved += (group.expert_act_output_bytes_per_token * shrink + unfused) / ctx.tp * load
    if "mla_up_proj" in modules:
        saved += group.mla_up_output_bytes_per_token / ctx.tp
    return saved


def fp8_activation_change_bytes_per_token(group: LayerGroup, ctx: LayerContext) -> float:
    """How FP8 training changes the bytes per token a transformer layer keeps for backward (negative:
    fewer). Transformer Engine's linear layers keep their inputs for the weight gradient in FP8
    instead of 16 bits: the pre-norms' outputs (the QKV and MLP inputs, which Megatron-core's
    ``TELayerNormColumnParallelLinear``, Transformer Engine's ``LayerNormLinear``, quantizes and keeps
    transposed; an MoE layer's MLP input stays in 16 bits, which its router keeps), the MLP output
    projections' inputs (the activation functions'
    outputs; the routed experts' at the busiest rank's load) and the routed copies' inputs to their
    experts' first matrices (Transformer Engine's ``GroupedLinear``, at that load; the dispatcher's
    16-bit copy is kept by nothing else). The attention output, which the
    attention kernel keeps in 16 bits for its own backward, is kept a second time in FP8 by the
    output projection under delayed scaling; under the other recipes Megatron-core has the
    projection keep the 16-bit one (``save_original_input``, megatron/core/transformer/attention.py,
    which Transformer Engine refuses under delayed scaling)."""
    if not ctx.fp8 or group.kind != "transformer":
        return 0.0
    saved_per_element = ctx.dtype_bytes - FP8_BYTES
    second_copy = FP8_BYTES if ctx.fp8_recipe == "delayed" else 0
    shared = group.shared_expert_out_input_elements_per_token
    routed_out = expert_out_inputs(group, ctx) - shared
    split = (second_copy * group.attention_output_elements_per_token
             - fp8_mlp_out_saved_bytes(group, ctx) * (mlp_out_input_elements(group) + shared)
             - saved_per_element * (routed_out + routed_in_elements(group, ctx) * expert_load_factor(ctx)))
    norms = saved_per_element / ctx.dtype_bytes * group.norm_output_bytes_per_token
    if group.moe_layer_fraction and group.norm_output_bytes_per_token:
        # An MoE layer's pre-MLP norm output stays in 16 bits: its router keeps it
        # (transformer/moe/moe_utils.py, RouterGatingLinearFunction); a shared expert's first
        # matrix keeps an FP8 copy beside it.
        branch = min(group.moe_layer_fraction * group.gemm_dim, group.norm_output_bytes_per_token / ctx.dtype_bytes)
        norms -= (saved_per_element + (FP8_BYTES if group.shared_expert_out_input_elements_per_token else 0)) * branch
    return split / ctx.tp - norms / ctx.replicated_div


def fp8_mlp_out_saved_bytes(group: LayerGroup, ctx: LayerContext) -> float:
    """Bytes FP8 training saves per element of the dense MLP's and shared experts' output projection
    inputs (the activation's output) that backward keeps: 16 bits less one byte, or, where the
    activation keeps its own 16-bit output (ReLU: :attr:`LayerGroup.activation_keeps_output`), minus
    the FP8 copy the projection keeps beside it. 0 without FP8."""
    if not ctx.fp8:
        return 0.0
    return -FP8_BYTES if group.activation_keeps_output else ctx.dtype_bytes - FP8_BYTES


def routed_in_elements(group: LayerGroup, ctx: LayerContext) -> float:
    """Elements per token of the routed experts' first matrices' inputs (a token's top-k copies), at
    the mean load, averaged over the layers; Transformer Engine's grouped linear layer keeps them in
    FP8 under FP8 training (the 16-bit copies are freed, but where the probabilities weight the
    input, whose multiply keeps the unweighted copy: Llama 4, counted in
    :attr:`LayerGroup.megatron_expert_extra_bytes_per_token`)."""
    return group.dispatch_bytes_per_token / ctx.dtype_bytes


def routed_copy_change_bytes_per_token(group: LayerGroup, ctx: LayerContext) -> float:
    """What this rank's routed copies keep beyond the engine-neutral count
    (:attr:`LayerGroup.expert_act_bytes_per_token`), per token at the mean load before tensor
    parallelism divides it: Megatron-core's way of keeping them
    (:func:`megatron_routed_copy_change_bytes_per_token`) and, under expert tensor parallelism, the
    copies an expert's etp ranks all-gather, each keeping all of them as its first matrix's input
    (the inner activations split etp ways, as the count has them): etp times the 1/tp share the
    count gives, in FP8 under FP8 training (:func:`routed_in_elements`)."""
    change = megatron_routed_copy_change_bytes_per_token(group) if ctx.engine == "megatron" else 0.0
    in_bytes = FP8_BYTES if ctx.fp8 else ctx.dtype_bytes
    return change + routed_in_elements(group, ctx) * in_bytes * (ctx.etp - 1)


def expert_out_inputs(group: LayerGroup, ctx: LayerContext) -> float:
    """Elements per token of the routed and shared experts' output projections' inputs on this rank:
    the routed experts' at the busiest rank's load (:func:`expert_load_factor`), the shared experts'
    at the mean, since they take every local token."""
    shared = group.shared_expert_out_input_elements_per_token
    return (group.expert_out_input_elements_per_token - shared) * expert_load_factor(ctx) + shared


def selective_recompute_flops_per_token(group: LayerGroup, option: LayerOption, flash_attention: bool) -> float:
    """Forward FLOPs per token re-run in backward by selective recomputation (the whole layer,
    before tensor parallelism divides it): the attention core's two batched matrix multiplies
    (causal ones at half under a fused kernel, as :func:`attention_passes` runs them) and the dense
    MLP's matrix multiplies, latent attention's up projections and an MoE layer's (``moe``: router,
    routed and shared experts; ``shared_experts``: the shared experts'); the norms are bandwidth-bound."""
    modules = option.recompute_modules
    if not modules or option.checkpoint or group.kind != "transformer":
        return 0.0
    flops = 0.0
    if "core_attn" in modules:
        attention = group.attention_flops_per_token
        if flash_attention and group.causal:
            attention *= 0.5 * group.attention_window_fraction
        flops += attention
    if "mlp" in modules:
        flops += group.mlp_matmul_flops_per_token
    if "mla_up_proj" in modules:
        flops += group.mla_up_flops_per_token
    if "moe" in modules or "shared_experts" in modules:
        flops += group.shared_expert_matmul_flops_per_token
    if "moe" in modules:
        flops += group.expert_matmul_flops_per_token + group.router_matmul_flops_per_token
    return flops


def selective_recompute_seconds(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> float:
    """Time of one micro-batch's selective recomputation in a transformer layer's backward,
    calibrated: the re-run forward of each module in ``option.recompute_modules``, on the roofline
    of :func:`roofline_seconds`. ``core_attn``: the attention forward (:func:`attention_passes`)
    and, under eager attention, its softmax's memory traffic. ``layernorm``: the norms' reads and
    writes. ``mlp``: its matrix multiplies and activation function, and the tensor-parallel
    collective closing it (one of the layer's two: Megatron's checkpoint re-runs the module's
    forward, the row-parallel reduction included). ``moe_act``: the routed experts' activation
    function on the busiest rank's tokens (bandwidth-bound). ``mla_up_proj``: latent attention's up
    projections (Megatron-core's ``recompute_up_proj``; no collective: they are column-parallel).
    ``moe``: the MoE layer's forward again (router, routed experts on the busiest rank's tokens, shared
    experts, the activation functions and the top-k copies' permutation; its all-to-alls again are
    :func:`expert_dispatch_seconds`'). ``shared_experts``: the shared experts' matrix multiplies and
    activation function. Under tensor parallelism the shared experts' collective runs again with
    either, as the dense MLP's does with ``mlp``."""
    modules = option.recompute_modules
    if not modules or option.checkpoint or group.kind != "transformer":
        return 0.0
    t, tokens, device = ctx.tp, ctx.tokens, ctx.device
    seconds = 0.0
    if "core_attn" in modules:
        seconds += attention_passes(group, ctx).forward_seconds
        if not ctx.flash_attention:
            seconds += device.memory_seconds(tokens * group.softmax_bytes_per_token / t)
    if "layernorm" in modules:
        seconds += device.memory_seconds(tokens * group.norm_elementwise_bytes_per_token / ctx.replicated_div)
    if "mlp" in modules:
        gemm_dim = min(group.gemm_dim / t, tokens)
        seconds += linear_seconds(group, ctx, group.mlp_matmul_flops_per_token * tokens / t, gemm_dim)
        seconds += device.memory_seconds(tokens * group.mlp_elementwise_bytes_per_token / t)
    shared = "moe" in modules or "shared_experts" in modules  # 'moe' recomputes the shared experts too
    if shared:  # their matrix multiplies and activation function
        seconds += linear_seconds(group, ctx, group.shared_expert_matmul_flops_per_token * tokens / t,
                                  min(group.gemm_dim / t, tokens))
        seconds += device.memory_seconds(tokens * group.shared_expert_act_bytes_per_token / t)
    if "moe" in modules:
        # the router's GEMM, the routed experts' grouped GEMMs, their activation functions and the
        # permutation of the top-k copies to and from expert order
        seconds += linear_seconds(group, ctx, group.router_matmul_flops_per_token * tokens / t,
                                  min(group.gemm_dim / t, tokens))
        seconds += expert_gemm_seconds(group, ctx)
        seconds += device.memory_seconds(tokens / t * expert_load_factor(ctx) * (
            group.expert_act_elementwise_bytes_per_token + 4 * group.dispatch_bytes_per_token))
    elif "moe_act" in modules:
        seconds += device.memory_seconds(tokens * group.expert_act_elementwise_bytes_per_token / t
                                         * expert_load_factor(ctx))
    if "mla_up_proj" in modules:
        seconds += linear_seconds(group, ctx, group.mla_up_flops_per_token * tokens / t, min(group.gemm_dim / t, tokens))
    seconds *= ctx.calibration.compute
    if t > 1:  # a recomputed tensor-parallel MLP closes with its collective again
        mlps = ((1.0 - group.moe_layer_fraction if "mlp" in modules else 0.0)
                + (group.moe_layer_fraction if shared and group.shared_expert_matmul_flops_per_token else 0.0))
        if mlps:
            seconds += ctx.tp_group.all_reduce(mlps * group.gemm_dim * ctx.dtype_bytes * tokens)
    return seconds


# ---- tensor-parallel communication -----------------------------------------------------------------

def tp_comm_seconds(group: LayerGroup, ctx: LayerContext) -> float:
    """Tensor-parallel collectives of one pass (forward, or as many again in backward)."""
    # Megatron tensor parallelism: all-reduces in forward and as many in backward (Shoeybi et
    # al. 2019, Fig. 4); with sequence parallelism all-gather + reduce-scatter of equal volume
    # (Korthikanti et al. 2022, Sec. 4.2.2). Not overlapped with compute. Each collective is its
    # own call and pays the latency: a transformer layer's two in forward are the row-parallel
    # attention projection's and MLP output's (megatron/core/tensor_parallel/layers.py,
    # RowParallelLinear.forward -> reduce_from_tensor_model_parallel_region), its two in backward
    # the column-parallel QKV and MLP input's input gradients (ColumnParallelLinear: the
    # ``allreduce_dgrad`` all-reduce of LinearWithGradAccumulationAndAsyncCommunication.backward).
    # Under FP8 with sequence parallelism Transformer Engine all-gathers the column-parallel layers'
    # inputs already quantized, one byte an element (transformer_engine/pytorch/module/linear.py and
    # layernorm_linear.py: gather_along_first_dim with the input quantizer), in forward and again for
    # the weight gradient; the reduce-scatters stay in 16 bits: half the volume at FP8's size.
    calls = max(group.tp_collectives, 1.0)
    volume = group.tp_comm_bytes_per_token * ctx.tokens
    if ctx.fp8 and group.kind == "transformer" and ctx.replicated_div > 1:
        volume *= (ctx.dtype_bytes + FP8_BYTES) / (2 * ctx.dtype_bytes)
    return calls * ctx.tp_group.all_reduce(volume / calls)


def tp_loss_seconds(group: LayerGroup, ctx: LayerContext) -> float:
    """The vocabulary-parallel cross entropy's collectives, in the head's forward: three all-reduces
    of one fp32 value per token, the maximum logit, the target's logit and the sum of exponentials
    (megatron/core/tensor_parallel/cross_entropy.py, ``_VocabParallelCrossEntropy.forward``; its
    backward has none). Latency-bound: on a gloo group they cost as much as a layer's all-reduces."""
    return group.tp_loss_collectives * ctx.tp_group.all_reduce(4 * ctx.tokens)


def tp_overlap_exposed_seconds(matmul_seconds: float, tp_comm: float, ctx: LayerContext) -> tuple[float, float]:
    """The tensor-parallel collectives of one pass that Megatron-core's ``--tp-comm-overlap`` leaves
    exposed, forward and backward: Transformer Engine splits each sequence-parallel all-gather and
    reduce-scatter into chunks pipelined with the column- and row-parallel GEMMs they feed or
    follow, and in backward overlaps them with the data- and weight-gradient GEMMs
    (megatron/core/model_parallel_config.py, ``tp_comm_overlap``, ``tp_comm_bulk_dgrad`` and
    ``tp_comm_bulk_wgrad``; Transformer Engine's userbuffers). The collectives hide under the
    layer's matrix multiplies (``matmul_seconds`` forward, twice that backward) as any overlapped
    communication does (:meth:`DeviceModel.overlapped`)."""
    device = ctx.device
    forward = device.overlapped(matmul_seconds, tp_comm) - matmul_seconds
    backward = device.overlapped(2 * matmul_seconds, tp_comm) - 2 * matmul_seconds
    return forward, backward


def tp_comm_exposed(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> tuple[float, float]:
    """The tensor-parallel collectives of one forward and one backward pass of a layer that the step
    waits for: all of them, or under ``--tp-comm-overlap`` what the layer's GEMMs leave exposed
    (:func:`tp_overlap_exposed_seconds`)."""
    once = tp_comm_seconds(group, ctx)
    if ctx.tp_comm_overlap and once > 0:
        return tp_overlap_exposed_seconds(ctx.calibration.compute * matmul_seconds(group, option, ctx), once, ctx)
    return once, once


def tp_comm_passes(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> Passes:
    """The tensor-parallel collectives of one micro-batch through a layer that the step waits for
    (:func:`tp_comm_exposed`): a pass's worth in forward and in backward, and a checkpointed layer's
    recomputed forward issues its collectives again inside backward (Korthikanti et al. 2022, Sec.
    4.2.2; Megatron-core's ``CheckpointFunction.backward`` in megatron/core/tensor_parallel/random.py
    reruns the forward, row-parallel all-reduces included). The head's forward adds the loss's
    (:func:`tp_loss_seconds`). The part of the step the ``tensor_parallel`` factor scales."""
    forward, backward = tp_comm_exposed(group, option, ctx)
    return Passes(forward + tp_loss_seconds(group, ctx), backward + (forward if option.checkpoint else 0.0))


def compute_passes(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> Passes:
    """Forward and backward compute of one micro-batch of one layer shard on the roofline, calibrated:
    no collectives, no recomputation. Backward costs twice the forward (the input's and the
    weights' gradients) but for a fused attention kernel's extra recomputation."""
    speed = ctx.calibration.compute
    compute = speed * roofline_seconds(group, option, ctx)
    attention = attention_passes(group, ctx)
    fused_extra = speed * (attention.backward_seconds - 2 * attention.forward_seconds)
    return Passes(compute, 2 * compute + fused_extra)


def pass_seconds(group: LayerGroup, option: LayerOption, ctx: LayerContext,
                 measured: MeasuredLayer | None) -> Passes:
    """Forward and backward of one micro-batch before data-parallel traffic: compute (``measured``
    where the profile has the layer, else the roofline), tensor-parallel collectives, the launches
    of a split and recomputation."""
    speed = ctx.calibration.compute
    launches = split_launch_seconds(option, ctx)
    if measured is not None:
        # Measured compute replaces the roofline where the profile has the layer (interpolated in
        # the micro-batch; measured checkpointed, its backward includes the recomputation); the
        # collectives and the slicing overheads stay priced as above. A profile times one shard on
        # one rank, so a recomputed backward's collectives are added too.
        tp = tp_comm_passes(group, option, ctx)
        return Passes(speed * measured.forward_seconds + tp.forward_seconds + launches,
                      speed * measured.backward_seconds + tp.backward_seconds + 2 * launches
                      + selective_recompute_seconds(group, option, ctx))
    compute = compute_passes(group, option, ctx)
    forward_tp, backward_tp = tp_comm_exposed(group, option, ctx)
    forward_tp += tp_loss_seconds(group, ctx)
    forward = compute.forward_seconds + forward_tp + launches
    backward = (compute.backward_seconds + 2 * launches + backward_tp + recompute_seconds(option, forward)
                - early_stop_saved_seconds(group, option, ctx) + selective_recompute_seconds(group, option, ctx))
    return Passes(forward, backward)


def context_parallel_seconds(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> Passes:
    """The exchanges of context parallelism in one micro-batch of a transformer layer that its compute
    does not hide: DeepSpeed-Ulysses' under DeepSpeed (:func:`ulysses_seconds`), and under Megatron-core
    those of ``ctx.cp_comm_type`` (Transformer Engine's implementations in
    transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py). Each splits the
    sequence into 2 x cp chunks, two per rank, so causal attention costs every rank the same 1/cp of
    the FLOPs (the roofline sees this rank's tokens against the whole sequence).

    - ``p2p`` (``AttnFuncWithCPAndKVP2P``): each rank passes its keys and values around the ring,
      cp - 1 sends of its share in forward, and in backward the keys and values again with their
      gradients, twice the bytes (Liu et al. 2023, "Ring Attention", Sec. 3; Megatron-core docs,
      context_parallel.md). Each send overlaps the attention block of the step before it, so only
      what the attention compute cannot hide is exposed. A step lasts as long as its slowest send:
      where the ring spans nodes, one through a single NIC (``ctx.cp_ring``).
    - ``all_gather`` (``AttnFuncWithCPAndKVAllGather``, "KV all-gather between CP ranks is exposed";
      Llama Team 2024, "The Llama 3 Herd of Models", Sec. 3.3.2): forward all-gathers the keys and
      values of the whole sequence before attention; backward gathers them again and
      reduce-scatters their gradients, none of it overlapped.
    - ``a2a`` (``AttnFuncWithCPAndQKVOA2A``): all-to-alls of the queries, keys, values and output
      trade the sequence shard for 1/cp of the heads, as DeepSpeed-Ulysses does
      (:func:`ulysses_seconds`), exposed.

    A checkpointed layer's recomputed forward exchanges again, as exposed as the forward's."""
    if ctx.engine != "megatron" or ctx.cp_comm_type == "a2a":
        return ulysses_seconds(group, option, ctx)  # DeepSpeed's cp is DeepSpeed-Ulysses
    if ctx.cp == 1 or group.kind != "transformer":
        return Passes(0.0, 0.0)
    assert ctx.cp_group is not None and ctx.cp_ring is not None
    share = ctx.tokens * group.kv_bytes_per_token / ctx.tp  # this rank's keys and values
    if ctx.cp_comm_type == "all_gather":
        gather = ctx.cp_group.all_gather(ctx.cp * share)
        scatter = ctx.cp_group.reduce_scatter(ctx.cp * share)
        return Passes(gather, gather + scatter + (gather if option.checkpoint else 0.0))
    forward_comm = (ctx.cp - 1) * ctx.cp_ring.send_recv(share)
    attention = attention_passes(group, ctx)
    speed, device = ctx.calibration.compute, ctx.device
    forward_attention, backward_attention = speed * attention.forward_seconds, speed * attention.backward_seconds
    forward = device.overlapped(forward_attention, forward_comm) - forward_attention
    backward = device.overlapped(backward_attention, 2 * forward_comm) - backward_attention
    return Passes(forward, backward + (forward if option.checkpoint else 0.0))


def context_parallel_gather_bytes(group: LayerGroup, ctx: LayerContext) -> float:
    """The transient of ``all_gather`` context parallelism in a transformer layer: the keys and values
    of the whole sequence, gathered, and in backward their gradients before the reduce-scatter
    (``AttnFuncWithCPAndKVAllGather``: ``k_ag``/``v_ag`` and the full-length ``dk``/``dv``); the
    ring holds two shards in flight and ``a2a`` shares of its own size, which are not counted."""
    if ctx.cp == 1 or group.kind != "transformer" or ctx.engine != "megatron" or ctx.cp_comm_type != "all_gather":
        return 0.0
    return 2 * ctx.cp * ctx.tokens * group.kv_bytes_per_token / ctx.tp


def ulysses_seconds(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> Passes:
    """DeepSpeed-Ulysses' all-to-alls in one micro-batch of a transformer layer.

    Each of the cp ranks holds 1/cp of every sequence. Before attention, an all-to-all each of the
    queries, keys and values trades that sequence shard for 1/cp of the heads over the whole
    sequence; after it, one more returns the attention output to the sequence layout (Jacobs et
    al. 2023, "DeepSpeed Ulysses", Sec. 3.1-3.2: four all-to-alls of N·h/P elements per rank and
    layer, N the sequence, h the hidden size, P the degree). Backward passes the gradients of the
    same four tensors back the same way (``_SeqAllToAll.backward`` in deepspeed/sequence/layer.py),
    and a checkpointed layer runs the forward's four again. DeepSpeed issues them one by one and,
    without a side stream (``DistributedAttention(sp_stream=None)``, as the dsauto hook builds it),
    not overlapped with compute. With grouped-query attention the keys and values are narrower
    (``LayerGroup.kv_bytes_per_token``); the queries and the output each take half of the rest."""
    if ctx.cp == 1 or group.kind != "transformer" or ctx.cp_all_to_all is None:
        return Passes(0.0, 0.0)
    per_token = group.attention_io_bytes_per_token / ctx.tp
    keys = group.kv_bytes_per_token / ctx.tp / 2  # the keys, and as many the values
    queries = (per_token - 2 * keys) / 2  # the queries, and as many the output
    exchange = ctx.cp_all_to_all.all_to_all
    forward = 2 * exchange(ctx.tokens * queries) + 2 * exchange(ctx.tokens * keys)
    return Passes(forward, forward * (2 if option.checkpoint else 1))


# ---- ZeRO-3 hooks ------------------------------------------------------------------------------------

def zero3_hook_seconds(group: LayerGroup, option: LayerOption, ctx: LayerContext,
                       measured: MeasuredCosts | None) -> Passes:
    """ZeRO-3's per-module hook time for one micro-batch of this layer, when the profile measured
    it: every module is hooked, resident or not; a split adds its slices (profile.engine). Half runs
    in forward, half in backward, and recomputation runs the forward hooks again."""
    if ctx.zero_stage != 3 or measured is None or not measured.zero3_module_seconds:
        return Passes(0.0, 0.0)
    if group.kind != "transformer":
        modules = EDGE_LAYER_MODULES  # the embedding and the head
    else:
        unsplit = measured.layer_modules.get("1", 0)
        modules = measured.layer_modules.get(str(option.split), unsplit + MATRICES_PER_LAYER * (option.split - 1))
    hooks = modules * measured.zero3_module_seconds * ctx.calibration.zero3_hooks
    return Passes(hooks / 2, hooks / 2 * (2 if option.checkpoint else 1))


# ---- data-parallel and ZeRO communication -----------------------------------------------------------

def gather_latency_seconds(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> float:
    """Latency of a sharded layer's all-gathers beyond the first."""
    # DeepSpeed gathers each submodule's parameters with its own all-gather (a transformer
    # layer's four matrices, each of its k slices when split), so the latency is paid per
    # matrix, not once per layer (PartitionedParameterCoordinator.fetch_sub_module).
    # Megatron-FSDP gathers a layer's flat buffer with one all-gather, as PyTorch FSDP does its
    # flat parameter (Megatron-LM, megatron/core/distributed/fsdp/src/docs/mfsdp_design.md: one
    # all-gather per submodule only with enable_fine_grained_param_gather_hook).
    if ctx.engine == "megatron":
        return 0.0
    gathers = (MATRICES_PER_LAYER if group.kind == "transformer" else 1) * option.split
    return (gathers - 1) * ctx.dp_group.latency_seconds * max(0, ctx.dp - 1)


def dp_equivalent_params(group: LayerGroup, ctx: LayerContext) -> float:
    """The parameters whose gradients this rank reduces, as volume on the data-parallel group.

    Routed experts are reduced over the expert data-parallel group instead, which holds the same
    experts (Megatron-core's ``expt_dp`` group): their ring volume (edp - 1) / edp, none when each
    expert lives on one rank per stage, is counted as the equivalent on the dp group's ring, whose
    link prices it (an approximation when the two groups sit differently on the nodes)."""
    dense = dense_local_params(group, ctx)
    if not group.expert_params or ctx.dp <= 1:
        return dense if group.expert_params else local_params(group, ctx.tp)
    edp = ctx.expert_dp or ctx.dp
    ratio = ((edp - 1) / edp) / ((ctx.dp - 1) / ctx.dp)
    return dense + expert_local_params(group, ctx) * ratio


def data_parallel_cost(group: LayerGroup, option: LayerOption, ctx: LayerContext, passes: Passes,
                       hooks_measured: bool) -> DataParallelCost:
    """``passes`` with the layer's data-parallel traffic: per-use gathers and per-micro-batch
    reductions overlapped with its compute, once-per-step gathers and gradient bytes to reduce.
    ``hooks_measured``: the passes include ZeRO-3's measured hook time, which includes launching the
    gathers."""
    # ZeRO-3 gathers sharded parameters before each use in forward and again in backward, and
    # reduce-scatters gradients every micro-batch; ZeRO-2 reduce-scatters every micro-batch too;
    # both overlap with the layer's compute (prefetch, overlap_comm), so a layer costs about the
    # larger of the two (ZeRO paper, Sec. 7: 1.5x the data-parallel volume).
    params = dp_equivalent_params(group, ctx)
    # FP8 weights (--fp8-param-gather) are gathered at one byte a parameter (Megatron-core's
    # parameter buffer is then uint8: megatron/core/distributed/param_and_grad_buffer.py).
    param_volume = params * (FP8_BYTES if ctx.fp8_params(group) else ctx.dtype_bytes)
    # DeepSpeed-Ulysses reduces the gradients in fp32 whatever the training dtype: the engine takes its
    # communication dtype from seq_parallel_communication_data_type, fp32 by default
    # (deepspeed/runtime/constants.py), and ZeRO 1-2 force fp32 beside sequence parallelism
    # (stage_1_and_2.py, allreduce_bucket). Its memory: dsauto.cost.step.held_bucket_bytes (ZeRO-3's
    # bucket) and deepspeed_moment_peak (the fp32 copies ZeRO 0-2 cast into).
    reduced_bytes = FP32_BYTES if ctx.engine == "deepspeed" and ctx.cp > 1 else ctx.grad_bytes_per_param
    grad_volume = params * reduced_bytes
    dp, zero, comm, device = ctx.dp, ctx.zero_stage, ctx.dp_group, ctx.device
    forward, backward = passes.forward_seconds, passes.backward_seconds
    step_seconds, grad_sync = 0.0, 0.0
    if dp > 1:
        if ctx.shards(option):
            split_latency = 0.0 if hooks_measured else gather_latency_seconds(group, option, ctx)
            gather = comm.all_gather(param_volume) + split_latency
            forward = device.overlapped(forward, gather)
            if ctx.hpz_group is not None:
                # ZeRO++ hpZ (Wang et al. 2023, Sec. 3.2): forward's gather across all dp ranks also
                # fills a secondary partition over the node's hpz ranks, so backward gathers the
                # layer from them over the intra-node links.
                gather = ctx.hpz_group.all_gather(param_volume) + split_latency
            backward = device.overlapped(backward, gather + comm.reduce_scatter(grad_volume))
        elif zero >= 2:
            # DeepSpeed's ZeRO-2 all-reduces each bucket whole (use_multi_rank_bucket_allreduce, which
            # its plans set: stage_1_and_2.py, average_tensor); Megatron-FSDP reduce-scatters.
            reduce = comm.all_reduce if ctx.engine == "deepspeed" and zero == 2 else comm.reduce_scatter
            backward = device.overlapped(backward, reduce(grad_volume))
            step_seconds = comm.all_gather(param_volume)  # updated shards back to every rank
        elif zero == 1:
            grad_sync = grad_volume  # reduced once per step (CostModel.grad_sync_seconds: each engine's way)
            # Megatron-core's partial distributed optimizer gathers the updated parameters inside an
            # instance only (param_and_grad_buffer.py, _ParamAndGradBucketGroup.start_param_sync:
            # the all-gather runs over intra_distributed_optimizer_instance_group).
            step_seconds = (ctx.dist_opt_group if ctx.dist_opt_group is not None else comm).all_gather(param_volume)
        else:
            grad_sync = grad_volume
            if ctx.bf16_optimizer:  # the updated 16-bit partitions gathered (BF16_Optimizer)
                step_seconds = comm.all_gather(param_volume)
        if zero == 3 and not ctx.shards(option):
            step_seconds = comm.all_gather(param_volume)  # re-gather the persistent copy
    return DataParallelCost(forward, backward, step_seconds, grad_sync)


def partial_dist_opt_sync_seconds(grad_bytes: float, instance: Group, across: Group) -> float:
    """The once-per-step gradient reduction of ``grad_bytes`` under Megatron-core's partial
    distributed optimizer: each bucket is reduce-scattered over the ranks of its instance
    (``instance``), then this rank's 1/size shard of it is all-reduced with the ranks holding the
    same shard in the other instances (``across``), one after the other on the same stream
    (megatron/core/distributed/param_and_grad_buffer.py, ``_ParamAndGradBucketGroup.start_grad_sync``:
    the reduce-scatter over ``intra_distributed_optimizer_instance_group``, then the all-reduce of the
    local shard over ``inter_distributed_optimizer_instance_group``). With ``--overlap-grad-reduce``
    both run on a side stream behind the backward pass, like the single instance's reduce-scatter
    (:func:`dsauto.cost.step._megatron_exposed` prices the overlap)."""
    return instance.reduce_scatter(grad_bytes) + across.all_reduce(grad_bytes / instance.size)


# ---- memory ----------------------------------------------------------------------------------------------

def state_bytes_per_param(engine: str, dtype_bytes: int, bf16: bool, zero_stage: int,
                          precision_aware: MomentsDtype | None = None, fp8_current_scaling: bool = False
                          ) -> tuple[int, int]:
    """(gradient, optimizer-state) bytes per parameter as the engine keeps them, before ZeRO shards.

    DeepSpeed: gradients in the parameter dtype; mixed-precision Adam keeps an fp32 master copy and
    two fp32 moments, 12 bytes (ZeRO paper, Rajbhandari et al. 2020, Sec. 3.1). Pure fp32 without
    ZeRO: torch's Adam moments alone, 8 bytes. DeepSpeed's ZeRO optimizers keep an fp32 master copy
    of their partition even when the model is fp32 (``single_partition_of_fp32_groups`` in
    stage_1_and_2.py and ``fp32_partitioned_groups_flat`` in stage3.py are clones), so ZeRO 1-3
    hold 12 bytes.

    Megatron-core (docs/source/api-guide/dist_optimizer.md, the bytes-per-parameter table;
    megatron/core/optimizer/optimizer.py, ``Float16OptimizerWithFloat16Params``): under bf16 the
    gradient buffer is fp32 (Megatron-LM's validate_args sets accumulate_allreduce_grads_in_fp32,
    and dsauto's plugin sets ``grad_reduce_in_fp32``), and the optimizer keeps fp32 main weights and
    two moments: 2 + 4 + 12 = 18 bytes, 6 + 12/d with the distributed optimizer. Under fp16 the
    gradients are fp16 and the optimizer also keeps fp32 main gradients: 2 + 2 + 16 = 20, or
    4 + 16/d. In fp32: 4 + 4 + 8 = 16, or 8 + 8/d.

    Megatron-core's precision-aware optimizer (``precision_aware``: the moments' dtype; bf16 with the
    distributed optimizer only) hands the update to Transformer Engine's FusedAdam with
    ``exp_avg_dtype`` and ``exp_avg_sq_dtype`` (1, 2 or 4 bytes each) and, from TE 2.1, the fp32 main
    weights stored as their 16 low bits beside the bf16 weights (``store_param_remainders``, on by
    default): megatron/core/optimizer/__init__.py (the Adam kwargs ``master_weights``,
    ``master_weight_dtype``, ``store_param_remainders``) and optimizer_config.py. Under FP8 with
    current scaling (``fp8_current_scaling``: the tensorwise recipe) Megatron-core keeps the fp32
    main weights itself, whole (``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` is then False).
    """
    if engine == "megatron" and precision_aware is not None and bf16:
        return 4, (4 if fp8_current_scaling else 2) + 2 * MOMENT_BYTES[precision_aware]
    if engine == "megatron":
        if bf16:
            return 4, 12
        if dtype_bytes < 4:
            return dtype_bytes, 16
        return 4, 8
    return dtype_bytes, 12 if dtype_bytes < 4 or zero_stage >= 1 else 8


def model_state(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> ModelState:
    """Parameters, gradients and optimizer state of one layer on one rank, by ZeRO stage and
    residency."""
    fp8 = ctx.calibration.static_memory * fp8_weight_bytes(group, option, ctx)
    if group.expert_params:
        # Routed experts: 1/(ep x etp) of them per rank, their states sharded over the expert
        # data-parallel group (Megatron-core's distributed optimizer keeps expert parameters in
        # their own buffers over ``expt_dp``: megatron/core/distributed/distributed_data_parallel.py).
        fp8_params = ctx.fp8_params(group)
        dense = _state(dense_local_params(group, ctx), ctx.dp, option, ctx, fp8_params)
        experts = _state(expert_local_params(group, ctx), ctx.expert_dp or ctx.dp, option, ctx, fp8_params)
        return ModelState(dense.params_bytes + experts.params_bytes + fp8, dense.grads_bytes + experts.grads_bytes,
                          dense.optimizer_bytes + experts.optimizer_bytes,
                          dense.optimizer_params + experts.optimizer_params)
    state = _state(local_params(group, ctx.tp), ctx.dp, option, ctx, ctx.fp8_params(group))
    return dataclasses.replace(state, params_bytes=state.params_bytes + fp8) if fp8 else state


def fp8_weight_bytes(group: LayerGroup, option: LayerOption, ctx: LayerContext) -> float:
    """The FP8 copies of a resident transformer layer's weights on this rank under FP8 training
    (:data:`FP8_WEIGHT_COPIES` bytes per parameter, the norms' few counted too), which Transformer
    Engine keeps from the first micro-batch of a step to the last. A sharded (gathered per use)
    layer's copies exist while it is gathered (:func:`sharded_gather_bytes`). With
    ``--fp8-param-gather`` the weights are FP8 tensors holding both copies in the two bytes a 16-bit
    weight took (Transformer Engine's ``Float8Tensor``), and no copy is added (a sharded layer's
    shards hold one byte a parameter: :func:`_state`)."""
    if not ctx.fp8 or group.kind != "transformer" or ctx.shards(option) or ctx.fp8_params(group):
        return 0.0
    return FP8_WEIGHT_COPIES * FP8_BYTES * rank_params(group, ctx)


def _state(local: float, dp: int, option: LayerOption, ctx: LayerContext, fp8_params: bool = False) -> ModelState:
    """Model state of ``local`` parameters per rank whose ZeRO group has ``dp`` ranks; ``fp8_params``:
    they are FP8 tensors (``--fp8-param-gather``), whose ZeRO-3 shards hold one byte a parameter (a
    resident FP8 weight keeps its transpose beside it, the two bytes of a 16-bit one)."""
    zero = ctx.zero_stage
    sharded = ctx.shards(option) and dp > 1
    params_bytes = local * (FP8_BYTES if sharded and fp8_params else ctx.dtype_bytes) / (dp if sharded else 1)
    if zero == 3 and not sharded and dp > 1 and ctx.resident_keeps_partition:
        # A resident (ds_persist) group keeps its ZeRO-3 partition too: the optimizer updates the
        # partition and re-gathers the full copy from it after each step (measured in
        # benchmarks/results/hook_memory.md: (1 + 1/dp) x its parameters).
        params_bytes += local * ctx.dtype_bytes / dp
    if sharded and ctx.hpz_group is not None:
        # ZeRO++ hpZ's secondary partition: 1/hpz of the layer's parameters per rank (Wang et al.
        # 2023, Sec. 3.2; DeepSpeed's ds_secondary_tensor in partition_parameters.py).
        params_bytes += local * ctx.dtype_bytes / ctx.hpz_group.size
    grads_bytes = local * ctx.grad_bytes_per_param / (dp if zero >= 2 else 1)
    optimizer_shards = optimizer_shard_ranks(dp, ctx)
    optimizer_bytes = local * ctx.optimizer_bytes_per_param / optimizer_shards
    if ctx.bf16_optimizer:
        optimizer_bytes += local * ctx.dtype_bytes  # its gradient accumulator, whole
    static = ctx.calibration.static_memory
    return ModelState(static * params_bytes, static * grads_bytes, static * optimizer_bytes,
                      optimizer_params=local / optimizer_shards)


def optimizer_shard_ranks(dp: int, ctx: LayerContext) -> int:
    """Ranks over which ZeRO (1 and above, and DeepSpeed's BF16_Optimizer) shards the optimizer state
    of parameters whose data-parallel group has ``dp`` ranks: all of them, or under Megatron-core's
    partial distributed optimizer the dp / instances ranks of one instance, each instance holding a
    whole copy of the state (fp32 main parameters and Adam moments). The distributed optimizer
    shards over the data-parallel group it is given (megatron/core/optimizer/distrib_optimizer.py,
    ``_build_model_gbuf_range``), which ``get_megatron_optimizer`` (megatron/core/optimizer/
    __init__.py) takes as the intra-instance group, ``intra_dp_cp_group`` (and
    ``intra_expt_dp_group`` for the experts)."""
    if ctx.zero_stage < 1 and not ctx.bf16_optimizer:
        return 1
    return max(1, dp // ctx.dist_opt_instances)


def activation_memory(group: LayerGroup, option: LayerOption, ctx: LayerContext,
                      measured: MeasuredLayer | None, measured_uncheckpointed: MeasuredLayer | None) -> Activations:
    """Activations one micro-batch keeps for backward and the transient peak while the layer runs.

    ``measured``: the profile's measurement of the layer under ``option.checkpoint``;
    ``measured_uncheckpointed``: the one without checkpointing; used only when ``measured`` exists."""
    t, tokens, replicated_div, flash = ctx.tp, ctx.tokens, ctx.replicated_div, ctx.flash_attention
    # Activations (Korthikanti et al. 2022, Table 2, generalised in spec.model).
    full_activation = tokens * (
        group.act_tp_bytes_per_token / t
        + group.act_replicated_bytes_per_token / replicated_div
        + (0.0 if flash else group.attention_score_bytes_per_token / t)
    )
    # The busiest expert rank keeps the top-k copies of more tokens than the mean.
    full_activation += tokens * group.expert_act_bytes_per_token / t * (expert_load_factor(ctx) - 1)
    full_activation += tokens * fp8_activation_change_bytes_per_token(group, ctx)
    megatron = ctx.engine == "megatron"
    # The model DeepSpeed trains computes its RMSNorms in fp32 and its gated activation apart
    # (Hugging Face's modeling code; dsauto's reference layers alike); a measured layer (below)
    # stands as measured.
    unfused_extra = tokens * (group.unfused_extra_bytes_per_token / replicated_div
                              + group.unfused_extra_tp_bytes_per_token / t
                              + group.unfused_expert_extra_bytes_per_token / t * expert_load_factor(ctx))
    if not megatron:
        full_activation += unfused_extra
    # The routed copies as the engine keeps them, and Megatron-core's MLPs; a measured layer (below)
    # stands as measured.
    full_activation += tokens / t * routed_copy_change_bytes_per_token(group, ctx) * expert_load_factor(ctx)
    if megatron:
        full_activation += tokens / t * (group.megatron_mlp_extra_bytes_per_token
                                         + group.megatron_shared_expert_extra_bytes_per_token)
    if megatron and group.kind == "transformer" and not flash:
        full_activation += tokens * (
            megatron_softmax_fp32_bytes_per_token(group, t, ctx.dtype_bytes, ctx.softmax_fp32)
            + megatron_eager_qkv_bytes_per_token(group, t))
    checkpoint_activation = tokens * group.checkpoint_bytes_per_token / replicated_div
    # A transformer layer's kept bytes are measured too (the profile's shards have no sequence
    # parallelism, so it applies without SP only); the embedding and head keep the analytic
    # counts, whose logits term is exact. The profile's reference layer attends with torch's fused
    # scaled_dot_product_attention, which keeps no score matrix; Megatron-core's unfused attention
    # keeps its scores, fp32 softmax and probabilities, so there the analytic count of a whole
    # layer stands (measured on two CPU ranks in fp32: the measured layers put the peaks 5-13% low,
    # the analytic count within 1-6%; benchmarks/results/accuracy.md).
    eager_megatron = megatron and not flash
    if measured is not None and group.kind == "transformer" and replicated_div == 1:
        if measured_uncheckpointed is not None and not eager_megatron:
            full_activation = measured_uncheckpointed.activation_bytes
            if megatron and ctx.reference_layers_measured:
                # reference layers priced for Megatron-core: less what its fused norms and SwiGLU keep
                # no copy of (a DeepSpeed plan keeps the measurement whole)
                full_activation -= unfused_extra
        if option.checkpoint:
            checkpoint_activation = measured.activation_bytes
    if measured is not None and group.kind == "head" and measured.hidden_bytes and not megatron:
        # The head's final norm as the profiled head ran it (its kept bytes and output,
        # dsauto.profile.layers.head_hidden_bytes). The count of a fused norm had put bench-llama's
        # bf16 ZeRO-3 plan with its loss in 2 chunks 2.1% low (torch's RMSNorm on CPU: 1.9 MiB at
        # the head where the count had 0.75; benchmarks/results/accuracy.md). Megatron-core runs
        # its own final norm.
        full_activation = measured.hidden_bytes
    if option.checkpoint:
        activation = checkpoint_activation
        transient = full_activation  # the recomputed layer lives until its backward ends
    else:
        # Selective recomputation keeps all but the recomputed modules' activations, which are
        # rebuilt for their own backward (a transient of their size).
        freed = tokens * selective_saved_bytes_per_token(group, option, ctx)
        activation, transient = full_activation - freed, freed
    transient += sharded_gather_bytes(group, option, ctx) + context_parallel_gather_bytes(group, ctx)
    if megatron:
        # Megatron-core: each moment of backward holds the gradient of the weight being
        # differentiated; a transformer layer's larger moments are its MLP output projection's
        # backward and its eager attention's (megatron_mlp_backward_bytes_per_token,
        # megatron_attention_backward_bytes_per_token); the head's is the loss
        # (megatron_loss_bytes_per_token) or its backward, the logits' gradient next to the output
        # weight's. It runs the loss whole.
        grad = megatron_weight_grad_bytes(group, t, ctx.dtype_bytes)
        if group.kind == "transformer":
            mlp = megatron_mlp_backward_bytes_per_token(group, t, ctx.dtype_bytes, replicated_div)
            projection = grad + tokens * mlp
            softmax = 0.0 if flash else tokens * megatron_attention_backward_bytes_per_token(
                group, t, ctx.dtype_bytes, ctx.device.softmax_backward_fp32_scores, ctx.softmax_fp32)
            transient += max(projection, softmax)
        else:
            transient += grad
        if group.kind == "head":
            vocab = group.largest_op_params / group.gemm_dim  # the LM head is vocabulary x hidden
            transient = max(transient, tokens * megatron_loss_bytes_per_token(vocab, t, ctx.dtype_bytes),
                            tokens * vocab / t * ctx.dtype_bytes + grad)
    elif group.kind == "head":
        transient += tokens * group.logits_bytes_per_token / t / option.split
    dynamic = ctx.calibration.activation_memory
    return Activations(dynamic * activation, dynamic * transient)


# ---- Megatron-core memory ----------------------------------------------------------------------------
# What Megatron-core (0.16) allocates beyond the engine-neutral terms above. Each term was measured
# tensor by tensor (dsauto.profile.memory.MemoryTracker, regions and module hooks around forward,
# backward and the optimizer step) while Megatron-core trained a GPT of hidden size 256, 4 heads,
# FFN 1024 and vocabulary 4096 in bf16 on micro-batches of 2 x 256 tokens on CPU ranks
# (benchmarks/megatron_memory.py; results in benchmarks/results/megatron_memory.md). MiB figures are
# at tp 1 unless said otherwise; tp 2 halves each of them.

def attention_scores_per_token(group: LayerGroup) -> float:
    """Attention scores per token of a transformer layer, over all heads (heads x sequence length):
    :func:`dsauto.spec.model.layer_groups` counts 4 FLOPs per score and head dimension."""
    return group.attention_flops_per_token / (4 * group.head_dim) if group.head_dim else 0.0


def megatron_routed_copy_change_bytes_per_token(group: LayerGroup) -> float:
    """How Megatron-core's routed experts keep a token's top-k copies otherwise than the
    engine-neutral count (:attr:`LayerGroup.expert_act_bytes_per_token`: each copy's input, inner
    activations and output before the weighted combine), per token at the mean load, before tensor
    parallelism divides it. Megatron-core (0.13 on) weights each copy by its router probability
    inside the experts, after the activation function (transformer/moe/experts.py, ``bias_act_func``
    and ``SequentialMLP``; transformer/mlp.py, ``per_token_scale``), and its dispatchers combine the
    outputs unweighted (token_dispatcher.py, ``unpermute`` without probs, whose backward keeps no
    input): so no copy's output is kept (-h). Weighting in the activation's fused kernel
    (``weighted_bias_swiglu_impl``) keeps nothing more; unfused (every activation but SwiGLU), the
    weighting and a gated unit's product keep more (:attr:`LayerGroup.megatron_expert_extra_bytes_per_token`).
    Measured on two CPU ranks (benchmarks/megatron_memory.py, the ep2 plans: GeLU experts, unfused),
    the engine-neutral count put the peak 2.6% low, this 0.6%; with gated GeLU experts 5.6% low
    before the gated unit's terms. 0 without experts (both fields are)."""
    return group.megatron_expert_extra_bytes_per_token - group.dispatch_bytes_per_token


def megatron_softmax_fp32_bytes_per_token(group: LayerGroup, tp: int, dtype_bytes: int,
                                           softmax_fp32: bool = True) -> float:
    """Bytes per token that Megatron-core's unfused attention keeps for backward beyond the 16-bit
    probabilities :attr:`LayerGroup.attention_score_bytes_per_token` counts.

    With 16-bit scores, ``attention_softmax_in_fp32`` (TransformerConfig's default) and no fused
    softmax kernel (``masked_softmax_fusion`` is off by default, and CUDA-only),
    ``FusedScaleMaskSoftmax.forward_torch_softmax`` (megatron/core/fusions/fused_softmax.py) up-casts
    the scores to fp32 and torch's softmax keeps its fp32 output for backward, while the product with
    the values (``DotProductAttention.forward``, megatron/core/transformer/dot_product_attention.py)
    keeps the probabilities cast back to 16 bits: 4 more bytes per score. Measured: one layer's core
    attention kept 3.31 MiB per micro-batch, of which 2 MiB the fp32 softmax, 1 MiB the bf16
    probabilities and 0.25 MiB its output. In fp32 the softmax output is the probabilities (0).

    With attention dropout the product with the values keeps the dropout's output instead, which
    the engine-neutral count already holds beside the mask, and nothing keeps the 16-bit
    probabilities: 4 - 2 bytes per score. Measured on an H100 (benchmarks/device_steps.py, GPT-2 XL's
    layers, 8 x 1024 tokens): the count without this put the peak 14% high; tensor by tensor on CPU
    in bf16, the layer kept the fp32 softmax output, the dropout's mask and its 16-bit output.

    Without ``softmax_fp32`` (``attention_softmax_in_fp32`` False, Megatron-LM's default, or its
    fused masked-softmax kernel, ``masked_softmax_fusion``, whose 16-bit output is what it keeps for
    backward: megatron/core/fusions/fused_softmax.py) the softmax keeps its 16-bit output, the
    probabilities the engine-neutral count holds: nothing more."""
    if dtype_bytes >= 4 or not softmax_fp32:
        return 0.0
    return attention_scores_per_token(group) * (4 - (dtype_bytes if group.attention_dropout else 0)) / tp


def megatron_eager_qkv_bytes_per_token(group: LayerGroup, tp: int, core_recomputed: bool = False) -> float:
    """Bytes per token that Megatron-core's unfused attention keeps of the queries, keys and values
    beyond the engine-neutral count (one copy of each, :attr:`LayerGroup.act_tp_bytes_per_token`).

    ``SelfAttention`` (megatron/core/transformer/attention.py) splits the fused QKV output into
    views of one storage; the rotary embedding (``apply_rotary_pos_emb``) returns new query and
    key tensors; ``DotProductAttention.forward`` (dot_product_attention.py) repeats grouped keys and
    values to every head (``repeat_interleave``, a copy) before its matrix products keep them. A
    kept view keeps the whole QKV storage. Under ``core_attn`` recomputation the checkpoint keeps
    its inputs instead: the rotated copies and the unrepeated values (a view). Measured tensor by
    tensor on CPU in bf16 (Llama-shaped, 8 heads, 4 key/value groups): the rotated queries and the
    repeated keys and values, each at the query width, and no QKV storage."""
    q, kv = group.query_bytes_per_token, group.kv_bytes_per_token
    if not q:
        return 0.0
    k, rotary = kv / 2, group.rotary
    grouped = k < q and not core_recomputed  # repeated only inside the recomputed core
    query = q if rotary else 0.0
    key = q if grouped else k if rotary else 0.0
    value = q if grouped else 0.0
    # The QKV storage stays while a view of it is kept: the query or key unrotated, the value unrepeated.
    storage = q + kv if not rotary or not grouped else 0.0
    kept = query + key + value + storage
    return (kept - (q + kv)) / tp


def megatron_mlp_backward_bytes_per_token(group: LayerGroup, tp: int, dtype_bytes: int,
                                         replicated_div: int) -> float:
    """Bytes per token a transformer layer's backward holds beyond its kept activations and its
    weight's gradient (:func:`megatron_weight_grad_bytes`) at its MLP output projection:
    ``LinearWithGradAccumulationAndAsyncCommunication.backward`` (megatron/core/tensor_parallel/
    layers.py) computes ``grad_input = grad_output.matmul(weight)`` and then ``grad_weight =
    grad_output.t().matmul(total_input)``, so the gradient of the layer's output (hidden size, split
    by sequence parallelism), the gradient of the MLP's inner activation (the FFN width over tp) and
    the weight's gradient live together. (On a pipeline stage's last layer the output's gradient is
    the one the stage received, which :func:`dsauto.cost.step.megatron_stage_bytes` counts too.)
    Measured on one rank in fp32 (hidden 256, FFN 1024, 2 x 256 tokens): 0.5 MiB, 2 MiB and 1 MiB
    above the recomputed layer's activations, the peak of its backward; with every layer recomputed
    on two ranks in fp32 (benchmarks/accuracy.py), the peak of tp 2 and pp 2 at this moment."""
    return group.checkpoint_bytes_per_token / replicated_div + mlp_out_input_elements(group) * dtype_bytes / tp


def mlp_out_input_elements(group: LayerGroup) -> float:
    """Elements per token of the dense MLP's inner activation, its output projection's input (the
    projection's FLOPs over twice the hidden size), averaged over the group's layers."""
    return group.mlp_out_matmul_flops_per_token / (2 * group.gemm_dim) if group.gemm_dim else 0.0


def megatron_attention_backward_bytes_per_token(group: LayerGroup, tp: int, dtype_bytes: int,
                                                 fp32_scores: int, softmax_fp32: bool = True) -> float:
    """Bytes per token beyond a transformer layer's kept activations at the backward of Megatron-core's
    unfused attention softmax, where the score-sized gradients peak: the fp32 ones alive then, less
    the kept scores (freed by their backward) and the MLP's inner activations (freed before).

    In fp32, ``DotProductAttention.forward`` (megatron/core/transformer/dot_product_attention.py)
    views the ``baddbmm`` result as the scores and ``FusedScaleMaskSoftmax.forward_torch_softmax``
    (megatron/core/fusions/fused_softmax.py) masks that view in place (``attention_mask_func``,
    megatron/core/transformer/utils.py: ``masked_fill_``), so autograd (torch 2.13) rebuilds the
    view's gradient on the base and backs the in-place fill through ``CopySlices``: the base's zero-filled gradient,
    CopySlices' result, the clone of its slice and ``masked_fill``'s output, 4 score tensors at
    once. In 16 bits the softmax runs on an fp32 copy (``input.float()``, no view): its saved fp32
    output, the up-cast gradient of the probabilities and the softmax's input gradient, 3. Measured
    on one CPU rank (hidden 256, 4 heads, 1 x 1024 tokens, 16 MiB per fp32 score tensor): 4 and 3 of
    them at the peak of the layer's backward, which the layer's count puts within 0.05% in both
    dtypes beside the s x s boolean causal mask Megatron makes per call, not counted
    (tests/cost/test_megatron_memory.py). On an H100 the 16-bit backward holds one more
    (``fp32_scores``, the device's ``softmax_backward_fp32_scores``: 4; benchmarks/device_steps.py).
    Without ``softmax_fp32`` the 16-bit softmax runs on the scores themselves, and its backward
    holds the fp32 path's 4 tensors in 16 bits: measured on one CPU rank in bf16 (the layer above),
    the peak is one fp32 score tensor (16 MiB) below the fp32 softmax's, which this count gives
    (tests/cost/test_megatron_memory.py measures both). The fused kernels, CUDA-only, are not
    measured here: Megatron's writes the input's gradient into the output's (fused_softmax.py) and
    Transformer Engine's makes a new one, 2 or 3 16-bit score tensors, which this count bounds from
    above. On a GPU the fp32 path holds ``fp32_scores`` (4 on an H100) where the CPU holds 3, so the
    16-bit path saves more there; that saving is not measured on a GPU."""
    scores = attention_scores_per_token(group) / tp
    alive = (4 * 4 if dtype_bytes >= 4 else fp32_scores * 4 if softmax_fp32 else 4 * dtype_bytes) * scores
    kept = group.attention_score_bytes_per_token / tp + megatron_softmax_fp32_bytes_per_token(
        group, tp, dtype_bytes, softmax_fp32)
    return alive - kept - group.mlp_act_bytes_per_token / tp


def megatron_score_buffer_bytes(group: LayerGroup, tokens: int, tp: int, dtype_bytes: int) -> float:
    """The buffer Megatron-core's unfused attention computes its raw scores into, one ``[b * a / tp,
    s, s]`` tensor per rank in the activation dtype (one layer's scores for a micro-batch of
    ``tokens``): ``DotProductAttention.forward`` takes it from the global memory buffer
    (``parallel_state.get_global_memory_buffer().get_tensor(..., "mpu")``; megatron/core/utils.py,
    ``GlobalMemoryBuffer``), which allocates it at the first forward and keeps it for the run.
    Measured: 1 MiB (0.5 MiB at tp 2) that stays after the first micro-batch, beyond parameters,
    gradients and optimizer states."""
    return tokens * attention_scores_per_token(group) / tp * dtype_bytes


def megatron_weight_grad_bytes(group: LayerGroup, tp: int, dtype_bytes: int) -> float:
    """Autograd's gradient of the layer's largest weight, in the parameter dtype, which exists from
    the weight's backward until DDP's hook adds it into the fp32 main-gradient buffer and frees it
    (megatron/core/distributed/distributed_data_parallel.py, ``_make_backward_post_hook``:
    ``param.main_grad.add_(param.grad.data); param.grad = None``). Measured: on a first pipeline
    stage the word embedding's 2 MiB bf16 gradient, at the end of its backward; with pp 1 the tied
    word embedding's, which autograd sums over its two uses before the hook runs, so that it lives
    from the head's backward to the embedding's, through every transformer layer's backward
    (:func:`dsauto.cost.step.megatron_stage_bytes` adds it to their moments; measured in fp32 at
    tp 2: the table's 2 MiB gradient alive at the backward of the last transformer layer)."""
    return group.largest_op_params / tp * dtype_bytes


def megatron_loss_bytes_per_token(vocab: int, tp: int, dtype_bytes: int) -> float:
    """Bytes per token on the last stage at the loss, beyond the kept activations: the logits in
    the activation dtype and their fp32 copy, which ``vocab_parallel_cross_entropy``
    (megatron/core/tensor_parallel/cross_entropy.py: ``calculate_logits_max`` up-casts,
    ``calculate_predicted_logits`` and ``calculate_cross_entropy_loss`` work in place) turns into the
    softmax it keeps for backward. Backward turns that softmax into the logits' gradient in place
    (``calculate_gradients``) and casts it back to the activation dtype next to it: the same bytes
    again, no more. In fp32 the copy is the logits. Measured: 4 MiB of bf16 logits and 8 MiB of fp32
    softmax, 12 MiB above the activations at the loss and at the start of backward."""
    return vocab / tp * (4 + (dtype_bytes if dtype_bytes < 4 else 0))


def megatron_tied_output_table(embedding: LayerGroup) -> LayerGroup:
    """The output layer's own copy of a tied word embedding, on a last pipeline stage that does not
    hold the embedding, as a layer of the word table's parameters (no position table), which
    :func:`model_state` prices like any other: GPTModel allocates the output weight there
    (megatron/core/models/gpt/gpt_model.py: ``skip_weight_param_allocation`` only on the first
    stage), and ``LanguageModule.setup_embeddings_and_output_layer``
    (megatron/core/models/common/language_module/language_module.py) marks it shared and keeps it
    equal to the embedding by all-reducing their gradients (``_allreduce_word_embedding_grads``,
    megatron/core/distributed/finalize_model_grads.py), so it has a main gradient and optimizer
    state too. Measured: the last of two stages held 18 MiB more model state than its layers
    (1 M parameters x 18 bytes in bf16)."""
    return dataclasses.replace(embedding, count=1, params=embedding.tp_params)


def megatron_boundary_bytes_per_token(hidden_size: int, dtype_bytes: int, replicated_div: int) -> float:
    """A pipeline stage's output (and, in backward, the gradient it receives for it) per token.
    ``forward_backward_pipelining_without_interleaving`` keeps each micro-batch's output until its
    backward; ``deallocate_output_tensor`` frees its data early only with ``deallocate_pipeline_outputs``,
    which ModelParallelConfig leaves off (megatron/core/pipeline_parallel/schedules.py). Measured: a
    first stage held 0.25 MiB per micro-batch in flight beyond its layers' kept activations, and
    0.25 MiB more from the start of each backward."""
    return hidden_size * dtype_bytes / replicated_div
