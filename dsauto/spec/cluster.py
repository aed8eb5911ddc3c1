"""Cluster descriptions: the accelerator, the links between accelerators, and how many there are."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsauto.errors import DsautoError


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: its memory, its peak speed, and how close real kernels get to that peak."""

    name: str
    """Name printed in plans, e.g. ``A100-SXM4-80GB``."""
    memory_bytes: int
    """Device memory in bytes."""
    peak_flops: dict[str, float]
    """Peak dense FLOP/s per dtype (``bf16``, ``fp16``, ``fp32``), without sparsity."""
    memory_bandwidth_gbps: float
    """Device memory bandwidth in GB/s (10^9 bytes per second)."""
    matmul_efficiency: float = 0.8
    """Fraction of peak FLOP/s that large matrix multiplies reach. The defaults of this and the next
    two fields are fitted to published A100 runs (benchmarks/fit_device.py, benchmarks/fidelity.py)."""
    matmul_half_dim: float = 32.0
    """GEMM dimension at which matmul efficiency falls to half of ``matmul_efficiency``: small
    (e.g. tensor-parallel-sharded) matrices run further from peak."""
    memory_bandwidth_efficiency: float = 0.6
    """Fraction of peak memory bandwidth that bandwidth-bound kernels reach."""
    comm_overlap_efficiency: float = 0.8
    """Fraction of communication that hides behind concurrent compute; the rest still shows,
    because collectives and matrix multiplies contend for SMs and memory bandwidth (Pati et al.
    2024, "T3", Sec. 2.3, measure 10-30% slowdowns of overlapped GEMMs)."""
    kernel_launch_seconds: float = 5e-6
    """Fixed cost of launching one kernel; operator splitting launches more of them."""
    memory_reserve_bytes: int = 0
    """Memory kept back from every plan: runtime context, communication buffers, allocator
    fragmentation. A plan's peak must fit in ``memory_bytes - memory_reserve_bytes``."""

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
        if self.nodes <= 0:
            raise DsautoError(f"The number of nodes must be at least 1, got {self.nodes}.")
        if self.gpus_per_node < 0:
            raise DsautoError(f"The devices per node must be at least 1, got {self.gpus_per_node}.")

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
