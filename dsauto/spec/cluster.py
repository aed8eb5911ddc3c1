"""Cluster descriptions: the accelerator, the links between accelerators, and how many there are."""

from __future__ import annotations

import numbers

from dataclasses import dataclass, field

from dsauto.errors import DsautoError
from dsauto.spec.limits import (
    MAX_BANDWIDTH_GBPS,
    MAX_DEVICE_MEMORY_BYTES,
    MAX_DEVICES,
    MAX_DEVICES_PER_NODE,
    MAX_FLOPS,
    MAX_SECONDS,
    MAX_WIDTH,
    check_bounds,
)
from dsauto.spec.training import DTYPE_BYTES


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: its memory, its peak speed, and how close real kernels get to that peak."""

    name: str
    """Name printed in plans, e.g. ``A100-SXM4-80GB``."""
    memory_bytes: int
    """Device memory in bytes."""
    peak_flops: dict[str, float]
    """Peak dense FLOP/s per dtype (``bf16``, ``fp16``, ``fp32``), without sparsity; ``fp8`` where the
    device has FP8 tensor cores (Hopper on), which FP8 plans' linear layers run at."""
    memory_bandwidth_gbps: float
    """Device memory bandwidth in GB/s (10^9 bytes per second)."""
    matmul_efficiency: float = 0.8
    """Fraction of peak FLOP/s that large matrix multiplies reach. The defaults of this field and the
    efficiencies below are generic; the GPU presets carry constants fitted per device generation to
    published training runs (benchmarks/fit_device.py, errors in benchmarks/results/fidelity.md)."""
    matmul_half_dim: float = 32.0
    """GEMM dimension at which matmul efficiency falls to half of ``matmul_efficiency``: small
    (e.g. tensor-parallel-sharded) matrices run further from peak."""
    memory_bandwidth_efficiency: float = 0.6
    """Fraction of peak memory bandwidth that bandwidth-bound kernels reach."""
    comm_overlap_efficiency: float = 0.8
    """Fraction of communication that hides behind concurrent compute; the rest still shows,
    because collectives and matrix multiplies contend for SMs and memory bandwidth (Pati et al.
    2024, "T3", Sec. 2.3, measure 10-30% slowdowns of overlapped GEMMs)."""
    attention_efficiency: float = 0.0
    """Fraction of peak FLOP/s that the fused (flash) attention kernel reaches, counting its backward
    at 2.5x the forward FLOPs as FlashAttention-2 does (Dao 2023, Sec. 4.1): about 0.7 on A100 and
    0.35 on H100 for FlashAttention-2 (Shah et al. 2024, "FlashAttention-3", Sec. 1). 0 prices fused
    attention like a matrix multiply over the head dimension."""
    fused_attention_efficiency: float | None = None
    """Fraction of peak FLOP/s that cuDNN's fused attention reaches, counted as ``attention_efficiency``
    is: the kernel Transformer Engine's DotProductAttention runs as FusedAttention (the
    F16_arbitrary_seqlen backend), which it prefers over FlashAttention on Hopper (compute
    capability 9.0 on: transformer_engine/pytorch/attention/dot_product_attention/utils.py,
    get_attention_backend, "Disabling FlashAttention to give FusedAttention preference on Hopper+
    for performance reasons"). Hopper attention kernels run 1.5-2.0x faster than FlashAttention-2
    (Shah et al. 2024, "FlashAttention-3", Abstract). None: the device has no such kernel
    (pre-Hopper), and a strategy asking for it is priced at ``attention_efficiency``
    (:attr:`dsauto.cost.strategy.Strategy.attention_kernel`)."""
    fp8_matmul_efficiency: float | None = None
    """Fraction of the ``fp8`` peak FLOP/s that the linear layers' FP8 GEMMs reach (Transformer
    Engine's FP8 GEMMs under ``--fp8-format``, :attr:`dsauto.cost.strategy.Strategy.fp8`), saturating
    with the GEMM's size as ``matmul_efficiency`` does; an end-to-end figure like it. None: priced
    at ``matmul_efficiency``."""
    grouped_gemm_knee_tokens: float = 0.0
    """Tokens per expert at which a grouped GEMM (Megatron-core's ``--moe-grouped-gemm``, one kernel
    over a rank's local experts) takes twice the time of the same FLOPs in one large GEMM; the
    time grows as 1 + (knee / tokens per expert)^2 (:func:`dsauto.cost.terms.expert_gemm_seconds`).
    Measured, not fitted to runs: benchmarks/device_experts.py on the GPU. 0: not measured, no
    such penalty priced."""
    softmax_backward_fp32_scores: int = 4
    """fp32 tensors of the attention scores' size alive at the backward of Megatron-core's unfused
    16-bit softmax (``FusedScaleMaskSoftmax.forward_torch_softmax`` up-casts the scores;
    :func:`dsauto.cost.terms.megatron_attention_backward_bytes_per_token`). Measured: 4 on an H100
    (torch 2.11; benchmarks/results/device_steps_h100-80gb.md: the backward peaks of five plans
    within 0.6% with it, 3.3-10.3% low with 3), 3 on CPU ranks (torch 2.13; tests/cost/
    test_megatron_memory.py). Which tensor the GPU holds more was not established, nor whether the
    difference is the device's or torch's (the two ran different versions); the A100 and H200
    presets take the H100's count unmeasured. Measured with Megatron-core's local layer spec
    (DotProductAttention); Transformer Engine's unfused attention may hold a different count."""
    kernel_launch_seconds: float = 5e-6
    """Fixed cost of launching one kernel; operator splitting launches more of them."""
    memory_reserve_bytes: int = 0
    """Memory kept back from every plan: runtime context, communication buffers, allocator
    fragmentation. A plan's peak must fit in ``memory_bytes - memory_reserve_bytes``."""

    def __post_init__(self) -> None:
        if not self.peak_flops:
            raise ValueError("peak_flops must give the peak FLOP/s of at least one dtype, e.g. {bf16: 312e12}")
        check_bounds([
            (self.memory_bytes, "memory_bytes", dict(minimum=1, maximum=MAX_DEVICE_MEMORY_BYTES)),
            *((flops, f"peak_flops.{dtype}", dict(above=0, maximum=MAX_FLOPS))
              for dtype, flops in self.peak_flops.items()),
            (self.memory_bandwidth_gbps, "memory_bandwidth_gbps", dict(above=0, maximum=MAX_BANDWIDTH_GBPS)),
            (self.matmul_efficiency, "matmul_efficiency", dict(above=0, maximum=1)),
            (self.matmul_half_dim, "matmul_half_dim", dict(minimum=0, maximum=MAX_WIDTH)),
            (self.memory_bandwidth_efficiency, "memory_bandwidth_efficiency", dict(above=0, maximum=1)),
            (self.comm_overlap_efficiency, "comm_overlap_efficiency", dict(minimum=0, maximum=1)),
            (self.attention_efficiency, "attention_efficiency", dict(minimum=0, maximum=1)),
            *(((self.fused_attention_efficiency, "fused_attention_efficiency", dict(above=0, maximum=1)),)
              if self.fused_attention_efficiency is not None else ()),
            *(((self.fp8_matmul_efficiency, "fp8_matmul_efficiency", dict(above=0, maximum=1)),)
              if self.fp8_matmul_efficiency is not None else ()),
            (self.grouped_gemm_knee_tokens, "grouped_gemm_knee_tokens", dict(minimum=0, maximum=MAX_WIDTH)),
            (self.softmax_backward_fp32_scores, "softmax_backward_fp32_scores", dict(minimum=0, maximum=16)),
            (self.kernel_launch_seconds, "kernel_launch_seconds", dict(minimum=0, maximum=MAX_SECONDS)),
            (self.memory_reserve_bytes, "memory_reserve_bytes", dict(minimum=0, maximum=self.memory_bytes - 1)),
        ])

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise DsautoError(
                f"The device {self.name} has no peak FLOP/s for {dtype}; add it to peak_flops "
                f"(known: {', '.join(self.peak_flops)})."
            )
        return self.peak_flops[dtype]


@dataclass(frozen=True)
class LinkSpec:
    """A class of links (within a node or between nodes), seen from one device."""

    bandwidth_gbps: float
    """Unidirectional bandwidth available to one device, GB/s."""
    latency_seconds: float
    """Per-message latency of one hop (alpha in the alpha-beta model)."""
    efficiency: float = 0.8
    """Fraction of ``bandwidth_gbps`` that large collectives reach (NCCL bus bandwidth / link)."""

    def __post_init__(self) -> None:
        check_bounds([
            (self.bandwidth_gbps, "bandwidth_gbps", dict(above=0, maximum=MAX_BANDWIDTH_GBPS)),
            (self.latency_seconds, "latency_seconds", dict(minimum=0, maximum=MAX_SECONDS)),
            (self.efficiency, "efficiency", dict(above=0, maximum=1)),
        ])


@dataclass(frozen=True)
class HardwareSpec:
    """A node type: the device and the links within and between nodes."""

    name: str
    """Preset or file name, e.g. ``a100-80gb``."""
    device: DeviceSpec
    """The accelerator in every slot."""
    intra_node: LinkSpec
    """Device-to-device links inside a node (NVLink / NVSwitch; shared memory on CPU)."""
    inter_node: LinkSpec
    """Per-device network between nodes (one NIC per GPU on DGX-class machines)."""
    gpus_per_node: int = 8
    """Devices per node when the user does not say."""
    dtype: str = "bf16"
    """Training dtype used unless the user says otherwise."""
    host_link: LinkSpec | None = None
    """Each device's link to host memory (PCIe), what offloaded state crosses; None: not known, and
    nothing is offloaded."""
    host_memory_bytes: int = 0
    """Host (CPU) memory of one node, shared by its devices' offloaded state; 0: not known."""
    host_memory_bandwidth_gbps: float = 0.0
    """Host DRAM bandwidth of one node (all sockets), GB/s: the CPU optimizer's update is
    bandwidth-bound (:func:`dsauto.cost.offload.cpu_optimizer_seconds`); 0: not known."""

    def __post_init__(self) -> None:
        check_bounds([(self.gpus_per_node, "gpus_per_node", dict(minimum=1, maximum=MAX_DEVICES_PER_NODE)),
                      (self.host_memory_bytes, "host_memory_bytes", dict(minimum=0, maximum=MAX_DEVICE_MEMORY_BYTES)),
                      (self.host_memory_bandwidth_gbps, "host_memory_bandwidth_gbps",
                       dict(minimum=0, maximum=MAX_BANDWIDTH_GBPS))])
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")


@dataclass(frozen=True)
class ClusterSpec:
    """The cluster a plan is made for: ``nodes`` nodes of ``gpus_per_node`` devices each."""

    hardware: HardwareSpec
    """The node type."""
    nodes: int = 1
    """Number of nodes."""
    gpus_per_node: int = field(default=0)
    """Devices per node; 0 takes the hardware's default."""
    memory_limit_bytes: int = 0
    """Per-device memory budget overriding ``device.memory_bytes - memory_reserve_bytes``; 0: none."""

    def __post_init__(self) -> None:
        for name, what, option in (("nodes", "number of nodes", "--nodes"),
                                   ("gpus_per_node", "devices per node", "--gpus-per-node")):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise DsautoError(f"The {what} must be a whole number, got {value!r}; give {option} as one.")
            object.__setattr__(self, name, int(value))  # numpy's integers, as Python's
        if self.nodes <= 0:
            raise DsautoError(f"The number of nodes must be at least 1, got {self.nodes}.")
        if self.gpus_per_node < 0:
            raise DsautoError(f"The devices per node must be at least 1, got {self.gpus_per_node}.")
        if self.gpus_per_node > MAX_DEVICES_PER_NODE:
            raise DsautoError(f"{self.gpus_per_node} devices per node is more than the {MAX_DEVICES_PER_NODE} "
                              f"dsauto plans for; lower --gpus-per-node.")
        if self.world_size > MAX_DEVICES:
            raise DsautoError(f"{self.nodes} nodes x {self.devices_per_node} devices = {self.world_size} devices is "
                              f"more than the {MAX_DEVICES} dsauto plans for; lower --nodes or --gpus-per-node.")
        if self.memory_limit_bytes < 0:
            raise DsautoError(f"The memory limit must be positive, got {self.memory_limit_bytes} bytes; give a "
                              f"size such as 60GiB, or leave it out.")

    @property
    def devices_per_node(self) -> int:
        return self.gpus_per_node or self.hardware.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def device(self) -> DeviceSpec:
        return self.hardware.device

    @property
    def memory_budget_bytes(self) -> int:
        """What one rank's plan may use at its peak."""
        if self.memory_limit_bytes:
            return self.memory_limit_bytes
        return self.device.memory_bytes - self.device.memory_reserve_bytes
