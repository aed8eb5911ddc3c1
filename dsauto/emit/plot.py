"""``plan.png``: a picture of a plan, memory per pipeline stage and the 1F1B schedule of one step.

matplotlib is imported inside :func:`plot_plan` only (importing it takes about half a second, and the
CLI stays fast when no picture is drawn). The figure is drawn on its own Agg canvas, without pyplot,
so no global backend or figure registry of the calling process is touched.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

from dsauto.plan import Plan
from dsauto.units import GiB, format_bytes, format_seconds

Op = tuple[str, int, float, float]
"""One operation of a pipeline stage: kind (``"F"`` forward, ``"B"`` backward), micro-batch, start and
end in seconds."""

MAX_DRAWN_OPS = 4000
"""Stages x micro-batches up to which the whole step is drawn; above it only the first micro-batches."""
DRAWN_MICRO_BATCHES = 64
"""Micro-batches drawn when a step has more than :data:`MAX_DRAWN_OPS` operations."""
MAX_LABELS = 3000
"""Most micro-batch numbers written into the boxes (each is a text object, slow to draw)."""

# Memory components, bottom to top, with the StagePrediction field each comes from.
_MEMORY = (
    ("params", "params_bytes", "#4c72b0"),
    ("grads", "grads_bytes", "#55a868"),
    ("optimizer", "optimizer_bytes", "#c44e52"),
    ("activations", "activation_bytes", "#8172b2"),
    ("transient", "transient_bytes", "#ccb974"),
)
_FORWARD_COLOR = "#74a9cf"
_BACKWARD_COLOR = "#fd8d3c"

# Figure geometry in inches (width) and fractions of it; fixed rather than automatic so that box
# widths in pixels are known before drawing, to decide which boxes can hold their number.
_WIDTH_IN, _DPI = 14.0, 110
_LEFT, _RIGHT = 0.065, 0.87
_TOP_IN, _BOTTOM_IN, _GAP_IN = 0.85, 0.55, 0.95
_MEMORY_IN = 3.2
_ROW_IN, _MIN_TIMELINE_IN, _MAX_TIMELINE_IN = 0.3, 1.4, 11.0
_LABEL_FONT = 7


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


def plot_plan(plan: Plan, path: Path | str) -> Path:
    """Draws ``plan`` into the PNG ``path``: memory per stage over the budget, and the 1F1B timeline.

    The top panel stacks each stage's parameters, gradients, optimizer states, activations and
    transient memory (per rank, GiB) under a dashed line at the memory budget. The bottom panel is the
    pipeline schedule of one step simulated by :func:`simulate_1f1b` from the plan's per-stage forward
    and backward times. With more than :data:`MAX_DRAWN_OPS` operations only the time up to the last
    backward of the first :data:`DRAWN_MICRO_BATCHES` micro-batches is drawn, and the title says so.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    rows = plan.pp
    timeline_in = min(max(_ROW_IN * rows + 0.4, _MIN_TIMELINE_IN), _MAX_TIMELINE_IN)
    height_in = _TOP_IN + _MEMORY_IN + _GAP_IN + timeline_in + _BOTTOM_IN
    fig = Figure(figsize=(_WIDTH_IN, height_in), dpi=_DPI)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(
        2, 1, height_ratios=[_MEMORY_IN, timeline_in], left=_LEFT, right=_RIGHT,
        top=1 - _TOP_IN / height_in, bottom=_BOTTOM_IN / height_in,
        hspace=_GAP_IN / ((_MEMORY_IN + timeline_in) / 2),
    )
    _draw_memory(fig.add_subplot(grid[0]), plan)
    _draw_timeline(fig.add_subplot(grid[1]), plan, timeline_in)
    pred = plan.prediction
    sp = ", sequence parallel" if plan.sequence_parallel and plan.tp > 1 else ""
    fig.suptitle(
        f"{plan.model.name} on {plan.nodes} x {plan.gpus_per_node} {plan.hardware}: "
        f"tp={plan.tp} pp={plan.pp} dp={plan.dp}, ZeRO-{plan.zero_stage}{sp}, "
        f"micro-batch {plan.micro_batch} x {plan.grad_accum}\n"
        f"predicted step {format_seconds(pred.step_seconds)}, MFU {pred.mfu:.1%}, "
        f"peak memory {format_bytes(pred.peak_memory_bytes)} per rank",
        x=(_LEFT + _RIGHT) / 2, y=1 - 0.1 / height_in, va="top", fontsize=12,
    )
    fig.savefig(path, format="png")
    return path


def _draw_memory(ax, plan: Plan) -> None:
    from matplotlib.ticker import MaxNLocator

    stages = range(plan.pp)
    # Thin bars without edges when there are many, so that the colours, not the outlines, show.
    width = 0.5 if plan.pp == 1 else 0.8
    edge = 0.5 if plan.pp <= 16 else 0.0
    bottom = [0.0] * plan.pp
    for label, field, color in _MEMORY:
        heights = [getattr(st, field) / GiB for st in plan.stages]
        ax.bar(stages, heights, width, bottom=bottom, color=color, label=label,
               edgecolor="white", linewidth=edge)
        bottom = [b + h for b, h in zip(bottom, heights)]
    budget = plan.memory_budget_bytes / GiB
    ax.axhline(budget, color="black", linestyle="--", linewidth=1.2,
               label=f"budget ({format_bytes(plan.memory_budget_bytes)})")
    ax.set_ylim(0, max(max(bottom), budget) * 1.12)
    ax.set_xlim(-1 if plan.pp == 1 else -0.6, 1 if plan.pp == 1 else plan.pp - 0.4)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=min(plan.pp, 16), integer=True))
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB per rank")
    peak = max(st.peak_bytes for st in plan.stages)
    ax.set_title(f"memory per rank by stage: peak {format_bytes(peak)} of "
                 f"{format_bytes(plan.memory_budget_bytes)} budget ({peak / plan.memory_budget_bytes:.0%})",
                 loc="left", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)


def _draw_timeline(ax, plan: Plan, height_in: float) -> None:
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    pp, m = plan.pp, plan.grad_accum
    forward = [st.forward_seconds for st in plan.stages]
    backward = [st.backward_seconds for st in plan.stages]
    capped = m * pp > MAX_DRAWN_OPS and m > DRAWN_MICRO_BATCHES
    if capped:
        # The first DRAWN_MICRO_BATCHES backwards on every stage, and everything before them, are
        # the same in a step of any m >= DRAWN_MICRO_BATCHES + pp micro-batches: no stage has reached
        # its cool-down yet. Simulating that many keeps the cost independent of m.
        ops = simulate_1f1b(forward, backward, min(m, DRAWN_MICRO_BATCHES + pp))
        horizon = next(end for kind, j, _, end in ops[0] if kind == "B" and j == DRAWN_MICRO_BATCHES - 1)
        ops = [[op for op in stage if op[2] < horizon] for stage in ops]
    else:
        ops = simulate_1f1b(forward, backward, m)
        horizon = max(stage[-1][3] for stage in ops)
    scale, unit = (1e3, "ms") if horizon < 1 else (1.0, "s")

    # Boxes: one broken_barh per stage and kind; stage 0 on top.
    widths_px = []
    px_per_unit = _WIDTH_IN * (_RIGHT - _LEFT) * _DPI / (horizon * scale)
    for kind, color in (("F", _FORWARD_COLOR), ("B", _BACKWARD_COLOR)):
        spans = [[(s * scale, (e - s) * scale) for k, _, s, e in stage if k == kind] for stage in ops]
        widths_px += [w * px_per_unit for stage in spans for _, w in stage]
        thin = sorted(widths_px)[len(widths_px) // 2] < 4 if widths_px else True
        for i, stage in enumerate(spans):
            ax.broken_barh(stage, (i - 0.4, 0.8), facecolors=color, edgecolor="white",
                           linewidth=0.0 if thin else 0.5)

    # Micro-batch numbers where a box is wide and tall enough to hold one.
    row_px = (height_in - 0.4) * _DPI / pp * 0.8
    if row_px >= _LABEL_FONT * 1.4:
        labels = [(i, j, s, e) for i, stage in enumerate(ops) for _, j, s, e in stage
                  if (e - s) * scale * px_per_unit >= 0.62 * _LABEL_FONT * len(str(j)) + 4]
        for i, j, s, e in labels[:MAX_LABELS]:
            ax.text((s + e) / 2 * scale, i, str(j), ha="center", va="center", fontsize=_LABEL_FONT)

    ax.set_xlim(0, horizon * scale)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=min(pp, 16), integer=True))
    ax.set_ylabel("pipeline stage")
    ax.set_xlabel(f"time in the step ({unit})")
    if capped:
        title = (f"1F1B schedule: the first {DRAWN_MICRO_BATCHES} of {m} micro-batches shown "
                 f"(up to stage 0's backward of micro-batch {DRAWN_MICRO_BATCHES - 1})")
    else:
        busy = sum(e - s for stage in ops for _, _, s, e in stage)
        title = (f"1F1B schedule of one step, {m} micro-batch{'es' if m > 1 else ''}: "
                 f"pipeline {format_seconds(horizon)}")
        if pp > 1:
            title += f", stages idle {1 - busy / (pp * horizon):.0%} of it (fill and drain)"
    ax.set_title(title + " (numbers: micro-batch)" if row_px >= _LABEL_FONT * 1.4 else title,
                 loc="left", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(handles=[Patch(color=_FORWARD_COLOR, label="forward"),
                       Patch(color=_BACKWARD_COLOR, label="backward")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
