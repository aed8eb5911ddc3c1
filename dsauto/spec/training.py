"""The training workload: batch, sequence length, precision and the attention kernel."""

from __future__ import annotations

import numbers

from dataclasses import dataclass, field
from typing import Literal

from dsauto.spec.limits import MAX_GLOBAL_BATCH, MAX_POSITIONS

Dtype = Literal["bf16", "fp16", "fp32"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class TrainSpec:
    """What one optimizer step processes and how.

    Each field's ``metadata`` is the command-line option that sets it (the keys are described on
    :class:`dsauto.search.space.Constraints`); ``dsauto.cli`` builds its options from these fields.
    """

    global_batch: int = field(metadata={"flag": "--global-batch", "help": "sequences per optimizer step"})
    """Sequences per optimizer step, over all data-parallel ranks and accumulation steps."""
    seq_len: int = field(metadata={"flag": "--seq-len", "help": "tokens per sequence"})
    """Tokens per sequence."""
    dtype: Dtype = field(default="bf16", metadata={"flag": "--dtype", "help": "training dtype"})
    """Compute and activation dtype; parameters keep an fp32 master copy in the optimizer
    (mixed precision, Micikevicius et al. 2018) unless the dtype is fp32."""
    flash_attention: bool = field(default=True, metadata={
        "flag": "--no-flash-attention", "const": False,
        "help": "price eager attention, which keeps the s x s scores"})
    """Fused attention that keeps no s×s score matrix (Dao et al. 2022); otherwise eager attention."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ValueError(f"{name} must be a whole number, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy's integers, as Python's
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if not isinstance(self.flash_attention, bool):
            raise ValueError(f"flash_attention must be True or False, got {self.flash_attention!r}")
        if not 0 < self.global_batch <= MAX_GLOBAL_BATCH:
            raise ValueError(f"global_batch must be from 1 to {MAX_GLOBAL_BATCH}, got {self.global_batch}")
        if not 0 < self.seq_len <= MAX_POSITIONS:
            raise ValueError(f"seq_len must be from 1 to {MAX_POSITIONS}, got {self.seq_len}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]
