"""Correction factors that measured training steps fit to the cost model (:mod:`dsauto.refine.calibrate`).

Each factor scales one part of the model as a whole: a factor of 1.0 leaves it as priced. They are
stored with the profile (:class:`dsauto.profile.store.Profile`), so every later search that prices
layers from that profile uses them. The tensor-parallel collectives and the pipeline's transfers and
bubble have factors of their own, apart from compute and the data-parallel collectives, so that steps
of TP and PP plans correct those terms (:attr:`dsauto.plan.Prediction.tp_comm_seconds`,
``p2p_seconds`` and ``bubble_seconds`` are their shares of a step) and not the compute factor.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Calibration:
    """Multipliers on the parts of the cost model, fitted to measured steps."""

    compute: float = 1.0
    """Layer forward and backward compute (measured layer times or the roofline)."""
    communication: float = 1.0
    """The data-parallel collectives (ZeRO gathers and reductions, the gradient all-reduce) and the
    context- and expert-parallel exchanges."""
    tensor_parallel: float = 1.0
    """The tensor-parallel collectives of forward, backward and recomputation."""
    pipeline_p2p: float = 1.0
    """The pipeline's point-to-point transfers of boundary activations and their gradients."""
    pipeline_bubble: float = 1.0
    """The pipeline schedule's fill and drain: the step's time beyond the slowest stage's work."""
    zero3_hooks: float = 1.0
    """ZeRO-3's per-module hook time."""
    optimizer: float = 1.0
    """The optimizer update."""
    static_memory: float = 1.0
    """Parameters, gradients and optimizer states."""
    activation_memory: float = 1.0
    """Activations kept for backward and per-layer transients (gathered parameters, logits)."""
    trials: int = 0
    """Measured steps the factors were fitted to (0: not fitted)."""
    time_error_before: float = 0.0
    """RMS relative error of the step-time predictions on those steps without the factors."""
    time_error_after: float = 0.0
    """The same with the factors."""
    memory_error_before: float = 0.0
    """RMS relative error of the peak-memory predictions on those steps without the factors."""
    memory_error_after: float = 0.0
    """The same with the factors."""
    held: tuple[str, ...] = ()
    """Factors of :data:`DIMENSION_FACTORS` left at their prior because too few of the measured
    steps had their term (:data:`dsauto.refine.calibrate.MIN_TRIALS_PER_FACTOR`)."""

    def __post_init__(self) -> None:
        for name in TIME_FACTORS + MEMORY_FACTORS:
            if not getattr(self, name) > 0:
                raise ValueError(f"calibration factor {name} must be positive, got {getattr(self, name)}")

    def describe(self) -> str:
        factors = ", ".join(f"{name.replace('_', ' ')} x{getattr(self, name):.2f}"
                            for name in TIME_FACTORS + MEMORY_FACTORS)
        held = (f"; {', '.join(n.replace('_', ' ') for n in self.held)} left at x"
                f"{'/'.join(f'{getattr(self, n):.2f}' for n in self.held)}: too few of the steps had that term"
                if self.held else "")
        return (f"{factors} (fitted to {self.trials} measured steps: time error "
                f"{self.time_error_before:.1%} -> {self.time_error_after:.1%}, memory error "
                f"{self.memory_error_before:.1%} -> {self.memory_error_after:.1%}{held})")


TIME_FACTORS = ("compute", "communication", "tensor_parallel", "pipeline_p2p", "pipeline_bubble", "zero3_hooks",
                "optimizer")
DIMENSION_FACTORS = ("tensor_parallel", "pipeline_p2p", "pipeline_bubble")
"""Factors of one parallel dimension's terms, which only the steps of plans with that dimension
measure: a fit moves them only when enough such steps were measured."""
MEMORY_FACTORS = ("static_memory", "activation_memory")
FACTORS = tuple(f.name for f in fields(Calibration) if f.name in TIME_FACTORS + MEMORY_FACTORS)

IDENTITY = Calibration()
