"""Time of the collectives a plan issues, from the alpha-beta (latency + size / bandwidth) model.

Ring algorithms (Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective Communication
Operations in MPICH"; the same bus-bandwidth factors as NCCL's performance notes):
  all-reduce      2(n-1)/n · S / B + 2(n-1) · alpha
  all-gather      (n-1)/n · S / B + (n-1) · alpha      (S: the gathered, full size)
  reduce-scatter  (n-1)/n · S / B + (n-1) · alpha      (S: the full input size)
  send/recv       S / B + alpha

Placement: ranks are laid out tensor-parallel fastest, then data-parallel, then pipeline (the order of
Megatron-core's default ``tp-cp-ep-dp-pp`` and of DeepSpeed's topology with Megatron's mpu). A group
that spans nodes uses the hierarchical algorithm NCCL picks: with k group members per node, the
inter-node phase moves 1/k of the data over each member's own NIC, so the group sees k times one NIC's
bandwidth, capped by the intra-node link.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from dsauto.parallel import Dim, ParallelDims
from dsauto.spec.cluster import ClusterSpec


@dataclass(frozen=True)
class Group:
    """A communication group as the cost model sees it: its size, bandwidth and latency."""

    size: int
    """Ranks in the group."""
    bandwidth_bytes_per_second: float
    """Effective bandwidth available to one member for large messages."""
    latency_seconds: float
    """Latency per ring step."""

    def all_reduce(self, size_bytes: float) -> float:
        if self.size <= 1 or size_bytes <= 0:
            return 0.0
        n = self.size
        return 2 * (n - 1) / n * size_bytes / self.bandwidth_bytes_per_second + 2 * (n - 1) * self.latency_seconds

    def all_gather(self, size_bytes: float) -> float:
        if self.size <= 1 or size_bytes <= 0:
            return 0.0
        n = self.size
        return (n - 1) / n * size_bytes / self.bandwidth_bytes_per_second + (n - 1) * self.latency_seconds

    reduce_scatter = all_gather

    def send_recv(self, size_bytes: float) -> float:
        if self.size <= 1 or size_bytes <= 0:
            return 0.0
        return size_bytes / self.bandwidth_bytes_per_second + self.latency_seconds


def _link(cluster: ClusterSpec, members_per_node: int, spans_nodes: bool) -> tuple[float, float]:
    intra, inter = cluster.hardware.intra_node, cluster.hardware.inter_node
    intra_bw = intra.bandwidth_gbps * 1e9 * intra.efficiency
    if not spans_nodes:
        return intra_bw, intra.latency_seconds
    inter_bw = inter.bandwidth_gbps * 1e9 * inter.efficiency * max(1, members_per_node)
    # A ring enters and leaves each node once: of every k hops (k members per node) k - 1 stay on
    # the node's links and one crosses the network, so a step costs their mean latency.
    k = max(1, members_per_node)
    return min(intra_bw, inter_bw), ((k - 1) * intra.latency_seconds + inter.latency_seconds) / k


def group_of(cluster: ClusterSpec, dims: ParallelDims, dim: Dim) -> Group:
    """The group of ``dim`` under ``dims``, placed on the cluster's nodes by the rank order
    (:class:`dsauto.parallel.ParallelDims`: how many members share a node, whether it crosses one)."""
    per_node = cluster.devices_per_node
    bw, lat = _link(cluster, dims.members_per_node(dim, per_node), dims.spans_nodes(dim, per_node))
    return Group(dims.degree(dim), bw, lat)


@dataclass(frozen=True)
class AllToAll:
    """An all-to-all group: expert parallelism's token dispatch and combine.

    Pairwise exchange (Thakur, Rabenseifner and Gropp 2005, Sec. 3.6): each of n members sends 1/n of
    its bytes to every other member in n - 1 steps. The k - 1 partners on its node are reached over
    the node's links; the n - k others through the member's own NIC, with no aggregation across the
    node's NICs (unlike a ring's hierarchical phase, each byte has its own destination), the two
    moving at once (NCCL's all-to-all is grouped send/recv)."""

    size: int
    """Ranks in the group."""
    members_per_node: int
    """Of them, how many share a node (with each other)."""
    intra_bytes_per_second: float
    """One member's bandwidth to the others on its node."""
    inter_bytes_per_second: float
    """One member's bandwidth off its node (its NIC)."""
    intra_latency_seconds: float
    inter_latency_seconds: float

    def all_to_all(self, size_bytes: float) -> float:
        """Time to exchange ``size_bytes`` held by each member (1/n of it stays)."""
        n = self.size
        if n <= 1 or size_bytes <= 0:
            return 0.0
        k = max(1, min(self.members_per_node, n))
        intra = (k - 1) / n * size_bytes / self.intra_bytes_per_second
        inter = (n - k) / n * size_bytes / self.inter_bytes_per_second
        return max(intra, inter) + (k - 1) * self.intra_latency_seconds + (n - k) * self.inter_latency_seconds

    def node_deduplicated(self, size_bytes: float, network_share: float) -> float:
        """Time to dispatch ``size_bytes`` held by each member (every copy of its tokens) the way
        DeepEP does across nodes: each token crosses the network once per node it goes to (to the
        member with the same local index there), ``network_share`` of the bytes in all, and every
        copy reaches its expert's member over the node's links; the two move at once."""
        n = self.size
        if n <= 1 or size_bytes <= 0:
            return 0.0
        k = max(1, min(self.members_per_node, n))
        intra = (n - 1) / n * size_bytes / self.intra_bytes_per_second
        inter = network_share * size_bytes / self.inter_bytes_per_second
        nodes = -(-n // k)
        return max(intra, inter) + (k - 1) * self.intra_latency_seconds + (nodes - 1) * self.inter_latency_seconds


def expert_all_to_all(cluster: ClusterSpec, dims: ParallelDims, factor: float = 1.0) -> AllToAll:
    """The expert-parallel group of ``dims`` (its ep members etp ranks apart inside a stage), each
    collective taking ``factor`` times as long (the communication calibration)."""
    intra, inter = cluster.hardware.intra_node, cluster.hardware.inter_node
    per_node = dims.expert_members_per_node(cluster.devices_per_node)
    return AllToAll(dims.ep, per_node if dims.expert_group_spans_nodes(cluster.devices_per_node) else dims.ep,
                    intra.bandwidth_gbps * 1e9 * intra.efficiency / factor,
                    inter.bandwidth_gbps * 1e9 * inter.efficiency / factor,
                    intra.latency_seconds * factor, inter.latency_seconds * factor)


def all_to_all_of(cluster: ClusterSpec, dims: ParallelDims, dim: Dim, factor: float = 1.0) -> AllToAll:
    """The all-to-all over one ``dim`` group of ``dims``, placed by the rank order (DeepSpeed-Ulysses'
    sequence-parallel group for ``"cp"``), each collective taking ``factor`` times as long."""
    intra, inter = cluster.hardware.intra_node, cluster.hardware.inter_node
    per_node = cluster.devices_per_node
    members = dims.members_per_node(dim, per_node) if dims.spans_nodes(dim, per_node) else dims.degree(dim)
    return AllToAll(dims.degree(dim), members,
                    intra.bandwidth_gbps * 1e9 * intra.efficiency / factor,
                    inter.bandwidth_gbps * 1e9 * inter.efficiency / factor,
                    intra.latency_seconds * factor, inter.latency_seconds * factor)


def tp_group(cluster: ClusterSpec, tp: int) -> Group:
    """The tensor-parallel group: the ``tp`` consecutive ranks (inside a node when tp <= gpus per node)."""
    return group_of(cluster, ParallelDims(tp=tp), "tp")


def dp_group(cluster: ClusterSpec, tp: int, dp: int) -> Group:
    """The data-parallel group: ``dp`` ranks with stride ``tp``."""
    return group_of(cluster, ParallelDims(dp=dp, tp=tp), "dp")


def ring_link(cluster: ClusterSpec, dims: ParallelDims, dim: Dim) -> Group:
    """The link of a ring of point-to-point sends over ``dim``'s group (context parallelism's ring
    attention): every member sends to the next at once, so a step lasts as long as the slowest send,
    which crosses the network through its own NIC where the group spans nodes. A ring collective
    (:func:`group_of`) moves its steps over the node's NICs together; these sends cannot."""
    bw, lat = _link(cluster, 1, dims.spans_nodes(dim, cluster.devices_per_node))
    return Group(dims.degree(dim), bw, lat)


def pp_link(cluster: ClusterSpec, tp: int, dp: int) -> Group:
    """The link between neighbouring pipeline stages (ranks ``tp * dp`` apart): one send at a time."""
    bw, lat = _link(cluster, 1, ParallelDims(dp=dp, tp=tp).pipeline_crosses_nodes(cluster.devices_per_node))
    return Group(2, bw, lat)


@dataclass(frozen=True)
class MeasuredGroup(Group):
    """A group whose collectives use latencies and bandwidths fitted to measurements
    (:mod:`dsauto.profile.collectives`), one pair per operation; operations not measured fall back to
    the group's own link figures."""

    fitted: tuple[tuple[str, float, float], ...] = ()
    """(operation, latency seconds per ring step, bus bandwidth bytes/s) per measured operation."""

    def _with(self, op: str) -> Group:
        for name, latency, bandwidth in self.fitted:
            if name == op:
                return Group(self.size, bandwidth, latency)
        return Group(self.size, self.bandwidth_bytes_per_second, self.latency_seconds)

    def all_reduce(self, size_bytes: float) -> float:
        return self._with("all_reduce").all_reduce(size_bytes)

    def all_gather(self, size_bytes: float) -> float:
        return self._with("all_gather").all_gather(size_bytes)

    def reduce_scatter(self, size_bytes: float) -> float:
        return self._with("reduce_scatter").reduce_scatter(size_bytes)

    def send_recv(self, size_bytes: float) -> float:
        return self._with("send_recv").send_recv(size_bytes)


def measured(group: Group, fits: Sequence[tuple[str, float, float]]) -> Group:
    """``group`` with the fitted operations of its size and scope, or unchanged when none were."""
    return MeasuredGroup(group.size, group.bandwidth_bytes_per_second, group.latency_seconds,
                         tuple(fits)) if fits else group


def scaled(group: Group, factor: float) -> Group:
    """``group`` with every collective taking ``factor`` times as long (a calibration factor):
    bandwidths divided and latencies multiplied by it."""
    if factor == 1.0:
        return group
    fitted = tuple((op, latency * factor, bandwidth / factor)
                   for op, latency, bandwidth in getattr(group, "fitted", ()))
    extra = {"fitted": fitted} if isinstance(group, MeasuredGroup) else {}
    return replace(group, bandwidth_bytes_per_second=group.bandwidth_bytes_per_second / factor,
                   latency_seconds=group.latency_seconds * factor, **extra)
