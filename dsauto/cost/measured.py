"""What the cost model and the search read from measured costs, as a protocol.

A profile (:class:`dsauto.profile.store.Profile`) is written by a higher layer than the cost model:
it runs the engines to measure. The cost model and the search read it only through
:class:`MeasuredCosts`, which the profile satisfies structurally, so neither imports the profile
package; a test double with the same members serves as well.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dsauto.cost.calibration import Calibration
from dsauto.spec.model import LayerGroup


@runtime_checkable
class MeasuredLayer(Protocol):
    """One layer's measured (or interpolated) cost on one rank for one micro-batch."""

    @property
    def forward_seconds(self) -> float:
        """Forward time."""
        ...

    @property
    def backward_seconds(self) -> float:
        """Backward time, recomputation included when the layer ran checkpointed."""
        ...

    @property
    def activation_bytes(self) -> float:
        """Bytes autograd keeps for backward after the forward pass."""
        ...

    @property
    def hidden_bytes(self) -> float:
        """The head only: what its layers before the LM head matrix keep for backward (the final
        norm), with their output; 0 for other layers or where not measured."""
        ...


@runtime_checkable
class MeasuredCollective(Protocol):
    """A collective's fitted latency and bandwidth on one kind of group."""

    @property
    def op(self) -> str:
        """``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``send_recv``."""
        ...

    @property
    def latency_seconds(self) -> float:
        """Latency of one ring step."""
        ...

    @property
    def bandwidth_gbps(self) -> float:
        """Bus bandwidth, GB/s (10^9 bytes per second)."""
        ...


@runtime_checkable
class MeasuredCosts(Protocol):
    """Measured costs of one model on one device: exactly what the cost model and the search read."""

    @property
    def key(self) -> str:
        """How a plan names where its measured costs came from."""
        ...

    @property
    def seq_len(self) -> int:
        """Tokens per sequence of every measurement (another workload falls back to the analytic model)."""
        ...

    @property
    def dtype(self) -> str:
        """Training dtype of every measurement."""
        ...

    @property
    def engine(self) -> str:
        """Whose transformer layers were measured: ``deepspeed``, dsauto's reference layers (or the
        user's own); ``megatron``, Megatron-core's own dense layer."""
        ...

    @property
    def calibration(self) -> Calibration | None:
        """Correction factors fitted to measured steps, applied by default; None if not fitted."""
        ...

    @property
    def collectives(self) -> Sequence[MeasuredCollective]:
        """Fitted collectives; empty when nothing was measured on several ranks."""
        ...

    @property
    def optimizer_seconds_per_param(self) -> float:
        """One optimizer update per parameter on one rank; 0 if not measured."""
        ...

    @property
    def cpu_optimizer_seconds_per_param(self) -> float:
        """One update per parameter of the host's optimizer (an offloaded plan's), with one rank's
        threads; 0 if not measured."""
        ...

    @property
    def zero3_module_seconds(self) -> float:
        """ZeRO-3's hook time per hooked module and micro-batch; 0 if not measured."""
        ...

    @property
    def layer_modules(self) -> Mapping[str, int]:
        """Modules ZeRO-3 hooks in one transformer layer, by operator-splitting factor (``"1"``, ...)."""
        ...

    def estimate(self, group: str, tp: int, micro_batch: int, checkpoint: bool) -> MeasuredLayer | None:
        """The named layer group's cost at this setting, or None where it was not measured."""
        ...

    def collective(self, op: str, group_size: int, scope: str) -> MeasuredCollective | None:
        """The fit of ``op`` on groups of ``group_size`` ranks in ``scope`` (``intra_node`` or
        ``inter_node``), or None where it was not measured."""
        ...


MOE_GROUP_SUFFIX = "-moe"
"""A profile measures a mixture of experts' MoE layer as its own group, named the transformer group's
name with this suffix (``decoder-moe``); the dense layers (DeepSeek's first ones) as the group itself."""


@dataclass(frozen=True)
class AveragedLayer:
    """The per-layer average over a transformer group that mixes dense and MoE layers."""

    forward_seconds: float
    backward_seconds: float
    activation_bytes: float
    hidden_bytes: float = 0.0


def transformer_layer_estimate(profile: MeasuredCosts, group: LayerGroup, tp: int, micro_batch: int,
                               checkpoint: bool) -> MeasuredLayer | None:
    """The measured cost of one layer of ``group``: of a dense group, its own measurement; of a
    mixture of experts, the MoE layer's measurement, averaged with the dense layer's by their shares
    of the stack (``LayerGroup.moe_layer_fraction``, as the group's analytic numbers average them).
    None when a needed measurement is missing (the analytic model then prices the layer)."""
    fraction = group.moe_layer_fraction
    if group.kind != "transformer" or not fraction:
        return profile.estimate(group.name, tp, micro_batch, checkpoint)
    moe = profile.estimate(group.name + MOE_GROUP_SUFFIX, tp, micro_batch, checkpoint)
    if moe is None or fraction >= 1.0:
        return moe
    dense = profile.estimate(group.name, tp, micro_batch, checkpoint)
    if dense is None:
        return None

    def mean(name: str) -> float:
        return (1.0 - fraction) * getattr(dense, name) + fraction * getattr(moe, name)

    return AveragedLayer(mean("forward_seconds"), mean("backward_seconds"), mean("activation_bytes"))
