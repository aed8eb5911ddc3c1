"""Offload: what moves from device memory to host memory, what crosses the host link for it, and the
CPU optimizer's update.

Both engines keep the optimizer on the host the same way (ZeRO-Offload, Ren et al. 2021, Sec. 4.1):
the fp32 master weights and Adam moments live in host memory and the CPU updates them; each step the
gradients of the rank's partition go down the host link as fp32 and the updated 16-bit parameters
come back up.

- DeepSpeed (``zero_optimization.offload_optimizer``; deepspeed/runtime/zero/stage_1_and_2.py): the
  gradient partition is cast to fp32 on the device and copied into the host's fp32 gradient buffer
  at the accumulation boundary (``copy_grads_in_partition``); after the CPU step the fp32 partition
  is copied into a pinned 16-bit host buffer and from it to the device (``step``,
  ``param_buffer_of_bit16_for_cpu_offload_groups``). Nothing overlaps the CPU step by default (the
  delayed parameter update is off), so the copy down, the step and the copy up are priced one after
  the other. ``offload_param`` (ZeRO-3) keeps each rank's parameter partition on the host as well:
  it crosses the host link before every all-gather of the layer (forward, backward and the
  recomputed forward), priced as not hidden.
- Megatron-core (``OptimizerConfig.optimizer_cpu_offload`` with ``optimizer_offload_fraction`` 1;
  megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py, ``HybridDeviceOptimizer``): the same
  state on the host, its fp32 gradient copy pinned there (``cpu_copy_map_grad``); with
  ``overlap_cpu_optimizer_d2h_h2d`` each parameter's CPU step waits only for its own gradient copy
  and its copy back is issued right after (``step``, ``param_copy_back_gpu_hook``), so the copies
  hide behind the CPU steps: the step costs the longest of the three.

The device keeps its 16-bit parameters and its gradient partition: only the optimizer state (and,
with ``offload_param``, the parameter partitions) leaves it.
"""

from __future__ import annotations

from dsauto.errors import DsautoError
from dsauto.plan import Engine, Offload
from dsauto.spec.cluster import ClusterSpec

_UNDESCRIBED = ("The hardware {name} does not describe its hosts, so an offloaded plan cannot be priced; add "
                "host_link, host_memory_bytes and host_memory_bandwidth_gbps to its file, or plan with --offload none.")

OPTIMIZER_STATE_BYTES_PER_PARAM = 12
"""fp32 master weight and two fp32 Adam moments (Rajbhandari et al. 2020, Sec. 3.1)."""
HOST_GRAD_BYTES_PER_PARAM = 4
"""The fp32 gradient copy on the host, and what crosses the host link down per parameter."""
CPU_ADAM_BYTES_PER_PARAM = 30
"""Bytes the CPU's Adam update reads and writes per parameter: master weight, momentum and variance
read and written (24), the fp32 gradient read (4) and the 16-bit parameter written (2). DeepSpeed's
CPUAdam is vectorised and multi-threaded (ZeRO-Offload, Ren et al. 2021, Sec. 5.1; AVX-512 / AVX2 in
csrc/includes/cpu_adam.h), a few FLOPs per 30 bytes, so host memory bandwidth is what bounds it.
Measured on the CI machine: 10x the rate of torch's AdamW (benchmarks/results/offload.md)."""


def offloads_optimizer(offload: Offload) -> bool:
    return offload != "none"


def offloads_params(offload: Offload) -> bool:
    return offload == "optimizer+params"


def host_bytes(optimizer_params: float, param_partition_params: float, dtype_bytes: int,
               offload: Offload) -> float:
    """Host memory one rank's offloaded state takes: per parameter whose update it runs, the
    optimizer state, the fp32 gradient and the 16-bit copy that goes back up; plus, with
    ``offload_param``, its partition of the sharded parameters (``param_partition_params``)."""
    if not offloads_optimizer(offload):
        return 0.0
    per_param = OPTIMIZER_STATE_BYTES_PER_PARAM + HOST_GRAD_BYTES_PER_PARAM + dtype_bytes
    params = param_partition_params * dtype_bytes if offloads_params(offload) else 0.0
    return optimizer_params * per_param + params


def host_link(cluster: ClusterSpec) -> tuple[float, float]:
    """One device's effective bandwidth to host memory (the preset's PCIe link x its efficiency), in
    bytes per second, and the link's latency per copy."""
    link = cluster.hardware.host_link
    if link is None:
        raise DsautoError(_UNDESCRIBED.format(name=cluster.hardware.name))
    return link.bandwidth_gbps * 1e9 * link.efficiency, link.latency_seconds


def cpu_optimizer_params_per_second(cluster: ClusterSpec, measured_seconds_per_param: float = 0.0) -> float:
    """Parameters per second the CPU optimizer updates for one device: measured by ``dsauto
    profile`` when given, else the node's host memory bandwidth shared by its devices over
    :data:`CPU_ADAM_BYTES_PER_PARAM` (the DRAM's peak: a bound the real update does not beat)."""
    if measured_seconds_per_param > 0:
        return 1.0 / measured_seconds_per_param
    if cluster.hardware.host_memory_bandwidth_gbps <= 0:
        raise DsautoError(_UNDESCRIBED.format(name=cluster.hardware.name))
    bandwidth = cluster.hardware.host_memory_bandwidth_gbps * 1e9 / cluster.devices_per_node
    return bandwidth / CPU_ADAM_BYTES_PER_PARAM


def offloaded_step_seconds(optimizer_params: float, dtype_bytes: int, engine: Engine, cluster: ClusterSpec,
                           measured_seconds_per_param: float = 0.0) -> float:
    """The optimizer update of ``optimizer_params`` parameters kept on the host, as the step sees it:
    the gradients down, the CPU update and the parameters up, one after the other under DeepSpeed and
    overlapped under Megatron-core (see the module doc)."""
    if optimizer_params <= 0:
        return 0.0
    link, latency = host_link(cluster)
    down = optimizer_params * HOST_GRAD_BYTES_PER_PARAM / link + latency
    up = optimizer_params * dtype_bytes / link + latency
    update = optimizer_params / cpu_optimizer_params_per_second(cluster, measured_seconds_per_param)
    if engine == "megatron":
        return max(down, update, up)
    return down + update + up


def host_accumulation_seconds(partition_params: float, dtype_bytes: int, micro_batches: int,
                              cluster: ClusterSpec) -> float:
    """ZeRO-2 with ``offload_optimizer`` over ``micro_batches`` > 1 micro-batches, per micro-batch: DeepSpeed
    0.19 accumulates the gradients of the rank's partition in host memory, so every micro-batch's
    backward copies each of them down, and from the second on first copies the sum so far up to add
    to (deepspeed/runtime/zero/stage_1_and_2.py, ``copy_grads_in_partition`` and
    ``async_accumulate_grad_in_cpu_via_gpu``, in the training dtype; with ``overlap_comm``, as emitted,
    on the reduction stream, the host waiting for the earlier copies before each one:
    ``_wait_for_offload_copies``): one copy down and (m - 1) / m up a micro-batch, priced as not hidden. ZeRO-1 reduces, and so copies, once
    a step, at its last micro-batch (:func:`offloaded_step_seconds`)."""
    if micro_batches <= 1 or partition_params <= 0:
        return 0.0
    link, latency = host_link(cluster)
    one = partition_params * dtype_bytes / link + latency
    return one * (1 + (micro_batches - 1) / micro_batches)


def param_fetch_seconds(partition_params: float, dtype_bytes: int, cluster: ClusterSpec) -> float:
    """``offload_param``: copying one rank's parameter partition of a layer from host memory to the
    device before the layer's all-gather (deepspeed/runtime/zero/partition_parameters.py,
    ``all_gather_coalesced`` moves each ``ds_tensor`` to the device first)."""
    link, latency = host_link(cluster)
    return partition_params * dtype_bytes / link + latency
