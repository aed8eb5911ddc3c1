"""Time and memory of one layer under one strategy and one per-layer option.

:class:`CostModel` prices a layer by composing the terms of :mod:`dsauto.cost.terms` (where the
formulas and their sources are): compute, tensor-parallel collectives, ZeRO-3's hooks, data-parallel
traffic, model state and activations. Measured costs (:class:`dsauto.cost.measured.MeasuredCosts`,
a profile) replace the roofline's compute, the kept activations of transformer layers, the
collectives' fits and the optimizer rate where they exist.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsauto.cost.calibration import IDENTITY, Calibration
from dsauto.cost.collectives import (
    Group,
    all_to_all_of,
    dp_group,
    expert_all_to_all,
    group_of,
    measured,
    pp_link,
    ring_link,
    scaled,
)
from dsauto.cost.measured import MeasuredCosts, MeasuredLayer, transformer_layer_estimate
from dsauto.cost.offload import (
    host_accumulation_seconds,
    host_bytes,
    offloaded_step_seconds,
    offloads_optimizer,
    offloads_params,
    param_fetch_seconds,
)
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import (
    EDGE_LAYER_MODULES,
    MATRICES_PER_LAYER,
    DeviceModel,
    LayerContext,
    activation_memory,
    context_parallel_seconds,
    data_parallel_cost,
    expert_dispatch_seconds,
    gathered_unit_params,
    model_state,
    overlapped_dispatch,
    partial_dist_opt_sync_seconds,
    pass_seconds,
    state_bytes_per_param,
    steady_pair_fraction,
    zero3_hook_seconds,
)
from dsauto.plan import deepspeed_bf16_optimizer
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.model import LayerGroup
from dsauto.spec.training import TrainSpec

__all__ = ["ADAM_BYTES_PER_PARAM", "EDGE_LAYER_MODULES", "MATRICES_PER_LAYER", "CostModel", "LayerCost",
           "gathered_unit_params"]

# Bytes the Adam update reads and writes per parameter it owns: fp32 master, momentum and variance
# read and written (24), the gradient read (4 after up-casting) and the 16-bit copy written (2).
ADAM_BYTES_PER_PARAM = 30.0


@dataclass(frozen=True)
class LayerCost:
    """Cost of one layer on one rank, for one micro-batch unless said otherwise."""

    forward_seconds: float
    """Forward time of one micro-batch, collectives not hidden by compute included."""
    backward_seconds: float
    """Backward time of one micro-batch, recomputation included."""
    step_seconds: float
    """Once per optimizer step, not hidden: gathering updated parameters that ZeRO sharded."""
    params_bytes: float
    """Resident parameter bytes."""
    grads_bytes: float
    """Gradient bytes."""
    optimizer_bytes: float
    """Optimizer-state bytes."""
    activation_bytes: float
    """Bytes kept for backward per micro-batch in flight."""
    transient_bytes: float
    """Short-lived peak while this layer runs: recomputed activations, gathered parameters, logits."""
    grad_sync_bytes: float
    """Gradient bytes this rank reduces over the data-parallel group once per step (ZeRO 0/1)."""
    optimizer_seconds: float
    """Time of this layer's share of the optimizer update."""
    measured: bool = False
    """Whether the compute times (and, for transformer layers, the activations) came from a profile."""
    offloaded_bytes: float = 0.0
    """Host memory this layer's offloaded state takes on this rank (:mod:`dsauto.cost.offload`)."""

    @property
    def static_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


class CostModel:
    """Prices layers for one cluster, workload and strategy; cheap to build, pure to call."""

    def __init__(self, cluster: ClusterSpec, train: TrainSpec, strategy: Strategy, hidden_size: int,
                 profile: MeasuredCosts | None = None, calibration: Calibration | None = None):
        """``calibration`` overrides the factors stored with the profile (the identity without one)."""
        self.cluster, self.train, self.strategy = cluster, train, strategy
        # A profile measured at another sequence length or dtype does not describe this workload.
        usable = profile is not None and profile.seq_len == train.seq_len and profile.dtype == train.dtype
        self.profile = profile if usable else None
        stored = self.profile.calibration if self.profile is not None else None
        self.calibration = calibration or stored or IDENTITY
        self.hidden_size = hidden_size
        self.device = DeviceModel.of(cluster.device, train.dtype)
        dims, per_node = strategy.dims, cluster.devices_per_node
        # Gradients are reduced, and ZeRO shards, over the dp x cp ranks that hold the same parameters.
        replicas = dims.gradient_group()
        tp: Group = group_of(cluster, dims, "tp")
        dp: Group = group_of(cluster, replicas, "dp")
        cp: Group = group_of(cluster, dims, "cp")
        pp: Group = pp_link(cluster, strategy.tp, replicas.dp)
        if self.profile is not None and self.profile.collectives:
            tp = measured(tp, self._fits(strategy.tp, dims.spans_nodes("tp", per_node)))
            dp = measured(dp, self._fits(replicas.dp, replicas.spans_nodes("dp", per_node)))
            pp = measured(pp, self._fits(2, dims.pipeline_crosses_nodes(per_node), ("send_recv",)))
        comm = self.calibration.communication
        self.pp = scaled(pp, self.calibration.pipeline_p2p)
        # With context parallelism a rank computes its 1/cp share of each sequence.
        self.tokens = strategy.micro_batch * train.seq_len // dims.cp
        # Gradient and optimizer-state bytes as the engine keeps them (see state_bytes_per_param).
        dtype_bytes = train.dtype_bytes
        current_scaling = strategy.fp8 and strategy.fp8_recipe == "tensorwise"
        grad_bytes, optimizer_bytes = state_bytes_per_param(
            strategy.engine, dtype_bytes, train.dtype == "bf16", strategy.zero_stage,
            strategy.precision_aware_optimizer, current_scaling)
        if strategy.engine == "megatron" and train.dtype == "bf16" and not strategy.grad_reduce_in_fp32:
            # The gradient buffer then takes the parameter dtype (megatron/core/distributed/
            # distributed_data_parallel.py: grad_dtype = fp32 only with grad_reduce_in_fp32).
            grad_bytes = dtype_bytes
        # Adam's memory traffic a parameter: its states read and written, its gradient read, its
        # weight written (and, with the main weights kept as remainders, the weight read to rebuild them).
        # FusedAdam unscales fp16 and fp8 moments into fp32 copies, updates those and scales them back
        # (fused_adam.py, step): 16 bytes more a moment than updating them in place.
        self.adam_bytes = ADAM_BYTES_PER_PARAM if strategy.precision_aware_optimizer is None else (
            2 * optimizer_bytes + grad_bytes + dtype_bytes * (1 if current_scaling else 2)
            + (2 * 16 if strategy.precision_aware_optimizer in ("fp16", "fp8") else 0))
        self.context = LayerContext(
            device=self.device, tp=strategy.tp, dp=replicas.dp, zero_stage=strategy.zero_stage,
            tokens=self.tokens,
            # Activations tensor parallelism replicates are split too under sequence parallelism.
            replicated_div=strategy.tp if strategy.sequence_parallel and strategy.tp > 1 else 1,
            flash_attention=train.flash_attention, dtype_bytes=dtype_bytes,
            optimizer_bytes_per_param=optimizer_bytes, grad_bytes_per_param=grad_bytes,
            resident_keeps_partition=strategy.engine == "deepspeed",
            tp_group=scaled(tp, self.calibration.tensor_parallel), dp_group=scaled(dp, comm),
            calibration=self.calibration,
            # cp is Transformer Engine's context parallelism (its cp_comm_type) under Megatron-core and
            # DeepSpeed-Ulysses under DeepSpeed.
            softmax_fp32=strategy.attention_softmax_in_fp32,
            cp=dims.cp, cp_group=scaled(cp, comm) if dims.cp > 1 and strategy.engine == "megatron" else None,
            cp_ring=scaled(ring_link(cluster, dims, "cp"), comm) if dims.cp > 1 and strategy.engine == "megatron"
            else None,
            cp_all_to_all=all_to_all_of(cluster, dims, "cp", comm) if dims.cp > 1 and (
                strategy.engine == "deepspeed" or strategy.cp_comm_type == "a2a") else None,
            cp_comm_type=strategy.cp_comm_type, engine=strategy.engine,
            expert_a2a_overlap_fraction=steady_pair_fraction(strategy.pp, strategy.virtual_stages, strategy.grad_accum)
            if strategy.expert_a2a_overlap else 0.0,
            ep=dims.ep, etp=dims.etp, expert_dp=dims.expert_dp,
            ep_group=expert_all_to_all(cluster, dims, comm) if dims.ep > 1 else None,
            # ZeRO++ hpZ's secondary partition: the hpz consecutive ranks of a node (DeepSpeed's
            # _create_zero_param_parallel_group in deepspeed/utils/groups.py).
            hpz_group=scaled(dp_group(cluster, 1, strategy.hpz), comm) if strategy.hpz > 1 else None,
            # Megatron-core's partial distributed optimizer: an instance is dp x cp / N consecutive
            # replicas (stride tp), and the same shard of each instance is that many ranks further
            # on (parallel_state.initialize_model_parallel's intra- and inter-partial groups).
            dist_opt_instances=strategy.dist_opt_instances,
            dist_opt_group=scaled(dp_group(cluster, strategy.tp, replicas.dp // strategy.dist_opt_instances), comm)
            if strategy.dist_opt_instances > 1 else None,
            dist_opt_inter_group=scaled(dp_group(cluster, strategy.tp * replicas.dp // strategy.dist_opt_instances,
                                                 strategy.dist_opt_instances), comm)
            if strategy.dist_opt_instances > 1 else None,
            recompute_early_stop=strategy.recompute_early_stop,
            expert_load_balanced=strategy.expert_load_balanced,
            expert_capacity_factor=strategy.expert_capacity_factor,
            expert_pad_to_capacity=strategy.expert_pad_to_capacity,
            experts_gathered_whole=strategy.experts_gathered_whole,
            expert_dispatcher=strategy.expert_dispatcher,
            # Only under sequence parallelism (megatron/training/arguments.py, validate_args asserts it).
            tp_comm_overlap=strategy.tp_comm_overlap,
            attention_kernel=strategy.attention_kernel,
            fp8=strategy.fp8, fp8_recipe=strategy.fp8_recipe, fp8_param_gather=strategy.fp8_param_gather,
            bf16_optimizer=deepspeed_bf16_optimizer(strategy.engine, strategy.zero_stage, strategy.pp, train.dtype),
            reference_layers_measured=self.profile is not None and self.profile.engine == "deepspeed",
        )

    def _fits(self, size: int, spans_nodes: bool,
              ops: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")) -> list[tuple[str, float, float]]:
        """The profile's fitted (op, latency, bytes/s) for groups of ``size`` ranks in this scope."""
        assert self.profile is not None
        scope = "inter_node" if spans_nodes else "intra_node"
        fits = [self.profile.collective(op, size, scope) for op in ops]
        return [(f.op, f.latency_seconds, f.bandwidth_gbps * 1e9) for f in fits if f is not None]

    def _measured_layer(self, group: LayerGroup, checkpoint: bool) -> MeasuredLayer | None:
        """The profile's cost of this layer at this strategy's TP degree and micro-batch, if any."""
        if self.strategy.dims.cp > 1:
            return None  # profiles measure whole sequences; a context-parallel share is priced analytically
        if self.strategy.fp8:
            return None  # profiles measure the training dtype's kernels; FP8 ones are priced analytically
        if self.profile is None:
            return None
        return transformer_layer_estimate(self.profile, group, self.strategy.tp, self.strategy.micro_batch, checkpoint)

    def optimizer_seconds(self, params: float) -> float:
        """One optimizer update of ``params`` parameters on this rank: measured per parameter when
        profiled, else the memory traffic of Adam over the device bandwidth; with the optimizer
        offloaded, the host's update and its copies (:func:`offloaded_step_seconds`)."""
        if offloads_optimizer(self.strategy.offload):
            measured_cpu = self.profile.cpu_optimizer_seconds_per_param if self.profile is not None else 0.0
            seconds = offloaded_step_seconds(params, self.context.dtype_bytes, self.strategy.engine, self.cluster,
                                             measured_cpu)
            return seconds * self.calibration.optimizer
        if self.profile is not None and self.profile.optimizer_seconds_per_param > 0:
            # Measured with the standard Adam's states; the precision-aware optimizer moves other bytes.
            seconds = params * self.profile.optimizer_seconds_per_param * self.adam_bytes / ADAM_BYTES_PER_PARAM
        else:
            seconds = self.memory_seconds(params * self.adam_bytes)
        return seconds * self.calibration.optimizer

    def matmul_seconds(self, flops: float, dim: float) -> float:
        """A GEMM of ``flops`` whose smallest dimension is ``dim``: efficiency saturates with size."""
        return self.device.matmul_seconds(flops, dim)

    def overlapped(self, compute_seconds: float, comm_seconds: float) -> float:
        """Compute and communication issued together (see :meth:`DeviceModel.overlapped`)."""
        return self.device.overlapped(compute_seconds, comm_seconds)

    def memory_seconds(self, num_bytes: float) -> float:
        return self.device.memory_seconds(num_bytes)

    def layer(self, group: LayerGroup, option: LayerOption) -> LayerCost:
        if group.mtp_layers:
            own = self.layer(dataclasses.replace(group, mtp_layers=0, mtp_block=None, mtp_embedding=None), option)
            return self._with_mtp(own, group, option) if self.strategy.engine == "megatron" else own
        ctx = self.context
        sample = self._measured_layer(group, option.checkpoint)
        uncheckpointed = self._measured_layer(group, False) if option.checkpoint else sample
        hooks = zero3_hook_seconds(group, option, ctx, self.profile)
        passes = pass_seconds(group, option, ctx, sample).plus(hooks).plus(context_parallel_seconds(group, option, ctx))
        if group.dispatch_bytes_per_token:
            passes = passes.plus(overlapped_dispatch(passes, expert_dispatch_seconds(group, option, ctx), ctx))
        traffic = data_parallel_cost(group, option, ctx, passes, hooks_measured=hooks.forward_seconds > 0)
        state = model_state(group, option, ctx)
        memory = activation_memory(group, option, ctx, sample, uncheckpointed)
        offload, fetch, partition, accumulate = self.strategy.offload, 0.0, 0.0, 0.0
        if offloads_optimizer(offload):
            # The optimizer state lives on the host; the device keeps parameters and gradients (but
            # ZeRO-3's gradient partitions, below).
            if offloads_params(offload) and ctx.shards(option):
                # offload_param: the partition of a sharded layer lives on the host too, and crosses
                # the host link before each of its gathers (forward, backward, recomputation).
                partition = state.optimizer_params
                fetch = param_fetch_seconds(partition, ctx.dtype_bytes, self.cluster)
            state = dataclasses.replace(
                state, optimizer_bytes=0.0,
                params_bytes=state.params_bytes - partition * ctx.dtype_bytes * ctx.calibration.static_memory)
            if self.strategy.engine == "deepspeed" and self.strategy.zero_stage == 2:
                accumulate = host_accumulation_seconds(state.optimizer_params, ctx.dtype_bytes,
                                                       self.strategy.grad_accum, self.cluster)
            if self.strategy.engine == "deepspeed" and self.strategy.zero_stage == 3:
                # ZeRO-3 keeps its gradient partitions in one flat buffer on the optimizer's device,
                # the host's when it is offloaded (deepspeed/runtime/zero/stage3.py,
                # ``grad_partitions_flat_buffer`` on ``self.device``, OffloadDeviceEnum.cpu under
                # offload_optimizer): the host's fp32 gradient (host_bytes) is that buffer.
                state = dataclasses.replace(state, grads_bytes=0.0)
        return LayerCost(
            forward_seconds=traffic.forward_seconds + fetch,
            backward_seconds=traffic.backward_seconds + fetch * (2 if option.checkpoint else 1) + accumulate,
            step_seconds=traffic.step_seconds,
            params_bytes=state.params_bytes,
            grads_bytes=state.grads_bytes,
            optimizer_bytes=state.optimizer_bytes,
            activation_bytes=memory.activation_bytes,
            transient_bytes=memory.transient_bytes,
            grad_sync_bytes=traffic.grad_sync_bytes,
            optimizer_seconds=self.optimizer_seconds(state.optimizer_params),
            measured=sample is not None,
            offloaded_bytes=host_bytes(state.optimizer_params, partition, ctx.dtype_bytes, offload),
        )

    def _with_mtp(self, own: LayerCost, head: LayerGroup, option: LayerOption) -> LayerCost:
        """The head's cost ``own`` with Megatron-core's multi-token-prediction layers beside it
        (:attr:`LayerGroup.mtp_block`), as ``MultiTokenPredictionBlock`` and ``process_mtp_loss`` run
        them on the last pipeline stage (megatron/core/transformer/multi_token_prediction.py), each
        depth: the next tokens' embedding lookup, the layer (with the plan's selective
        recomputation, its activations kept: MultiTokenPredictionLayer checkpoints itself under
        ``recompute_method`` uniform only, and skips it under block, which dsauto's plans run), and the loss
        through the head's output weight, whose gradient accumulates into the head's. Each depth's
        fp32 softmax, kept by ``vocab_parallel_cross_entropy`` for backward, is held from its loss
        through the main loss to the backward: a kept activation. The embedding the lookups read is
        priced as state on a last stage that lacks the embedding (pp > 1): its word table when not
        tied (tied, its copy is the output weight's,
        :func:`dsauto.cost.step.megatron_stage_bytes`). Measured on two CPU ranks against
        Megatron-core 0.16.1 (benchmarks/megatron_memory.py, the mtp1 plans)."""
        assert head.mtp_block is not None and head.mtp_embedding is not None
        depth = head.mtp_layers
        plain = LayerOption(checkpoint=False, shard_params=option.shard_params, split=1)
        layer = self.layer(head.mtp_block, dataclasses.replace(plain, recompute_modules=self.strategy.recompute_modules))
        again = self.layer(dataclasses.replace(head, params=0, tp_params=0, mtp_layers=0, mtp_block=None,
                                               mtp_embedding=None), option)
        lookup = self.layer(head.mtp_embedding, plain)
        table = lookup if self.strategy.pp > 1 and head.mtp_embedding.params else dataclasses.replace(
            lookup, params_bytes=0.0, grads_bytes=0.0, optimizer_bytes=0.0, grad_sync_bytes=0.0,
            step_seconds=0.0, optimizer_seconds=0.0, offloaded_bytes=0.0)
        vocab = head.largest_op_params / head.gemm_dim
        dynamic, b = self.calibration.activation_memory, self.context.dtype_bytes
        softmax = self.tokens * vocab / self.strategy.tp * 4 * dynamic
        # The block returns the main and the prediction hidden states concatenated (torch.cat), which
        # the output layer's inputs keep as views until their backward; and the last depth's logits are
        # still referenced (GPTModel._postprocess's loop variable) when the main loss runs.
        joined = self.tokens * head.gemm_dim * b / self.context.replicated_div * dynamic
        logits = self.tokens * vocab / self.strategy.tp * b * dynamic

        def total(name: str) -> float:
            return (getattr(own, name) + getattr(table, name)
                    + depth * (getattr(layer, name) + getattr(again, name)))

        per_depth = ("forward_seconds", "backward_seconds")
        return dataclasses.replace(
            own, **{name: total(name) + (depth - 1) * getattr(lookup, name) for name in per_depth},
            **{name: total(name) for name in ("step_seconds", "params_bytes", "grads_bytes", "optimizer_bytes",
                                              "grad_sync_bytes", "optimizer_seconds", "offloaded_bytes")},
            activation_bytes=total("activation_bytes") + depth * (softmax + joined),
            transient_bytes=max(own.transient_bytes + logits, layer.transient_bytes, again.transient_bytes))

    def expert_dispatch_seconds(self, group: LayerGroup) -> float:
        """The expert all-to-alls of one micro-batch through one layer of ``group``, forward and
        backward (recomputation not included): what the report shows per step."""
        passes = expert_dispatch_seconds(group, LayerOption(checkpoint=False, shard_params=False, split=1),
                                         self.context)
        return passes.forward_seconds + passes.backward_seconds

    def grad_sync_seconds(self, grad_bytes: float) -> float:
        """Once-per-step gradient reduction of ZeRO 0 (all-reduce) or 1: Megatron-core's distributed
        optimizer reduce-scatters (its partial one inside an instance and then across them);
        DeepSpeed's ZeRO-1 all-reduces each bucket whole (use_multi_rank_bucket_allreduce, which its
        plans set: stage_1_and_2.py, average_tensor and allreduce_bucket)."""
        ctx = self.context
        if ctx.dist_opt_group is not None and ctx.dist_opt_inter_group is not None:
            return partial_dist_opt_sync_seconds(grad_bytes, ctx.dist_opt_group, ctx.dist_opt_inter_group)
        if self.strategy.zero_stage == 1 and self.strategy.engine == "megatron":
            return self.context.dp_group.reduce_scatter(grad_bytes)
        return self.context.dp_group.all_reduce(grad_bytes)

    def p2p_seconds(self) -> float:
        """Sending one micro-batch's boundary activation to the next stage (and its gradient back)."""
        boundary = self.tokens * self.hidden_size * self.context.dtype_bytes
        if self.strategy.pipeline_scatter_gather and self.strategy.tp > 1 and self.context.replicated_div == 1:
            # Megatron-LM 2021-22 (Strategy.pipeline_scatter_gather): each tensor-parallel rank sends
            # its 1/tp of the boundary over its own link, and the receiving ranks all-gather the
            # pieces over the tensor-parallel group before the stage can start.
            return (self.pp.send_recv(boundary / self.strategy.tp)
                    + self.context.tp_group.all_gather(boundary))
        return self.pp.send_recv(boundary / self.context.replicated_div)
