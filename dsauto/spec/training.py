"""The training workload: batch, sequence length, precision and the attention kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Dtype = Literal["bf16", "fp16", "fp32"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class TrainSpec:
    """What one optimizer step processes and how."""

    global_batch: int
    """Sequences per optimizer step, over all data-parallel ranks and accumulation steps."""
    seq_len: int
    """Tokens per sequence."""
    dtype: Dtype = "bf16"
    """Compute and activation dtype; parameters keep an fp32 master copy in the optimizer
    (mixed precision, Micikevicius et al. 2018) unless the dtype is fp32."""
    flash_attention: bool = True
    """Fused attention that keeps no s×s score matrix (Dao et al. 2022); otherwise eager attention."""

    def __post_init__(self) -> None:
        if self.global_batch <= 0:
            raise ValueError(f"global_batch must be positive, got {self.global_batch}")
        if self.seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {self.seq_len}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]
