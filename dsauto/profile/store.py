"""The profile: what was measured for one model on one device, and where it is kept on disk.

A profile is keyed by the model's shape, the device, the dtype, the sequence length and the software
versions (torch, DeepSpeed, dsauto): a new torch or a new device can change every number, so a
profile made under other versions is not reused. Profiles are JSON files in a folder
(``profiles/`` by default), one per key, written atomically; ``dsauto profile`` reuses a matching
one unless told ``--force``, and ``dsauto tune --profile DIR`` loads the one matching its workload.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsauto.cost.calibration import Calibration
from dsauto.errors import DsautoError, DsautoWarning
from dsauto.spec.presets import list_presets
from dsauto.profile.collectives import CollectiveFit
from dsauto.profile.layers import REFERENCE_ENGINE, LayerMeasurement
from dsauto.serde import content_dict, from_dict, read_data, to_dict, write_json
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import Dtype, TrainSpec

PROFILE_VERSION = 1


@dataclass(frozen=True)
class MeasuredStep:
    """One training step a study measured, kept with the profile so that every later calibration
    is fitted to it as well (``dsauto tune --trials``)."""

    plan: dict[str, Any]
    """The plan that ran (``Plan.to_dict()``, the trial's knobs applied), kept as data so that a
    plan format this dsauto no longer reads costs that one step, not the profile."""
    step_seconds: float
    """Measured median step time."""
    peak_bytes: int
    """Measured peak live tensor bytes per rank."""
    other_load: float = 0.0
    """CPU cores other processes kept busy while it ran (stolen time included)."""
    loadavg: float = 0.0
    """The machine's one-minute load average when it started (``os.getloadavg``)."""
    cores: int = 0
    """CPU cores of the machine."""
    contended: bool = False
    """Whether other processes competed for the ranks' cores: such a step counts little in the fit."""


@dataclass(frozen=True)
class StudyRecord:
    """The measured steps of one study, with the cluster and workload they were planned for."""

    study: str
    """The study's name (one record per name: a resumed study replaces its record)."""
    host: str
    """Machine that measured."""
    cluster: ClusterSpec
    """The cluster of its plans (its size and memory budget)."""
    train: TrainSpec
    """Its workload."""
    steps: tuple[MeasuredStep, ...]
    """Every step it measured."""


PROFILE_LOCK_NAME = ".dsauto-profile.lock"
"""The lock of a profile store's folder (not the output folder's, should the two be one folder)."""
MAX_HISTORY_STEPS = 256
"""Measured steps kept with a profile (the most recent): the fit re-prices each of them."""


@dataclass(frozen=True)
class Profile:
    """Measured costs of one model's layers on one device, and of the collectives of one cluster."""

    model: ModelSpec
    """The model measured."""
    device: str
    """The device measured on (``cpu`` or the CUDA device name)."""
    dtype: Dtype
    """Training dtype of the measurements."""
    seq_len: int
    """Tokens per sequence of every measured micro-batch."""
    threads: int
    """CPU threads per process while measuring (timings on CPU depend on it)."""
    versions: dict[str, str]
    """Software versions measured with (torch, deepspeed, dsauto)."""
    layers: tuple[LayerMeasurement, ...]
    """One entry per (layer group, TP degree, micro-batch, checkpointing)."""
    optimizer_seconds_per_param: float
    """Measured time of one AdamW update per parameter (torch's implementation, as the emitted
    config asks for), on one rank."""
    collectives: tuple[CollectiveFit, ...] = ()
    """Fitted collective costs, when the profile ran on several ranks; empty otherwise."""
    zero3_module_seconds: float = 0.0
    """What ZeRO-3's per-module hooks add to one micro-batch's forward and backward, per hooked
    module, beyond the collectives' bandwidth time (:mod:`dsauto.profile.engine`); 0 if not measured."""
    layer_modules: dict[str, int] = field(default_factory=dict)
    """Modules ZeRO-3 hooks in one transformer layer of the profiled implementation, by operator
    splitting factor (``"1"``, ``"2"``, ...)."""
    world_size: int = 1
    """Ranks the profile ran on."""
    cpu_optimizer_seconds_per_param: float = 0.0
    """Measured time of one Adam update per parameter on the host, as an offloaded optimizer runs it,
    with one rank's threads (:mod:`dsauto.profile.cpu_optimizer`); 0 if not measured."""
    cpu_optimizer: str = ""
    """Which host optimizer that was: ``DeepSpeedCPUAdam`` (when its extension was built) or
    ``torch AdamW (fused)``; empty if not measured."""
    engine: str = REFERENCE_ENGINE
    """Whose transformer layers were timed: ``deepspeed``, the reference layers (or the user's own),
    as DeepSpeed trains them; ``megatron``, Megatron-core's own (local layer spec). Profiles written
    before this field timed the reference layers."""
    factory: str = ""
    """The ``--factory`` (``module:function``) whose own layers were timed; empty for the engine's."""
    calibration: Calibration | None = None
    """Correction factors fitted to measured training steps by ``dsauto tune --trials``; every
    search that uses this profile applies them. None until a tune has measured steps."""
    history: tuple[StudyRecord, ...] = ()
    """The studies whose steps ``calibration`` is fitted to, oldest first (each tune adds its own
    and fits the factors to all of them again)."""
    version: int = PROFILE_VERSION
    """Profile format version."""
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for m in self.layers:
            self._index[(m.group, m.tp, m.micro_batch, m.checkpoint)] = m

    def to_dict(self) -> dict[str, Any]:
        data = to_dict(self)
        data.pop("_index")
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str = "the profile") -> Profile:
        return from_dict(cls, data, where)

    @property
    def key(self) -> str:
        """The profile's store key (its file stem), how a plan names the profile it was priced from."""
        return profile_key(self.model, self.device, self.dtype, self.seq_len, self.versions, self.engine, self.factory)

    def measurement(self, group: str, tp: int, micro_batch: int, checkpoint: bool) -> LayerMeasurement | None:
        """The measurement of exactly this layer setting, if it was measured."""
        return self._index.get((group, tp, micro_batch, checkpoint))

    def micro_batches(self, group: str, tp: int, checkpoint: bool) -> list[int]:
        """Micro-batch sizes measured for a layer setting, ascending."""
        return sorted(b for (g, t, b, c) in self._index if (g, t, c) == (group, tp, checkpoint))

    def estimate(self, group: str, tp: int, micro_batch: int, checkpoint: bool) -> LayerMeasurement | None:
        """The layer's cost at ``micro_batch``: measured, or interpolated linearly in the micro-batch
        between (or beyond) the two nearest measured sizes. None when the setting was not measured.

        Times are affine in the batch once kernels are past their fixed overheads; bytes are
        proportional to it. Extrapolating beyond the measured range keeps the last segment's slope.
        """
        exact = self.measurement(group, tp, micro_batch, checkpoint)
        if exact is not None:
            return exact
        sizes = self.micro_batches(group, tp, checkpoint)
        if not sizes:
            return None
        if len(sizes) == 1:
            only = self._index[(group, tp, sizes[0], checkpoint)]
            return _scaled(only, micro_batch, micro_batch / sizes[0], micro_batch / sizes[0])
        below = [b for b in sizes if b < micro_batch]
        above = [b for b in sizes if b > micro_batch]
        lo, hi = ((below[-1], above[0]) if below and above else
                  (sizes[-2], sizes[-1]) if below else (sizes[0], sizes[1]))
        a, b = self._index[(group, tp, lo, checkpoint)], self._index[(group, tp, hi, checkpoint)]
        w = (micro_batch - lo) / (hi - lo)

        def line(x: float, y: float) -> float:
            return max(x + w * (y - x), 0.0)

        return LayerMeasurement(
            group=group, tp=tp, micro_batch=micro_batch, checkpoint=checkpoint,
            forward_seconds=line(a.forward_seconds, b.forward_seconds),
            backward_seconds=line(a.backward_seconds, b.backward_seconds),
            activation_bytes=round(a.activation_bytes * micro_batch / lo),
            peak_bytes=round(line(a.peak_bytes, b.peak_bytes)),
            params_bytes=a.params_bytes,
            hidden_bytes=round(a.hidden_bytes * micro_batch / lo),
        )

    def collective(self, op: str, group_size: int, scope: str) -> CollectiveFit | None:
        """The fit of ``op`` on groups of ``group_size`` ranks in ``scope``, if measured."""
        for fit in self.collectives:
            if (fit.op, fit.group_size, fit.scope) == (op, group_size, scope):
                return fit
        return None


def software_versions() -> dict[str, str]:
    """The versions a profile depends on."""
    import torch

    from dsauto.version import __version__

    versions = {"torch": torch.__version__, "dsauto": __version__}
    try:
        import deepspeed

        versions["deepspeed"] = deepspeed.__version__
    except ImportError:  # profiling layers needs only torch
        pass
    return versions


def profiled_model(model: ModelSpec) -> ModelSpec:
    """What a profile measures of ``model``: its layers, not the multi-token-prediction layers a
    Megatron-core plan trains beside them (a launch with or without them prices from the same
    profile, and profiles made before dsauto read them still match)."""
    return dataclasses.replace(model, mtp_layers=0) if model.mtp_layers else model


def profile_key(model: ModelSpec, device: str, dtype: str, seq_len: int, versions: dict[str, str],
                engine: str = REFERENCE_ENGINE, factory: str = "") -> str:
    """File stem of a profile: readable parts, then a hash of everything that keys it (the engine
    only when it is not the reference layers', and the user's layer factory only when given, so that
    earlier profiles keep their keys)."""
    keyed: list[Any] = [content_dict(profiled_model(model)), device, dtype, seq_len, versions]
    name = f"{model.name}-{device}-{dtype}-s{seq_len}"
    if engine != REFERENCE_ENGINE:
        keyed.append(engine)
        name += f"-{engine}"
    if factory:
        keyed.append(f"factory {factory}")
        name += "-factory"
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:10]
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{slug}-{digest}"


def profile_path(directory: Path | str, model: ModelSpec, device: str, dtype: str, seq_len: int,
                 versions: dict[str, str] | None = None, engine: str = REFERENCE_ENGINE, factory: str = "") -> Path:
    """Where the profile with this key lives in ``directory``."""
    key = profile_key(model, device, dtype, seq_len, versions or software_versions(), engine, factory)
    return Path(directory) / f"{key}.json"


def save_profile(profile: Profile, directory: Path | str) -> Path:
    """Write ``profile`` into ``directory`` under its key (atomically) and return the path."""
    path = profile_path(directory, profile.model, profile.device, profile.dtype, profile.seq_len,
                        profile.versions, profile.engine, profile.factory)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _write(profile, path)


def _write(profile: Profile, path: Path) -> Path:
    return write_json(path, profile.to_dict())


def load_profile(path: Path | str) -> Profile:
    """Read one profile file."""
    path = Path(path)
    return Profile.from_dict(read_data(path, str(path)), str(path))


def find_profile(source: Path | str, model: ModelSpec, dtype: str, seq_len: int,
                 engine: str | None = None, cluster: ClusterSpec | None = None) -> Profile:
    """The profile for this workload: ``source`` is a profile file, or a folder searched for one
    measured on ``model`` with ``dtype`` and ``seq_len``, preferably of the layers of ``engine``
    (the engine the plans are for; None: either, the reference layers first), then under the
    current software versions. A profile of another engine's layers is used when there is no other,
    with a warning: its transformer layers run other kernels (Megatron-core's are slower than the
    reference layers on a CPU, benchmarks/results/accuracy.md). ``cluster``: the planned cluster; a
    profile measured on a CPU prices no GPU plan (nor the reverse), and one of another GPU, of other
    software versions, or (on CPU ranks) timed with more threads than a planned rank gets, is named
    in a warning."""
    source = Path(source)
    unreadable: list[str] = []
    if source.is_file():
        profile = load_profile(source)
        candidates = [profile]
    elif source.is_dir():
        candidates = []
        for path in sorted(source.glob("*.json")):
            try:  # one corrupt file must not hide the others (nor be measured again forever)
                candidates.append(load_profile(path))
            except DsautoError:
                unreadable.append(path.name)
    else:
        raise DsautoError(f"The profile {source} does not exist; run `dsauto profile --out {source}` first.")
    versions = software_versions()
    matching = [p for p in candidates if profiled_model(p.model) == profiled_model(model) and p.dtype == dtype
                and p.seq_len == seq_len]
    # Same engine first, then current versions: other versions are still the best measurement there
    # is (the plan says so), but another engine's layers are other code.
    matching.sort(key=lambda p: (p.engine != (engine or REFERENCE_ENGINE), p.versions != versions))
    if matching:
        chosen = matching[0]
        if engine is not None and chosen.engine != engine:
            warnings.warn(f"{source} has no profile of {engine}'s layers for {model.name}; pricing with "
                          f"the {chosen.engine} profile's layers, whose time may differ; run `dsauto "
                          f"profile --engine {engine}` for {engine}'s own.", DsautoWarning, stacklevel=2)
        if cluster is not None:
            _check_profile_device(chosen, cluster.device.name, source)
            _check_profile_threads(chosen, cluster, source)
        if chosen.versions != versions:
            differ = ", ".join(f"{name} {chosen.versions.get(name)} (now {versions.get(name)})"
                               for name in sorted(set(chosen.versions) | set(versions))
                               if chosen.versions.get(name) != versions.get(name))
            warnings.warn(f"{source}'s profile of {model.name} was measured under other software versions ({differ}), "
                          f"whose kernels may time differently; run `dsauto profile` again to measure these.",
                          DsautoWarning, stacklevel=2)
        return chosen
    have = ", ".join(f"{p.model.name} {p.dtype} seq {p.seq_len} ({p.engine}'s layers)" for p in candidates) or "none"
    if unreadable:
        have += f"; unreadable, skipped: {', '.join(unreadable)}"
    folder = source.parent if source.is_file() else source
    # a preset by its name; a model file or config by the --model the user gave (its name is no path)
    spelled = model.name if model.name in list_presets("models") else "<the --model given here>"
    raise NoMatchingProfile(
        f"No profile in {source} matches {model.name} in {dtype} with sequences of {seq_len} tokens "
        f"(found: {have}); run `dsauto profile --model {spelled} --dtype {dtype} --seq-len {seq_len} "
        f"--out {folder}`."
    )


OTHER_ENGINES_PROFILE = r".* has no profile of \w+'s layers for "
"""The start of :func:`find_profile`'s warning of another engine's profile, for callers that say it
themselves, of the plan found."""

_GPU_MODEL = re.compile(r"\b(?:[ABH]\d{2,3}|V100|L40S?|MI\d{3}X?)\b", re.I)


def _check_profile_device(profile: Profile, device: str, source: Path) -> None:
    """Refuses a profile measured on a CPU for a GPU plan, or the reverse; warns of one measured on
    another GPU than the plan's (by the model in their names: A100, H100, ...)."""
    measured_cpu, planned_cpu = profile.device == "cpu", device.lower() == "cpu"
    if measured_cpu != planned_cpu:
        raise DsautoError(f"{source}'s profile was measured on {profile.device}, and the plan is for {device}; "
                          f"profile on the plan's device (`dsauto profile` on one of its nodes), or leave out "
                          f"--profile to price the plan analytically.")
    planned, measured = _GPU_MODEL.search(device), _GPU_MODEL.search(profile.device)
    if planned and measured and planned.group(0).upper() != measured.group(0).upper():
        warnings.warn(f"{source}'s profile was measured on {profile.device}, and the plan is for {device}: its "
                      f"layer times are the {measured.group(0)}'s; profile on the plan's device for its own.",
                      DsautoWarning, stacklevel=3)


def _check_profile_threads(profile: Profile, cluster: ClusterSpec, source: Path) -> None:
    """Warns where a CPU profile timed its layers with more threads than each of the plan's ranks on
    this host's cores gets (``dsauto profile`` in one process takes every core; N ranks share them),
    so that its layers run slower than priced."""
    if profile.device != "cpu" or cluster.device.name.lower() != "cpu":
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    each = max(1, cores // cluster.devices_per_node)
    if profile.threads > each:
        warnings.warn(f"{source}'s profile timed each layer with {profile.threads} threads, and the plan runs "
                      f"{cluster.devices_per_node} ranks on these {cores} cores ({each} a rank), so its layers "
                      f"run slower than priced; profile on as many ranks as the plan (`torchrun --nproc-per-node "
                      f"{cluster.devices_per_node} -m dsauto.cli profile ...`) to time them as they run.",
                      DsautoWarning, stacklevel=3)


class NoMatchingProfile(DsautoError):
    """No stored profile matches the workload (profiling it would)."""


def update_profile(source: Path | str, profile: Profile, change: Callable[[Profile], Profile]) -> tuple[Profile, Path]:
    """Apply ``change`` to the profile stored for ``profile``'s key (the file ``source``, or its keyed
    file in the folder ``source``), as it is on disk now, and store the result atomically; returns
    it and its path. Two tunes sharing a profile take turns (a lock on its folder), and each builds
    on what the other stored: neither overwrites the other's measurements."""
    from dsauto.emit.artifacts import folder_lock

    source = Path(source)
    path = source if source.is_file() else profile_path(source, profile.model, profile.device, profile.dtype,
                                                        profile.seq_len, profile.versions, profile.engine,
                                                        profile.factory)
    with folder_lock(path.parent, "a profile store", wait=True, name=PROFILE_LOCK_NAME):
        try:
            current = load_profile(path) if path.exists() else profile
        except DsautoError:
            current = profile  # the stored file is corrupt: what this run read replaces it
        changed = change(current)
        _write(changed, path)
    return changed, path


def _scaled(m: LayerMeasurement, micro_batch: int, time_factor: float, bytes_factor: float) -> LayerMeasurement:
    return LayerMeasurement(
        group=m.group, tp=m.tp, micro_batch=micro_batch, checkpoint=m.checkpoint,
        forward_seconds=m.forward_seconds * time_factor, backward_seconds=m.backward_seconds * time_factor,
        activation_bytes=round(m.activation_bytes * bytes_factor), peak_bytes=round(m.peak_bytes * bytes_factor),
        params_bytes=m.params_bytes, hidden_bytes=round(m.hidden_bytes * bytes_factor))
