"""Synthetic token data that a small model learns in a few steps, for examples, tests and benchmarks.

Each sequence cycles through one of a few fixed random patterns of distinct tokens, from a random
phase: after a handful of steps a model predicts the next token from the current one, so the loss
falls well below ``ln(vocab)``. Batches are a pure function of (seed, step, rank): the same seed
gives the same data on every run, and each data-parallel rank gets its own batch.
"""

from __future__ import annotations

import torch

PATTERNS = 8
"""Number of distinct patterns."""
PERIOD = 16
"""Tokens per pattern (all distinct, so the next token follows from the current one)."""


def synthetic_batch(vocab_size: int, micro_batch: int, seq_len: int, step: int, rank: int = 0,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, labels)`` of shape (micro_batch, seq_len): labels are the tokens shifted by one."""
    patterns = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    patterns = patterns[: PATTERNS * PERIOD].view(PATTERNS, PERIOD)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank + 1)
    which = torch.randint(0, PATTERNS, (micro_batch,), generator=g)
    phase = torch.randint(0, PERIOD, (micro_batch, 1), generator=g)
    positions = (phase + torch.arange(seq_len + 1)) % PERIOD
    sequences = patterns[which].gather(1, positions)
    return sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous()
