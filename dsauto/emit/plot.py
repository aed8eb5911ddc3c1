"""``plan.png``: a picture of a plan, memory per pipeline stage and the pipeline schedule of one step
(1F1B, or Megatron-core's interleaved schedule for a plan with virtual stages).

matplotlib is imported inside :func:`plot_plan` only (importing it takes about half a second, and the
CLI stays fast when no picture is drawn). The figure is drawn on its own Agg canvas, without pyplot,
so no global backend or figure registry of the calling process is touched.
"""

from __future__ import annotations

from pathlib import Path

from dsauto.cost.pipeline import ChunkOp, simulate_1f1b, simulate_interleaved
from dsauto.describe import mfu_basis
from dsauto.plan import Plan
from dsauto.units import GiB, format_bytes, format_seconds

MAX_DRAWN_OPS = 4000
"""Stages x micro-batches x chunks up to which the whole step is drawn; above it only the first
micro-batches."""
DRAWN_MICRO_BATCHES = 64
"""Micro-batches drawn when a step has more than :data:`MAX_DRAWN_OPS` operations."""
MAX_LABELS = 3000
"""Most micro-batch numbers written into the boxes (each is a text object, slow to draw); with more,
none are written."""

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
_CHUNK_COLORS = {"F": ("#74a9cf", "#2b8cbe"), "B": ("#fd8d3c", "#d94701")}
"""Interleaved schedules: a kind's boxes alternate between these two shades, chunk by chunk."""

# Figure geometry in inches (width) and fractions of it; fixed rather than automatic so that box
# widths in pixels are known before drawing, to decide which boxes can hold their number.
_WIDTH_IN, DPI = 14.0, 110
_LEFT, _RIGHT = 0.065, 0.87
_TOP_IN, _BOTTOM_IN, _GAP_IN = 0.85, 0.55, 0.95
_MEMORY_IN = 3.2
_ROW_IN, _MIN_TIMELINE_IN, _MAX_TIMELINE_IN = 0.3, 1.4, 11.0
_LABEL_FONT = 7


def plot_plan(plan: Plan, path: Path | str) -> Path:
    """Draws ``plan`` into the PNG ``path``: memory per stage over the budget, and the pipeline's
    timeline.

    The top panel stacks each stage's parameters, gradients, optimizer states, activations and
    transient memory (per rank, GiB) under a dashed line at the memory budget. The bottom panel is the
    pipeline schedule of one step simulated from the plan's per-stage forward and backward times: by
    :func:`simulate_1f1b`, or by :func:`simulate_interleaved` for a plan with virtual stages from
    its chunks' times, as the prediction simulates it (a plan written without them: each rank's
    times split over its chunks by their transformer layers). With more
    than :data:`MAX_DRAWN_OPS` operations only the time up to stage 0's last backward of the first
    :data:`DRAWN_MICRO_BATCHES` micro-batches is drawn, and the title says so.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    rows = plan.pp
    timeline_in = min(max(_ROW_IN * rows + 0.4, _MIN_TIMELINE_IN), _MAX_TIMELINE_IN)
    height_in = _TOP_IN + _MEMORY_IN + _GAP_IN + timeline_in + _BOTTOM_IN
    fig = Figure(figsize=(_WIDTH_IN, height_in), dpi=DPI)
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
        f"{plan.dims.describe()}{f' vpp={plan.virtual_stages}' if plan.virtual_stages > 1 else ''}, "
        f"ZeRO-{plan.zero_stage}{sp}, "
        f"micro-batch {plan.micro_batch} x {plan.grad_accum}\n"
        f"predicted step {format_seconds(pred.step_seconds)}, MFU {pred.mfu:.1%}{mfu_basis(plan)}, "
        f"peak memory {format_bytes(pred.peak_memory_bytes)} per rank",
        x=(_LEFT + _RIGHT) / 2, y=1 - 0.1 / height_in, va="top", fontsize=12,
    )
    fig.savefig(path, format="png")
    return path


def _stage_ticks(stages: int) -> range:
    """Every stage up to 16 stages; beyond, about 16 evenly spaced ones, so that labels never overlap."""
    return range(0, stages, -(-stages // 16))


def _draw_memory(ax, plan: Plan) -> None:
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
    ax.set_xticks(_stage_ticks(plan.pp))
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

    pp, m, v = plan.pp, plan.grad_accum, plan.virtual_stages
    ops, horizon, capped, split = _schedule(plan)
    horizon = max(horizon, 1e-9)  # a plan of zero-time stages still gets an axis
    scale, unit = (1e3, "ms") if horizon < 1 else (1.0, "s")

    # Boxes: one broken_barh per stage and kind; stage 0 on top. White outlines separate wide boxes;
    # on narrow ones they would hide the colour.
    px_per_unit = _WIDTH_IN * (_RIGHT - _LEFT) * DPI / (horizon * scale)
    widths = sorted((e - s) * scale for stage in ops for _, _, _, s, e in stage)
    outline = 0.5 if widths[len(widths) // 2] * px_per_unit >= 4 else 0.0
    for kind in "FB":
        for shade in range(2 if v > 1 else 1):
            color = _CHUNK_COLORS[kind][shade] if v > 1 else (_FORWARD_COLOR if kind == "F" else _BACKWARD_COLOR)
            for i, stage in enumerate(ops):
                spans = [(s * scale, (e - s) * scale) for k, _, c, s, e in stage if k == kind and c % 2 == shade]
                ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=color, edgecolor="white", linewidth=outline)

    # Micro-batch numbers, for each kind of box only if every box of that kind can hold the longest
    # number: a few labelled boxes among unlabelled ones of the same size read as a pattern.
    labels = []
    font_px = _LABEL_FONT * DPI / 72
    if height_in * DPI / pp * 0.8 >= 1.3 * font_px:
        for kind in "FB":
            drawn = [(i, j, s, e) for i, stage in enumerate(ops) for k, j, _, s, e in stage if k == kind]
            digits = len(str(max(j for _, j, _, _ in drawn)))
            if min(e - s for _, _, s, e in drawn) * scale * px_per_unit >= 0.6 * font_px * digits + 3:
                labels += drawn
    if len(labels) > MAX_LABELS:
        labels = []
    for i, j, s, e in labels:
        ax.text((s + e) / 2 * scale, i, str(j), ha="center", va="center", fontsize=_LABEL_FONT)

    ax.set_xlim(0, horizon * scale)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(_stage_ticks(pp))
    ax.set_ylabel("pipeline stage")
    ax.set_xlabel(f"time in the step ({unit})")
    schedule = f"interleaved 1F1B schedule, {v} chunks per rank" if v > 1 else "1F1B schedule"
    if split:
        schedule += " (chunk times split by layers)"
    if capped:
        title = (f"{schedule}: the first {DRAWN_MICRO_BATCHES} of {m} micro-batches shown "
                 f"(up to stage 0's backward of micro-batch {DRAWN_MICRO_BATCHES - 1})")
    else:
        busy = sum(e - s for stage in ops for _, _, _, s, e in stage)
        title = (f"{schedule} of one step, {m} micro-batch{'es' if m > 1 else ''}: "
                 f"pipeline {format_seconds(horizon)}")
        if pp > 1:
            # Idle time is fill and drain, plus waiting on slower neighbours when stages are uneven.
            title += f", stages idle {1 - busy / (pp * horizon):.0%} of it"
    ax.set_title(title + ("; numbers are micro-batches" if labels else ""), loc="left", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    if v > 1:
        handles = [Patch(color=_CHUNK_COLORS[kind][shade], label=f"{name}, {chunks} chunk")
                   for kind, name in (("F", "fwd"), ("B", "bwd"))
                   for shade, chunks in ((0, "even"), (1, "odd"))]
    else:
        handles = [Patch(color=_FORWARD_COLOR, label="forward"), Patch(color=_BACKWARD_COLOR, label="backward")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)


def _schedule(plan: Plan) -> tuple[list[list[ChunkOp]], float, bool, bool]:
    """The operations drawn of each rank (kind, micro-batch, chunk, start, end), the time they span,
    whether only the first :data:`DRAWN_MICRO_BATCHES` micro-batches are drawn, and whether a rank's
    chunk times were split from its stage's by their layers (a plan written without them). A step of more
    micro-batches is simulated only as far as needed: the first of them, and everything before
    stage 0's backward of the last one drawn, are the same in a step of any length once no rank has
    reached its cool-down by then (1F1B: DRAWN_MICRO_BATCHES + pp micro-batches; interleaved, whose
    warm-up is up to (v + 1) pp passes long: that rounded up to whole groups of pp, plus 4 pp)."""
    pp, m, v = plan.pp, plan.grad_accum, plan.virtual_stages
    capped = m * pp * v > MAX_DRAWN_OPS and m > DRAWN_MICRO_BATCHES
    if v > 1:
        chunk_forward, chunk_backward, split = [], [], False
        counts = plan.chunks()
        for rank, st in enumerate(plan.stages):
            if len(st.chunk_forward_seconds) == len(st.chunk_backward_seconds) == v:
                chunk_forward.append(list(st.chunk_forward_seconds))
                chunk_backward.append(list(st.chunk_backward_seconds))
                continue
            split = True  # a plan written without its chunks' times: the rank's, split by its chunks' layers
            layers = [counts[c * pp + rank] for c in range(v)]
            share = [n / sum(layers) for n in layers] if sum(layers) else [1 / v] * v
            chunk_forward.append([st.forward_seconds * w for w in share])
            chunk_backward.append([st.backward_seconds * w for w in share])
        simulated = pp * (-(-DRAWN_MICRO_BATCHES // pp) + 4) if capped else m
        ops = simulate_interleaved(chunk_forward, chunk_backward, min(m, simulated), int(plan.expert_a2a_overlap))
    else:
        simulated, split = DRAWN_MICRO_BATCHES + pp if capped else m, False
        ops = [[(kind, j, 0, start, end) for kind, j, start, end in stage]
               for stage in simulate_1f1b([st.forward_seconds for st in plan.stages],
                                          [st.backward_seconds for st in plan.stages], min(m, simulated))]
    if not capped:
        return ops, max(stage[-1][4] for stage in ops), False, split
    horizon = next(end for kind, j, c, _, end in ops[0] if kind == "B" and j == DRAWN_MICRO_BATCHES - 1 and c == 0)
    return [[op for op in stage if op[3] < horizon] for stage in ops], horizon, True, split
