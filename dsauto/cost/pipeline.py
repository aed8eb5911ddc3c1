"""The 1F1B pipeline schedule (PipeDream-Flush) and Megatron-core's interleaved one, simulated
operation by operation.

The cost model's stage times go in; the step's pipeline time comes out, exactly for the schedule
(Narayanan et al. 2021, Sec. 2.2), including unequal stages, where the closed form
sum_i t_i + (m - 1) * max_i t_i is only an upper estimate. The layout search uses that closed form
as its fast objective; predictions use these simulations, and plan.png draws them.
"""

from __future__ import annotations

from collections import deque

Op = tuple[str, int, float, float]
"""One operation: kind ('F' forward or 'B' backward), micro-batch, start and end seconds."""
ChunkOp = tuple[str, int, int, float, float]
"""One operation of the interleaved schedule: kind, micro-batch, model chunk (0..v-1), start and end
seconds."""


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


def interleaved_order(stage: int, stages: int, micro_batches: int, virtual_stages: int,
                      extra_warmup: int = 0) -> list[tuple[str, int, int]]:
    """The order in which pipeline rank ``stage`` of ``stages`` runs its (kind, micro-batch, chunk)
    operations under Megatron-core's interleaved schedule, micro-batches a multiple of ``stages``
    (megatron/core/pipeline_parallel/schedules.py: ``get_schedule_table`` with
    ``microbatch_group_size_per_vp_stage`` pp, Megatron-LM's default; ``get_pp_rank_microbatches``;
    ``forward_backward_pipelining_with_interleaving``). Forwards run in groups of pp micro-batches
    through each chunk in turn, backwards in the same table with the chunks reversed; a rank runs
    (pp - stage - 1) * 2 + (v - 1) * pp warm-up forwards, ``extra_warmup`` more (one under
    ``--overlap-moe-expert-parallel-comm``, whose paired steps need it; all of them where that is as
    many), then a forward and a backward in turn, then the remaining backwards."""
    if micro_batches % stages:
        raise ValueError(f"the interleaved schedule needs micro-batches a multiple of the {stages} stages, "
                         f"got {micro_batches}")
    table = [(j, c) for group in range(0, micro_batches, stages) for c in range(virtual_stages)
             for j in range(group, group + stages)]
    total = len(table)
    warmup = min((stages - stage - 1) * 2 + (virtual_stages - 1) * stages + extra_warmup, total)
    forwards = [("F", j, c) for j, c in table]
    backwards = [("B", j, virtual_stages - 1 - c) for j, c in table]
    order = forwards[:warmup]
    for k in range(total - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[total - warmup:]


def simulate_interleaved(forward: list[list[float]], backward: list[list[float]], micro_batches: int,
                         extra_warmup: int = 0) -> list[list[ChunkOp]]:
    """Simulates one step of Megatron-core's interleaved schedule; returns per pipeline rank its
    operations in execution order. ``forward[i][c]`` and ``backward[i][c]`` are rank i's times for
    one micro-batch through its model chunk c. Each rank runs :func:`interleaved_order`; an operation
    starts when its rank is free and its input is ready: a chunk's forward after the same chunk's
    forward on the rank before, rank 0's chunk c after chunk c - 1 on the last rank; backwards the
    other way, the last rank's backward of the last chunk after its own forward of it. Transfers
    take no time here (the cost model prices them apart). ``extra_warmup``: as :func:`interleaved_order`'s."""
    orders, slots, ends = _interleaved_ends(forward, backward, micro_batches, extra_warmup)
    return [[(kind, j, c, ends[k] - (forward[i][c] if kind == "F" else backward[i][c]), ends[k])
             for (kind, j, c), k in zip(order, slot)] for i, (order, slot) in enumerate(zip(orders, slots))]


def interleaved_pipeline_seconds(forward: list[list[float]], backward: list[list[float]], micro_batches: int,
                                 extra_warmup: int = 0) -> float:
    """Time from the first forward to the last backward of one step of the interleaved schedule
    (:func:`simulate_interleaved`)."""
    _, slots, ends = _interleaved_ends(forward, backward, micro_batches, extra_warmup)
    return max(ends[slot[-1]] for slot in slots)


def _interleaved_ends(forward: list[list[float]], backward: list[list[float]], micro_batches: int,
                      extra_warmup: int = 0) -> tuple[list[list[tuple[str, int, int]]], list[list[int]], list[float]]:
    """Each rank's :func:`interleaved_order`, the slot of each of its operations, and the end of the
    operation in each slot.
    Event-driven as :func:`simulate_1f1b`, over flat arrays: every prediction of an interleaved plan
    runs it, O(pp x v x m) operations."""
    stages = len(forward)
    chunks = len(forward[0]) if stages else 0
    if stages < 1 or len(backward) != stages or any(len(t) != chunks for t in (*forward, *backward)):
        raise ValueError("need forward and backward times for every chunk of every stage")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
    if min(min(t) for t in (*forward, *backward)) < 0:
        raise ValueError("chunk times must not be negative")
    m, last, v = micro_batches, stages - 1, chunks
    # One slot per operation of the step: forward j of rank i's chunk c at (i * v + c) * m + j, its
    # backward (stages + i) * v * m further on.
    backward_base = stages * v * m
    orders = [interleaved_order(i, stages, m, v, extra_warmup) for i in range(stages)]
    slots, waits_on, takes = [], [], []
    for i, order in enumerate(orders):
        slot, wait, take = [], [], []
        for kind, j, c in order:
            if kind == "F":
                slot.append((i * v + c) * m + j)
                wait.append(((i - 1) * v + c) * m + j if i > 0 else (last * v + c - 1) * m + j if c > 0 else -1)
                take.append(forward[i][c])
            else:
                slot.append(backward_base + (i * v + c) * m + j)
                wait.append(backward_base + ((i + 1) * v + c) * m + j if i < last
                            else backward_base + (c + 1) * m + j if c < v - 1 else (i * v + c) * m + j)
                take.append(backward[i][c])
        slots.append(slot)
        waits_on.append(wait)
        takes.append(take)
    ends = [-1.0] * (2 * backward_base)
    done, free = [0] * stages, [0.0] * stages
    woken = deque(range(stages))
    while woken:
        i = woken.popleft()
        p, clock, slot, wait, take = done[i], free[i], slots[i], waits_on[i], takes[i]
        size = len(slot)
        while p < size:
            if wait[p] >= 0:
                ready = ends[wait[p]]
                if ready < 0:
                    break  # woken again when the operation it waits on ends
                if ready > clock:
                    clock = ready
            clock += take[p]
            ends[slot[p]] = clock
            p += 1
        if p > done[i]:
            done[i], free[i] = p, clock
            woken.extend(((i + 1) % stages, (i - 1) % stages))
    if any(p != len(slot) for p, slot in zip(done, slots)):
        raise RuntimeError("the interleaved simulation stalled")
    return orders, slots, ends

