"""The choices the cost model prices: global ones (:class:`Strategy`) and per-layer ones (:class:`LayerOption`)."""

from __future__ import annotations

from dataclasses import dataclass

from dsauto.parallel import ParallelDims
from dsauto.plan import Engine, Offload


@dataclass(frozen=True)
class Strategy:
    """The global part of a plan: degrees, ZeRO stage and batch split."""

    dims: ParallelDims
    """The parallel degrees (data, tensor, pipeline)."""
    zero_stage: int
    """ZeRO stage 0-3."""
    micro_batch: int
    """Sequences per micro-batch per data-parallel rank."""
    grad_accum: int
    """Micro-batches per step per data-parallel rank."""
    sequence_parallel: bool
    """Megatron sequence parallelism (only meaningful with tp > 1)."""
    engine: Engine = "deepspeed"
    """The engine that runs it, which decides how memory and overlap are priced."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (Megatron's interleaved 1F1B when more than 1)."""
    recompute_modules: tuple[str, ...] = ()
    """Megatron-core: the modules every transformer layer recomputes (``recompute_granularity``
    selective), which then rules out checkpointing whole layers (the engine has one granularity per
    run); empty: whole layers checkpointed or not, per layer."""
    offload: Offload = "none"
    """What the optimizer (and under ZeRO-3 the parameters' partitions) keeps in host memory."""
    hpz: int = 1
    """ZeRO++ hierarchical partition size (DeepSpeed ZeRO-3): ranks of a node sharing a secondary
    copy of the sharded parameters; 1 is plain ZeRO-3."""

    @property
    def tp(self) -> int:
        """Tensor-parallel degree."""
        return self.dims.tp

    @property
    def pp(self) -> int:
        """Pipeline-parallel degree."""
        return self.dims.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree."""
        return self.dims.dp

    def describe(self) -> str:
        sp = " sp" if self.sequence_parallel and self.tp > 1 else ""
        vpp = f" vpp={self.virtual_stages}" if self.virtual_stages > 1 else ""
        vpp += f" recompute={','.join(self.recompute_modules)}" if self.recompute_modules else ""
        vpp += f" offload={self.offload}" if self.offload != "none" else ""
        vpp += f" hpz={self.hpz}" if self.hpz > 1 else ""
        return (f"{self.engine} {self.dims.describe()}{vpp} zero={self.zero_stage}{sp} "
                f"mb={self.micro_batch} accum={self.grad_accum}")


@dataclass(frozen=True)
class LayerOption:
    """The per-layer part of a plan for one layer."""

    checkpoint: bool
    """Recompute the layer's activations in backward, keeping only its input."""
    shard_params: bool
    """ZeRO-3 only: keep the parameters sharded (gathered per use) rather than resident."""
    split: int
    """Operator-splitting factor for the layer's largest matrix (the head: loss chunks)."""
    recompute_modules: tuple[str, ...] = ()
    """Selective recomputation: the parts of the layer re-run in backward
    (:data:`dsauto.plan.RecomputeModule`); empty for none, and empty when ``checkpoint``."""
