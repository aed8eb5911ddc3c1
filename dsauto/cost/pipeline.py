"""The 1F1B pipeline schedule (PipeDream-Flush), simulated operation by operation.

The cost model's stage times go in; the step's pipeline time comes out, exactly for the schedule
(Narayanan et al. 2021, Sec. 2.2), including unequal stages, where the closed form
sum_i t_i + (m - 1) * max_i t_i is only an upper estimate. The layout search uses that closed form
as its fast objective; predictions use this simulation.
"""

from __future__ import annotations

from collections import deque

Op = tuple[str, int, float, float]
"""One operation: kind ('F' forward or 'B' backward), micro-batch, start and end seconds."""


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order in which stage ``stage`` of ``stages`` runs its operations under 1F1B.

    PipeDream-Flush (Narayanan et al. 2021, Sec. 2.2): min(stages - stage, micro_batches) warm-up
    forwards, then one backward and one forward in turn, then the remaining backwards (cool-down).
    """
    warmup = min(stages - stage, micro_batches)
    order = [("F", j) for j in range(warmup)]
    for j in range(micro_batches - warmup):
        order += [("B", j), ("F", warmup + j)]
    order += [("B", j) for j in range(micro_batches - warmup, micro_batches)]
    return order


def simulate_1f1b(forward: list[float], backward: list[float], micro_batches: int) -> list[list[Op]]:
    """Simulates one step of a 1F1B pipeline; returns per stage its operations in execution order.

    ``forward[i]`` and ``backward[i]`` are stage i's times for one micro-batch. Each stage runs its
    operations in :func:`one_f_one_b_order`; an operation starts when its stage is free and its input
    is ready: forward j on stage i after forward j on stage i - 1, backward j on stage i after backward
    j on stage i + 1 (on the last stage, after its own forward j). The simulation is event-driven: the
    end of an operation wakes the one stage that may wait on it, so it costs O(stages x micro_batches).
    """
    stages = len(forward)
    if stages < 1 or len(backward) != stages:
        raise ValueError(f"need one forward and one backward time per stage, got {len(forward)} "
                         f"forward and {len(backward)} backward times")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
    if min(forward) < 0 or min(backward) < 0:
        raise ValueError("stage times must not be negative")
    orders = [one_f_one_b_order(i, stages, micro_batches) for i in range(stages)]
    ends: dict[tuple[str, int, int], float] = {}
    ops: list[list[Op]] = [[] for _ in range(stages)]
    free = [0.0] * stages
    woken = deque(range(stages))
    while woken:
        i = woken.popleft()
        while len(ops[i]) < len(orders[i]):
            kind, j = orders[i][len(ops[i])]
            if kind == "F":
                dependency = ("F", i - 1, j) if i > 0 else None
            else:
                dependency = ("B", i + 1, j) if i < stages - 1 else ("F", i, j)
            if dependency is not None and dependency not in ends:
                break  # woken again when the dependency ends
            start = max(free[i], ends[dependency] if dependency is not None else 0.0)
            end = start + (forward[i] if kind == "F" else backward[i])
            ends[(kind, i, j)] = free[i] = end
            ops[i].append((kind, j, start, end))
            if kind == "F" and i + 1 < stages:
                woken.append(i + 1)
            elif kind == "B" and i > 0:
                woken.append(i - 1)
    if any(len(done) != len(order) for done, order in zip(ops, orders)):  # 1F1B cannot deadlock
        raise RuntimeError("the 1F1B simulation stalled")
    return ops


def pipeline_seconds(forward: list[float], backward: list[float], micro_batches: int) -> float:
    """Time from the first forward to the last backward of one 1F1B step."""
    if len(forward) == 1:
        return micro_batches * (forward[0] + backward[0])
    return max(ops[-1][3] for ops in simulate_1f1b(forward, backward, micro_batches))
