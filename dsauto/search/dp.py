"""The per-stage dynamic program: one option per layer, minimum total time under a memory budget.

A pure function over cost arrays (the shape of Alpa's stage DP and Galvatron's layer DP): for layers
j = 1..n and options o, ``time[j, o]`` adds up, ``memory[j, o]`` (integer units) adds up, and
``transient[j, o]`` (units, not rounded) is a short-lived peak, so a choice is feasible when

    sum_j memory[j, o_j] + max_j transient[j, o_j] <= budget.

The max term is handled exactly by enumerating its value: for each distinct transient value c the
knapsack runs over the options with transient <= c, with budget - c left for the sum (rounded down:
the sum is whole units). Only the memory that adds up comes in whole units (the caller rounds it
up), so a choice whose memory the rounding leaves exact (the planner's smallest options: 0 units)
is found however close its peak is to the budget. The knapsack keeps, for every memory amount m,
the least time of a choice that uses at most m (0/1 knapsack with one item per layer chosen from a
group; Kellerer, Pferschy and Pisinger 2004, Ch. 11, multiple-choice knapsack). Every prefix of the
layers is answered in the same pass, which is what the pipeline layout search needs: the best time
of a stage's first j layers, for every j, under its budget. Two cuts leave the answers as they are:
a cap's knapsack stops after the last prefix that its fastest options (memory aside) could make
faster than the best found under the larger caps, and each row of the knapsack stops at the largest
room of the prefixes that read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

INFEASIBLE = float("inf")


@dataclass(frozen=True)
class PrefixSolution:
    """Best choices for every prefix of a layer sequence. ``best_time[j]`` is for layers 0..j-1."""

    best_time: np.ndarray
    """Shape (n + 1,): least total time of the first j layers, ``inf`` where nothing fits."""
    _cap_index: np.ndarray
    _caps: np.ndarray
    _backpointers: list[np.ndarray]
    _memory: np.ndarray
    _budgets: np.ndarray
    _fastest: np.ndarray | None = None
    """When every prefix fits with each layer at its fastest option: those options (no DP ran)."""

    def choices(self, j: int) -> tuple[int, ...]:
        """The option index of each of the first ``j`` layers in a best choice for that prefix."""
        if not np.isfinite(self.best_time[j]):
            raise ValueError(f"no feasible choice for the first {j} layers")
        if self._fastest is not None:
            return tuple(int(o) for o in self._fastest[:j])
        if j == 0:
            return ()
        k = int(self._cap_index[j])
        back = self._backpointers[k]
        m = math.floor(self._budgets[j] - self._caps[k])
        m = min(m, back.shape[1] - 1)
        picked = []
        for layer in range(j - 1, -1, -1):
            option = int(back[layer, m])
            picked.append(option)
            m -= int(self._memory[layer, option])
        return tuple(reversed(picked))


def solve_prefixes(time: np.ndarray, memory: np.ndarray, transient: np.ndarray,
                   budgets: np.ndarray) -> PrefixSolution:
    """Least-time option per layer for every prefix, prefix j within ``budgets[j]``.

    ``time`` is float (n, k) with ``inf`` marking an option a layer may not take; ``memory`` is
    non-negative integers (n, k), ``transient`` non-negative numbers (n, k); ``budgets`` is an array
    of numbers (n + 1,).
    """
    time = np.asarray(time, dtype=float)
    memory = np.asarray(memory, dtype=np.int64)
    transient = np.asarray(transient, dtype=float)
    budgets = np.asarray(budgets, dtype=float)
    n, k = time.shape
    if memory.shape != (n, k) or transient.shape != (n, k) or budgets.shape != (n + 1,):
        raise ValueError("time, memory and transient must be (n, k) and budgets (n + 1,)")
    if (memory < 0).any() or (transient < 0).any():
        raise ValueError("memory and transient must be non-negative")

    allowed_any = np.isfinite(time)
    fast = _all_fastest_fit(time, memory, transient, budgets)
    if fast is not None:
        return fast
    caps = np.unique(np.concatenate([[0], transient[allowed_any]]))
    best = np.full(n + 1, INFEASIBLE)
    best_cap = np.zeros(n + 1, dtype=np.int64)
    backpointers: list[np.ndarray] = [np.zeros((0, 0), dtype=np.int8)] * len(caps)
    # Beyond the largest possible sum of memory every budget is unconstrained.
    most_memory = int(np.where(allowed_any, memory, 0).max(axis=1).sum()) if n else 0
    # Each layer's allowed options as (index, memory, time, transient), in Python numbers for the
    # inner loop (the same float64 values).
    options = [[(o, w, t, c) for o, (ok, w, t, c) in enumerate(zip(*cells)) if ok]
               for cells in zip(allowed_any.tolist(), memory.tolist(), time.tolist(), transient.tolist())]
    # Least constrained cap first: on equal time the plan keeps the options listed first (the
    # simplest ones) rather than ones that only save memory nobody needs.
    for ci in range(len(caps) - 1, -1, -1):
        cap = caps[ci]
        allowed = allowed_any & (transient <= cap)
        room = np.floor(budgets - cap)  # whole units left for the memory that adds up
        size = int(min(max(room.max(), -1), most_memory)) + 1
        back = np.zeros((n, max(size, 1)), dtype=np.int8 if k < 128 else np.int16)
        backpointers[ci] = back
        if size <= 0:
            continue
        # A prefix takes at least its layers' fastest options under this cap, and a cap keeps only a
        # strictly better time: the DP stops after the last prefix it could still improve.
        fastest = np.where(allowed, time, INFEASIBLE).min(axis=1)
        hopeful = np.flatnonzero((np.concatenate([[0.0], np.cumsum(fastest)]) < best) & (room >= 0))
        if not len(hopeful):
            continue
        # Row j serves prefix j + 1 and the rows after it: no read goes past the largest room of
        # those prefixes, so the rows are cut there.
        reach = np.minimum(np.maximum.accumulate(room[::-1])[::-1], size - 1).astype(np.int64)
        dp = np.zeros(size)  # least time using at most m units, for the empty prefix: 0
        if room[0] >= 0 and best[0] > 0:
            best[0], best_cap[0] = 0.0, ci
        for j in range(hopeful[-1]):
            width = int(reach[j + 1]) + 1
            if width <= 0:
                break  # no longer prefix has any room under this cap
            row = np.full(width, INFEASIBLE)
            arg = back[j, :width]
            for o, w, t, c in options[j]:
                if c > cap or w >= width:
                    continue
                candidate = dp[: width - w] + t
                current = row[w:]
                better = candidate < current  # strict: on ties the earlier option stays
                np.copyto(current, candidate, where=better)
                np.copyto(arg[w:], o, where=better)
            dp = row
            if not np.isfinite(dp[-1]):
                break  # no choice of this prefix fits under this cap; longer ones cannot either
            r = room[j + 1]
            if r >= 0:
                value = dp[min(int(r), size - 1)]
                if value < best[j + 1]:
                    best[j + 1], best_cap[j + 1] = value, ci
    return PrefixSolution(best, best_cap, caps, backpointers, memory, budgets)


def _all_fastest_fit(time: np.ndarray, memory: np.ndarray, transient: np.ndarray,
                     budgets: np.ndarray) -> PrefixSolution | None:
    """The exact answer without a DP when every prefix fits with each layer at its fastest option
    (the common case when memory is not the binding constraint), else None."""
    n = time.shape[0]
    if n == 0 or not np.isfinite(time).any(axis=1).all():
        return None
    fastest = time.argmin(axis=1)  # first index among equal times, as the DP keeps
    rows = np.arange(n)
    used = np.concatenate([[0], np.cumsum(memory[rows, fastest])])
    peak = np.concatenate([[0], np.maximum.accumulate(transient[rows, fastest])])
    if (used + peak > budgets).any():
        return None
    best = np.concatenate([[0.0], np.cumsum(time[rows, fastest])])
    empty = np.zeros(0, dtype=np.int64)
    return PrefixSolution(best, empty, empty, [], memory, budgets, _fastest=fastest)


def solve(time: np.ndarray, memory: np.ndarray, transient: np.ndarray,
          budget: float) -> tuple[float, tuple[int, ...]]:
    """Least total time and the option per layer for all layers within ``budget``."""
    n = np.asarray(time).shape[0]
    solution = solve_prefixes(time, memory, transient, np.full(n + 1, budget, dtype=float))
    value = float(solution.best_time[n])
    return value, (solution.choices(n) if np.isfinite(value) else ())
