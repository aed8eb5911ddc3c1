"""Fits the device constants of one GPU generation to published training runs, and writes the presets.

The constants (``Constants``) are the few numbers of a hardware preset that say how close real
kernels and collectives get to the datasheet:

- ``matmul_efficiency`` and ``matmul_half_dim``: GEMMs reach ``efficiency * d / (d + half_dim)`` of
  peak FLOP/s, ``d`` their smallest dimension (the hidden size over TP, or the tokens);
- ``memory_bandwidth_efficiency``: bandwidth-bound kernels (norms, activations, softmax, optimizer);
- ``attention_efficiency``: the fused (flash) attention kernel, its backward counted at 2.5x;
- ``fused_attention_efficiency``: cuDNN's fused attention (Transformer Engine's FusedAttention) on
  Hopper, counted the same way; fitted only where runs ran it (Strategy.attention_kernel);
- ``fp8_matmul_efficiency``: the linear layers' FP8 GEMMs (Transformer Engine) on Hopper, as a
  fraction of the FP8 peak; fitted apart, on the FP8 runs only, with the others held (:func:`fit_fp8`);
- ``comm_overlap_efficiency``: how much of overlapped communication hides;
- ``inter_node_efficiency``: the fraction of the NICs' bandwidth collectives across nodes reach.

The fit minimises the error of the predicted step time of each run (its configuration pinned, see
benchmarks/fidelity.py) in log space with a soft-L1 loss (robust to the odd outlier), each run
weighted by one over the number of runs of its source on that device, so that every source counts
as much as any other however many rows it published (MosaicML's llm-foundry tables alone hold 149);
runs whose step time is set by a cost dsauto knows it does not price weigh nothing (benchmarks/
fidelity.py, Source.fitted: DeepSpeed's ZeRO-3 of 2021).
A100 40GB and 80GB share the A100 constants (one chip; each keeps its own memory bandwidth); the
H100 constants also price the H200 (the same compute, its own memory bandwidth).

Run: python benchmarks/fit_device.py            (prints the fit)
     python benchmarks/fit_device.py --write    (also writes templates/hardware/*.yaml)
Needs scipy (pip install scipy) for the least-squares solver.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsauto.cost.step import predict_step
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.spec.cluster import ClusterSpec, HardwareSpec
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec

TEMPLATES = Path(__file__).resolve().parent.parent / "templates" / "hardware"

DEVICES = {"a100": ("a100-40gb", "a100-80gb"), "h100": ("h100-80gb", "h200")}
"""Device generation -> the presets its constants go into (the runs are on the first ones but H200)."""


@dataclass(frozen=True)
class Constants:
    """The fitted constants of one device generation (see the module docstring)."""

    matmul_efficiency: float
    matmul_half_dim: float
    memory_bandwidth_efficiency: float
    attention_efficiency: float
    comm_overlap_efficiency: float
    inter_node_efficiency: float
    fused_attention_efficiency: float | None = None
    """None: not fitted (no run of the device ran cuDNN's fused attention)."""
    fp8_matmul_efficiency: float | None = None
    """None: not fitted (no FP8 run of the device)."""

    @classmethod
    def of(cls, hardware: HardwareSpec) -> Constants:
        d = hardware.device
        return cls(d.matmul_efficiency, d.matmul_half_dim, d.memory_bandwidth_efficiency,
                   d.attention_efficiency, d.comm_overlap_efficiency, hardware.inter_node.efficiency,
                   d.fused_attention_efficiency, d.fp8_matmul_efficiency)

    @classmethod
    def generic(cls, hardware: HardwareSpec) -> Constants:
        """The fit's first start, the same for every device: the first of STARTS, and the
        preset's inter-node efficiency (which the fit keeps)."""
        return cls(**STARTS[0], inter_node_efficiency=hardware.inter_node.efficiency)

    def apply(self, hardware: HardwareSpec) -> HardwareSpec:
        device = dataclasses.replace(
            hardware.device, matmul_efficiency=self.matmul_efficiency, matmul_half_dim=self.matmul_half_dim,
            memory_bandwidth_efficiency=self.memory_bandwidth_efficiency,
            attention_efficiency=self.attention_efficiency, comm_overlap_efficiency=self.comm_overlap_efficiency,
            fused_attention_efficiency=self.fused_attention_efficiency,
            fp8_matmul_efficiency=self.fp8_matmul_efficiency)
        inter = dataclasses.replace(hardware.inter_node, efficiency=self.inter_node_efficiency)
        return dataclasses.replace(hardware, device=device, inter_node=inter)

    def vector(self) -> list[float | None]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def describe(self) -> str:
        return " ".join(f"{f.name}={_round(getattr(self, f.name))}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) is not None)


BOUNDS = Constants(matmul_efficiency=(0.3, 1.0), matmul_half_dim=(0.0, 2048.0),  # type: ignore[arg-type]
                   memory_bandwidth_efficiency=(0.5, 0.95), attention_efficiency=(0.1, 1.0),
                   comm_overlap_efficiency=(0.5, 1.0), inter_node_efficiency=(0.05, 1.0),
                   fused_attention_efficiency=(0.1, 1.0), fp8_matmul_efficiency=(0.3, 1.0))
"""Physical range of each constant. Fractions of a peak stay below 1; bandwidth-bound kernels over
tensors of a layer's size reach at least half the datasheet bandwidth and no streaming kernel all
of it; overlapped collectives slow the GEMMs under them by 10-30% (Pati et al. 2024, "T3", Sec.
2.3), so at most about half of them shows. Without these floors the fit uses the two constants to
absorb costs the roofline does not price (per-kernel overheads, the slow small micro-batches of
some FSDP runs), which would then misprice every optimizer step and overlap the planner weighs."""


@dataclass(frozen=True)
class Candidate:
    """One way the planner may run a published configuration (a micro-batch or pipeline split it
    chose or could choose), with its per-layer options fixed."""

    strategy: Strategy
    stage_layers: tuple[int, ...]
    options: tuple[LayerOption, ...]


@dataclass(frozen=True)
class Case:
    """A published run as the fit sees it: what to price and the published step time."""

    run_id: str
    group: str
    """Runs of one model from one source share a group: cross-validation holds them out together."""
    weight: float
    model: ModelSpec
    train: TrainSpec
    hardware: HardwareSpec
    nodes: int
    gpus_per_node: int
    candidates: tuple[Candidate, ...]
    published_seconds: float

    def seconds(self, constants: Constants) -> float:
        """The predicted step time under ``constants``: the fastest of the candidates, as the
        planner picks among them (memory is independent of the constants)."""
        cluster = ClusterSpec(constants.apply(self.hardware), nodes=self.nodes, gpus_per_node=self.gpus_per_node,
                              memory_limit_bytes=2**50)
        return min(predict_step(self.model, cluster, self.train, c.strategy, c.stage_layers, c.options)
                   .prediction.step_seconds for c in self.candidates)

    def log_error(self, constants: Constants) -> float:
        return math.log(self.seconds(constants) / self.published_seconds)


STARTS = (
    dict(matmul_efficiency=0.8, matmul_half_dim=32.0, memory_bandwidth_efficiency=0.6, attention_efficiency=0.5,
         comm_overlap_efficiency=0.8),
    dict(matmul_efficiency=0.7, matmul_half_dim=128.0, memory_bandwidth_efficiency=0.4, attention_efficiency=0.3,
         comm_overlap_efficiency=0.2),
)
"""Starting points of the fit, spread over the physical range; the first is dsauto's generic
DeviceSpec defaults (with a middling attention efficiency)."""

FREE = ("matmul_efficiency", "matmul_half_dim", "memory_bandwidth_efficiency", "attention_efficiency",
        "comm_overlap_efficiency")
"""The constants the fit moves; the others keep their preset values."""

FUSED = "fused_attention_efficiency"
"""Moved too where some of the cases ran cuDNN's fused attention (:func:`free_constants`)."""


def runs_cudnn(cases: Sequence[Case]) -> bool:
    """Whether some case can run cuDNN's fused attention (Strategy.attention_kernel)."""
    return any(c.strategy.attention_kernel == "cudnn" for case in cases for c in case.candidates)


def free_constants(cases: Sequence[Case]) -> tuple[str, ...]:
    """FREE, and the cuDNN attention efficiency where a case can run that kernel: a constant no
    case prices is not fitted (it would keep an arbitrary start)."""
    return (*FREE, FUSED) if runs_cudnn(cases) else FREE


def fit(cases: Sequence[Case], start: Constants, say: Callable[[str], None] = lambda _: None,
        free: Sequence[str] | None = None, starts: Sequence[dict[str, float]] = STARTS) -> Constants:
    """The constants that minimise the weighted soft-L1 of the log errors of ``cases``, moving
    ``free`` (default :func:`free_constants`) from ``start`` and from each of ``starts``. The
    cuDNN attention efficiency, when no case runs that kernel, is dropped (None: it is then priced
    at ``attention_efficiency``), and when free starts from ``attention_efficiency`` where ``start``
    has none."""
    try:
        from scipy.optimize import least_squares
    except ImportError as e:  # a benchmark-only dependency
        raise SystemExit("benchmarks/fit_device.py needs scipy for its least-squares fit: pip install scipy") from e
    cases = [c for c in cases if c.weight > 0]  # a run not fitted on (fidelity.Source.fitted) adds nothing
    names = list(free_constants(cases) if free is None else free)
    if not runs_cudnn(cases):
        start = dataclasses.replace(start, fused_attention_efficiency=None)
    low = [getattr(BOUNDS, n)[0] for n in names]
    high = [getattr(BOUNDS, n)[1] for n in names]
    scale = [max(abs(h), 1.0) if n == "matmul_half_dim" else 1.0 for n, h in zip(names, high)]
    roots = [math.sqrt(c.weight) for c in cases]

    def constants(x: Sequence[float]) -> Constants:
        return dataclasses.replace(start, **{n: min(max(v * s, lo), hi)
                                             for n, v, s, lo, hi in zip(names, x, scale, low, high)})

    def residuals(x: Sequence[float]) -> list[float]:
        return [r * case.log_error(constants(x)) for r, case in zip(roots, cases)]

    # The loss has several basins (overlap and bandwidth trade against each other), so the solver
    # starts from ``start`` and from each of ``starts``, and the lowest loss wins.
    best = None
    for origin in (start, *(dataclasses.replace(start, **point) for point in starts)):
        if origin.fused_attention_efficiency is None:
            origin = dataclasses.replace(origin, fused_attention_efficiency=origin.attention_efficiency)
        x0 = [min(max(getattr(origin, n), lo), hi) / s for n, s, lo, hi in zip(names, scale, low, high)]
        result = least_squares(residuals, x0, bounds=([lo / s for lo, s in zip(low, scale)],
                                                      [hi / s for hi, s in zip(high, scale)]),
                               loss="soft_l1", f_scale=0.05, diff_step=1e-3, xtol=1e-4, ftol=1e-5, max_nfev=60)
        if best is None or result.cost < best.cost:
            best = result
    fitted = constants(best.x)
    say(f"  fit over {len(cases)} runs: loss {best.cost:.4f}, {fitted.describe()}")
    return fitted


FP8 = "fp8_matmul_efficiency"


def fit_fp8(cases: Sequence[Case], constants: Constants, say: Callable[[str], None] = lambda _: None) -> Constants:
    """``constants`` with the FP8 GEMM efficiency fitted to ``cases`` (FP8 runs), every other constant
    held: the dense runs fix those, and an FP8 run's attention, communication and bandwidth-bound
    kernels are the same as in 16 bits. Starts from the 16-bit matmul efficiency."""
    start = dataclasses.replace(constants, fp8_matmul_efficiency=constants.fp8_matmul_efficiency
                                or constants.matmul_efficiency)
    return fit(cases, start, say, free=(FP8,), starts=())


def group_folds(cases: Sequence[Case], k: int) -> list[list[int]]:
    """Group k-fold: the groups (one model from one source) in sorted order, dealt round-robin to
    ``k`` folds; each fold is the indices of its cases."""
    groups = sorted({c.group for c in cases})
    fold_of = {g: i % k for i, g in enumerate(groups)}
    return [[i for i, c in enumerate(cases) if fold_of[c.group] == f] for f in range(min(k, len(groups)))]


def _round(value: float) -> float:
    return round(value, 1) if value >= 10 else round(value, 3)


# ---- presets -----------------------------------------------------------------------------------

PRESET_KEYS = ("matmul_efficiency", "matmul_half_dim", "memory_bandwidth_efficiency", "attention_efficiency",
               FUSED, FP8, "comm_overlap_efficiency")
FIT_COMMENT = "# Fitted by benchmarks/fit_device.py"
STALE_HEADER = "efficiencies are left at their defaults until calibrated"


def write_preset(name: str, constants: Constants, note: str) -> None:
    """Writes the fitted device constants into the device block of templates/hardware/<name>.yaml,
    replacing any earlier fit, with a comment naming the fit and its data."""
    path = TEMPLATES / f"{name}.yaml"
    out: list[str] = []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith(FIT_COMMENT) or re.match(rf"\s+({'|'.join(PRESET_KEYS)}):", line):
            continue
        out.append(line.replace(STALE_HEADER, "device efficiencies fitted below"))
        if line.strip().startswith("memory_bandwidth_gbps:"):
            out.append(f"  {FIT_COMMENT}: {note}")
            out += [f"  {key}: {_round(getattr(constants, key))}" for key in PRESET_KEYS
                    if getattr(constants, key) is not None]
    path.write_text("\n".join(out) + "\n")


def preset_note(name: str, generation: str, runs: int, fp8_runs: int = 0) -> str:
    """The comment above a preset's fitted constants: the command and the data."""
    fp8 = f" (fp8_matmul_efficiency on its {fp8_runs} FP8 runs)" if fp8_runs else ""
    note = (f"`python benchmarks/fit_device.py --write` on the {runs} published {generation.upper()} runs{fp8} of "
            f"benchmarks/published_runs.yaml; errors in benchmarks/results/fidelity.md")
    if name == "h200":
        note += " (the H100's: the same compute; HBM3e bandwidth above, NVIDIA H200 datasheet)"
    return note


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: benchmarks/ is not a package path
    from fidelity import build_cases, fit_generation, fitted_runs, fp8_runs, load_runs

    runs, _ = load_runs()
    write = "--write" in sys.argv[1:]
    for generation, presets in DEVICES.items():
        fitted, cases = fit_generation(fitted_runs(runs, generation), say=print)
        fp8 = fp8_runs(runs, generation)
        if fp8:  # the FP8 GEMM efficiency, on the FP8 runs with the rest held (fidelity.py does the same)
            fitted = fit_fp8(build_cases(fp8, fitted), fitted, say=print)
        print(f"{generation}: {fitted.describe()}")
        if write:
            for name in presets:
                write_preset(name, fitted, preset_note(name, generation, sum(c.weight > 0 for c in cases), len(fp8)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
