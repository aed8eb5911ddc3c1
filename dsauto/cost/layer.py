"""Time and memory of one layer under one strategy and one per-layer option.

Compute is a roofline on the device spec: matrix multiplies at a size-dependent fraction of peak
FLOP/s, bandwidth-bound kernels at a fraction of memory bandwidth (Williams, Waterman and Patterson
2009, "Roofline"). Backward costs twice the forward FLOPs (the gradients with respect to inputs and
to weights; Kaplan et al. 2020, Sec. 2.1) and twice the forward memory traffic.

Memory per rank follows ZeRO (Rajbhandari et al. 2020, Sec. 3 and 5): mixed-precision Adam keeps
2 bytes of parameters, 2 of gradients and 12 of optimizer state (fp32 master, momentum, variance)
per parameter; stage 1 shards the 12 over the data-parallel ranks, stage 2 the gradients too, stage 3
the parameters too. Activations per token follow :mod:`dsauto.spec.model` (Korthikanti et al. 2022).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsauto.cost.calibration import IDENTITY, Calibration
from dsauto.cost.collectives import Group, dp_group, measured, pp_link, scaled, tp_group
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.model import LayerGroup
from dsauto.spec.training import TrainSpec

if TYPE_CHECKING:  # the profile package imports the cost model's collectives
    from dsauto.profile.store import Profile

# Bytes the Adam update reads and writes per parameter it owns: fp32 master, momentum and variance
# read and written (24), the gradient read (4 after up-casting) and the 16-bit copy written (2).
ADAM_BYTES_PER_PARAM = 30.0

# Weight matrices of a transformer layer as Megatron and the reference model fuse them: QKV, the
# attention output projection, the MLP input (gate and up fused for SwiGLU) and the MLP output.
MATRICES_PER_LAYER = 4

# Modules of the embedding (tables, dropout and the container) and of the head (norm, LM head and
# the container) in the reference implementation, hooked by ZeRO-3 like any other.
EDGE_LAYER_MODULES = 4


def gathered_unit_params(group: LayerGroup, option: LayerOption, tp: int) -> float:
    """Parameters ZeRO-3 gathers at once for a sharded layer: its largest matrix, or one slice of it
    when split (OSDP). The head's split chunks its loss, not its matrix, which is gathered whole."""
    split = 1 if group.logits_bytes_per_token else option.split
    return group.largest_op_params / tp / split


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

    @property
    def static_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


class CostModel:
    """Prices layers for one cluster, workload and strategy; cheap to build, pure to call."""

    def __init__(self, cluster: ClusterSpec, train: TrainSpec, strategy: Strategy, hidden_size: int,
                 profile: Profile | None = None, calibration: Calibration | None = None):
        """``calibration`` overrides the factors stored with the profile (the identity without one)."""
        self.cluster, self.train, self.strategy = cluster, train, strategy
        # A profile measured at another sequence length or dtype does not describe this workload.
        usable = profile is not None and profile.seq_len == train.seq_len and profile.dtype == train.dtype
        self.profile = profile if usable else None
        stored = self.profile.calibration if self.profile is not None else None
        self.calibration = calibration or stored or IDENTITY
        self.hidden_size = hidden_size
        device = cluster.device
        self.peak_flops = device.flops(train.dtype)
        self.matmul_efficiency = device.matmul_efficiency
        self.half_dim = device.matmul_half_dim
        self.bandwidth = device.memory_bandwidth_gbps * 1e9 * device.memory_bandwidth_efficiency
        self.tp: Group = tp_group(cluster, strategy.tp)
        self.dp: Group = dp_group(cluster, strategy.tp, strategy.dp)
        self.pp: Group = pp_link(cluster, strategy.tp, strategy.dp)
        if self.profile is not None and self.profile.collectives:
            self.tp = measured(self.tp, self._fits(strategy.tp, strategy.tp > cluster.devices_per_node))
            self.dp = measured(self.dp, self._fits(strategy.dp, strategy.tp * strategy.dp > cluster.devices_per_node))
            self.pp = measured(self.pp, self._fits(2, strategy.tp * strategy.dp >= cluster.devices_per_node, ("send_recv",)))
        comm = self.calibration.communication
        self.tp, self.dp, self.pp = scaled(self.tp, comm), scaled(self.dp, comm), scaled(self.pp, comm)
        self.tokens = strategy.micro_batch * train.seq_len
        # Mixed precision: 16-bit activations, params and grads, 12 bytes of fp32 optimizer state
        # (ZeRO paper, Sec. 3.1). Pure fp32 without ZeRO: 4-byte params and grads, 8 bytes of Adam
        # moments. DeepSpeed's ZeRO optimizers keep an fp32 master copy of their partition even
        # when the model is fp32 (``single_partition_of_fp32_groups`` in stage_1_and_2.py and
        # ``fp32_partitioned_groups_flat`` in stage3.py are clones), so ZeRO 1-3 hold 12 bytes.
        self.dtype_bytes = train.dtype_bytes
        self.optim_bytes = 12 if self.dtype_bytes < 4 or strategy.zero_stage >= 1 else 8
        # Activations tensor parallelism replicates are split too under sequence parallelism.
        self.replicated_div = strategy.tp if strategy.sequence_parallel and strategy.tp > 1 else 1

    def _fits(self, size: int, spans_nodes: bool,
              ops: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")) -> list[tuple[str, float, float]]:
        """The profile's fitted (op, latency, bytes/s) for groups of ``size`` ranks in this scope."""
        assert self.profile is not None
        scope = "inter_node" if spans_nodes else "intra_node"
        fits = [self.profile.collective(op, size, scope) for op in ops]
        return [(f.op, f.latency_seconds, f.bandwidth_gbps * 1e9) for f in fits if f is not None]

    def _zero3_hooks_seconds(self, group: LayerGroup, option: LayerOption) -> float:
        """ZeRO-3's per-module hook time for one micro-batch of this layer, when the profile measured
        it: every module is hooked, resident or not; a split adds its slices (profile.engine)."""
        profile = self.profile
        if self.strategy.zero_stage != 3 or profile is None or not profile.zero3_module_seconds:
            return 0.0
        if group.logits_bytes_per_token or not group.gemm_dim:
            modules = EDGE_LAYER_MODULES  # the embedding and the head
        else:
            unsplit = profile.layer_modules.get("1", 0)
            modules = profile.layer_modules.get(str(option.split), unsplit + MATRICES_PER_LAYER * (option.split - 1))
        return modules * profile.zero3_module_seconds * self.calibration.zero3_hooks

    def optimizer_seconds(self, params: float) -> float:
        """One optimizer update of ``params`` parameters on this rank: measured per parameter when
        profiled, else the memory traffic of Adam over the device bandwidth."""
        if self.profile is not None and self.profile.optimizer_seconds_per_param > 0:
            seconds = params * self.profile.optimizer_seconds_per_param
        else:
            seconds = self.memory_seconds(params * ADAM_BYTES_PER_PARAM)
        return seconds * self.calibration.optimizer

    def matmul_seconds(self, flops: float, dim: float) -> float:
        """A GEMM of ``flops`` whose smallest dimension is ``dim``: efficiency saturates with size."""
        if flops <= 0:
            return 0.0
        efficiency = self.matmul_efficiency * dim / (dim + self.half_dim)
        return flops / (self.peak_flops * efficiency)

    def overlapped(self, compute_seconds: float, comm_seconds: float) -> float:
        """Compute and communication issued together: the longer of the two, plus the part of the
        shorter one that does not hide (see DeviceSpec.comm_overlap_efficiency)."""
        hidden = self.cluster.device.comm_overlap_efficiency
        return max(compute_seconds, comm_seconds) + (1 - hidden) * min(compute_seconds, comm_seconds)

    def memory_seconds(self, num_bytes: float) -> float:
        return num_bytes / self.bandwidth

    def layer(self, group: LayerGroup, option: LayerOption) -> LayerCost:
        s, t = self.strategy, self.strategy.tp
        tokens, replicated_div = self.tokens, self.replicated_div
        flash = self.train.flash_attention

        # Compute. Splitting a matrix into k slices shrinks the sliced dimension (OSDP, Jiang et al.
        # 2023, Sec. 4.2), which costs matmul efficiency; the head splits over tokens instead.
        gemm_dim = min(group.gemm_dim / t if group.gemm_dim else 0, tokens)
        if option.split > 1:
            gemm_dim = min(gemm_dim, tokens / option.split) if group.logits_bytes_per_token else gemm_dim / option.split
        matmul = self.matmul_seconds(group.matmul_flops_per_token * tokens / t, gemm_dim)
        attention_flops = group.attention_flops_per_token * tokens / t
        if flash and group.causal:
            attention_flops /= 2  # fused causal kernels skip the masked upper triangle
        attention = self.matmul_seconds(attention_flops, group.head_dim)
        elementwise_bytes = tokens * (
            group.elementwise_bytes_per_token / replicated_div
            + group.elementwise_tp_bytes_per_token / t
            + (0.0 if flash else group.softmax_bytes_per_token / t)
        )
        elementwise = self.memory_seconds(elementwise_bytes)
        # Megatron tensor parallelism: all-reduces in forward and as many in backward (Shoeybi et
        # al. 2019, Fig. 4); with sequence parallelism all-gather + reduce-scatter of equal volume
        # (Korthikanti et al. 2022, Sec. 4.2.2). Not overlapped with compute.
        tp_comm = self.tp.all_reduce(group.tp_comm_bytes_per_token * tokens)
        # Each extra slice launches its matmul and the accumulation of partial results again.
        launches = (option.split - 1) * 2 * self.cluster.device.kernel_launch_seconds
        speed = self.calibration.compute
        forward = speed * (matmul + attention + elementwise) + tp_comm + launches
        backward = 2 * (speed * (matmul + attention + elementwise) + launches) + tp_comm
        if option.checkpoint:
            backward += forward  # recomputation: one more forward inside backward
        # Measured compute replaces the roofline where the profile has the layer (interpolated in
        # the micro-batch); the collectives and the slicing overheads stay priced as above.
        sample = (self.profile.estimate(group.name, t, s.micro_batch, option.checkpoint)
                  if self.profile is not None else None)
        if sample is not None:
            forward = speed * sample.forward_seconds + tp_comm + launches
            backward = speed * sample.backward_seconds + tp_comm + 2 * launches

        # Parameters on this rank and their memory.
        local_params = group.tp_params / t + (group.params - group.tp_params)
        dp = s.dp
        sharded = s.zero_stage == 3 and option.shard_params and dp > 1
        params_bytes = local_params * self.dtype_bytes / (dp if sharded else 1)
        if s.zero_stage == 3 and not sharded and dp > 1:
            # A resident (ds_persist) group keeps its ZeRO-3 partition too: the optimizer updates the
            # partition and re-gathers the full copy from it after each step (measured in
            # benchmarks/results/hook_memory.md: (1 + 1/dp) x its parameters).
            params_bytes += local_params * self.dtype_bytes / dp
        grads_bytes = local_params * self.dtype_bytes / (dp if s.zero_stage >= 2 else 1)
        optimizer_bytes = local_params * self.optim_bytes / (dp if s.zero_stage >= 1 else 1)

        # Data-parallel traffic. ZeRO-3 gathers sharded parameters before each use in forward and
        # again in backward, and reduce-scatters gradients every micro-batch; ZeRO-2 reduce-scatters
        # every micro-batch too; both overlap with the layer's compute (prefetch, overlap_comm), so a
        # layer costs about the larger of the two (ZeRO paper, Sec. 7: 1.5x the data-parallel volume).
        param_volume = local_params * self.dtype_bytes
        grad_volume = local_params * self.dtype_bytes
        # DeepSpeed gathers each submodule's parameters with its own all-gather (a transformer
        # layer's four matrices, each of its k slices when split), so the latency is paid per
        # matrix, not once per layer (PartitionedParameterCoordinator.fetch_sub_module).
        transformer = group.gemm_dim and not group.logits_bytes_per_token
        gathers = (MATRICES_PER_LAYER if transformer else 1) * option.split
        split_latency = (gathers - 1) * self.dp.latency_seconds * max(0, dp - 1)
        hooks = self._zero3_hooks_seconds(group, option)
        if hooks:
            split_latency = 0.0  # the measured per-module cost includes launching the gathers
            forward += hooks / 2
            backward += hooks / 2 * (2 if option.checkpoint else 1)  # recomputation runs the forward hooks again
        step_seconds, grad_sync = 0.0, 0.0
        if dp > 1:
            if sharded:
                gather = self.dp.all_gather(param_volume) + split_latency
                forward = self.overlapped(forward, gather)
                backward = self.overlapped(backward, gather + self.dp.reduce_scatter(grad_volume))
            elif s.zero_stage >= 2:
                backward = self.overlapped(backward, self.dp.reduce_scatter(grad_volume))
                step_seconds = self.dp.all_gather(param_volume)  # updated shards back to every rank
            elif s.zero_stage == 1:
                grad_sync = grad_volume  # reduce-scattered once per step, like an all-reduce's half
                step_seconds = self.dp.all_gather(param_volume)
            else:
                grad_sync = grad_volume
            if s.zero_stage == 3 and not sharded:
                step_seconds = self.dp.all_gather(param_volume)  # re-gather the persistent copy

        # Activations (Korthikanti et al. 2022, Table 2, generalised in spec.model).
        full_activation = tokens * (
            group.act_tp_bytes_per_token / t
            + group.act_replicated_bytes_per_token / replicated_div
            + (0.0 if flash else group.attention_score_bytes_per_token / t)
        )
        checkpoint_activation = tokens * group.checkpoint_bytes_per_token / replicated_div
        # A transformer layer's kept bytes are measured too (the profile's shards have no sequence
        # parallelism, so it applies without SP only); the embedding and head keep the analytic
        # counts, whose logits term is exact.
        transformer = group.name not in ("embedding", "head")
        if sample is not None and transformer and replicated_div == 1:
            full = self.profile.estimate(group.name, t, s.micro_batch, False)
            if full is not None:
                full_activation = full.activation_bytes
            if option.checkpoint:
                checkpoint_activation = sample.activation_bytes
        if option.checkpoint:
            activation = checkpoint_activation
            transient = full_activation  # the recomputed layer lives until its backward ends
        else:
            activation, transient = full_activation, 0.0
        if sharded:
            # The gathered unit in use and the next one prefetched; the emitted config bounds the
            # gathered parameters to two units (stage3_max_live_parameters, see emit.ds_config).
            transient += 2 * gathered_unit_params(group, option, t) * self.dtype_bytes
        if group.logits_bytes_per_token:
            transient += tokens * group.logits_bytes_per_token / t / option.split

        optimizer_params = local_params / (dp if s.zero_stage >= 1 else 1)
        static, dynamic = self.calibration.static_memory, self.calibration.activation_memory
        params_bytes, grads_bytes, optimizer_bytes = (static * params_bytes, static * grads_bytes,
                                                      static * optimizer_bytes)
        activation, transient = dynamic * activation, dynamic * transient
        return LayerCost(
            forward_seconds=forward,
            backward_seconds=backward,
            step_seconds=step_seconds,
            params_bytes=params_bytes,
            grads_bytes=grads_bytes,
            optimizer_bytes=optimizer_bytes,
            activation_bytes=activation,
            transient_bytes=transient,
            grad_sync_bytes=grad_sync,
            optimizer_seconds=self.optimizer_seconds(optimizer_params),
            measured=sample is not None,
        )

    def grad_sync_seconds(self, grad_bytes: float) -> float:
        """Once-per-step gradient reduction of ZeRO 0 (all-reduce) or 1 (reduce-scatter)."""
        if self.strategy.zero_stage == 1:
            return self.dp.reduce_scatter(grad_bytes)
        return self.dp.all_reduce(grad_bytes)

    def p2p_seconds(self) -> float:
        """Sending one micro-batch's boundary activation to the next stage (and its gradient back)."""
        boundary = self.tokens * self.hidden_size * self.dtype_bytes
        return self.pp.send_recv(boundary / self.replicated_div)
