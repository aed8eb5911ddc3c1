"""Build a ModelSpec, HardwareSpec or ClusterSpec from a preset name or a file.

A model is a preset name (``llama2-7b``), a dsauto model YAML whose keys are the ModelSpec fields,
or a Hugging Face ``config.json`` (or the model folder holding it).

Hardware and clusters come from a preset name (``a100-80gb``) or a cluster YAML: the HardwareSpec
fields at the top level, and optionally the cluster's own ``nodes`` and ``memory_limit_bytes``::

    name: my-a100-cluster
    device:
      name: A100-SXM4-80GB
      memory_bytes: 85899345920
      peak_flops: {bf16: 312e12, fp32: 19.5e12}
      memory_bandwidth_gbps: 2039
    intra_node: {bandwidth_gbps: 300, latency_seconds: 5e-6}
    inter_node: {bandwidth_gbps: 25, latency_seconds: 1e-5}
    gpus_per_node: 8            # devices per node
    dtype: bf16
    nodes: 4                    # default 1
    memory_limit_bytes: 0       # default 0: device memory minus its reserve

The hardware presets are such files without ``nodes``. A mistake in a file (missing, malformed,
an unknown key, a wrong type) raises DsautoError naming the file and what to change.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsauto.errors import DsautoError, DsautoWarning
from dsauto.serde import from_dict, read_data, to_dict
from dsauto.spec.cluster import ClusterSpec, HardwareSpec
from dsauto.spec.hf import HfConfigLike, model_from_hf_config
from dsauto.spec.model import ModelSpec
from dsauto.spec.presets import PresetKind, list_presets, preset_file
from dsauto.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

_WHAT = {"models": "model", "hardware": "hardware"}
_FILE_HINT = {"models": "a model YAML or a Hugging Face config.json", "hardware": "a cluster YAML"}
_FILE_SUFFIXES = (".yaml", ".yml", ".json")

# ClusterSpec fields a cluster file may set next to the HardwareSpec fields (gpus_per_node is the
# hardware's own field).
_CLUSTER_KEYS = ("nodes", "memory_limit_bytes")


ModelSource = str | os.PathLike | ModelSpec | Mapping[str, Any] | HfConfigLike
"""What names a model: a preset name or a file path (:func:`load_model`), a ModelSpec, a Hugging Face
config object (``transformers.PretrainedConfig``) or the mapping of a ``config.json`` (with its
``model_type``), or a mapping of ModelSpec fields."""


def as_model(model: ModelSource) -> ModelSpec:
    """The ModelSpec ``model`` names (see :data:`ModelSource`)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (str, os.PathLike)):
        return load_model(os.fspath(model))
    if isinstance(model, Mapping):
        data, where = dict(model), "the model mapping"
    elif isinstance(model, HfConfigLike):
        data, where = model.to_dict(), f"the {type(model).__name__}"
    else:
        raise DsautoError(f"A model is a preset name, a file path, a ModelSpec, a Hugging Face config "
                          f"(a transformers config object or a config.json mapping), not a "
                          f"{type(model).__name__}; pass one of those.")
    if "model_type" in data:
        return model_from_hf_config(data, where, default_name=str(data["model_type"]))
    data.setdefault("name", "model")
    return from_dict(ModelSpec, data, where)


HF_SHAPE_KEYS = ("num_hidden_layers", "intermediate_size", "n_layer", "n_embd")
"""Keys that Hugging Face configs give and dsauto's model files do not (which say num_layers,
ffn_hidden_size)."""


def load_model(name_or_path: str) -> ModelSpec:
    """Reads a model from a preset name, a dsauto model YAML, or a Hugging Face config.json or folder."""
    data, where, path = _read(name_or_path, "models")
    if path is None:
        return from_dict(ModelSpec, data, where)
    if "model_type" in data:
        # A Hugging Face folder's config.json takes the folder's name; any other file its own.
        named = path.resolve().parent.name if path.name == "config.json" else path.stem
        return model_from_hf_config(data, where, default_name=named)
    hf_shape = [key for key in HF_SHAPE_KEYS if key in data]
    if hf_shape:  # a Hugging Face config without its family: not a dsauto model file with odd keys
        raise DsautoError(f"{where} reads as a Hugging Face config ({', '.join(hf_shape)}) but has no model_type; "
                          f"add its family's model_type (llama, qwen2, mixtral, ...), as transformers writes it.")
    data.setdefault("name", path.stem)
    return from_dict(ModelSpec, data, where)


def load_hardware(name_or_path: str) -> HardwareSpec:
    """Reads a node type from a hardware preset name or a cluster YAML (ignoring its ``nodes``)."""
    return load_cluster(name_or_path).hardware


def load_cluster(name_or_path: str, nodes: int | None = None, gpus_per_node: int | None = None,
                 memory_limit: int | str | None = None) -> ClusterSpec:
    """Reads a cluster from a hardware preset name or a cluster YAML; arguments that are not None
    override the file (``memory_limit`` in bytes or as text such as ``"60GiB"``)."""
    data, where, path = _read(name_or_path, "hardware")
    if path is not None:
        data.setdefault("name", path.stem)
    known = [f.name for f in dataclasses.fields(HardwareSpec)] + list(_CLUSTER_KEYS)
    unknown = sorted(set(map(str, data)) - set(known))
    if unknown:
        raise DsautoError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; known keys "
                          f"are {', '.join(known)}.")
    hardware = from_dict(HardwareSpec, {k: v for k, v in data.items() if k not in _CLUSTER_KEYS}, where)
    device = data.get("device")
    generic = [k for k in FITTED_DEVICE_KEYS if k not in device] if path is not None and isinstance(device, Mapping) else []
    if generic:
        values = ", ".join(f"{k} {format_bytes(v) if k.endswith('_bytes') else f'{v:g}'}"
                           for k, v in ((k, getattr(hardware.device, k)) for k in generic))
        warnings.warn(f"{where}'s device leaves out {', '.join(generic)}, so plans on it take dsauto's generic "
                      f"{values}, not what the presets fit on published runs; copy them from the nearest preset "
                      f"({', '.join(list_presets('hardware'))}), or price with a measured profile (--profile).",
                      DsautoWarning, stacklevel=2)
    # from_dict builds from plain data only, so the checked hardware goes back in as a dict.
    cluster_keys = {k: data[k] for k in _CLUSTER_KEYS if k in data}
    cluster = from_dict(ClusterSpec, {"hardware": to_dict(hardware), **cluster_keys}, where)
    return override_cluster(cluster, nodes, gpus_per_node, memory_limit, where)


FITTED_DEVICE_KEYS = ("matmul_efficiency", "memory_bandwidth_efficiency", "comm_overlap_efficiency",
                      "memory_reserve_bytes")
"""The device fields a preset holds from measurements (fitted constants, the memory the runtime keeps),
which a cluster file that leaves them out takes dsauto's generic values of: named in a warning."""


def override_cluster(cluster: ClusterSpec, nodes: int | None = None, gpus_per_node: int | None = None,
                     memory_limit: int | str | None = None, where: str | None = None) -> ClusterSpec:
    """``cluster`` with the arguments that are not None in place of its own (``memory_limit`` in
    bytes or as text such as ``"60GiB"``); messages name the cluster as ``where``."""
    where = where or f"the cluster {cluster.hardware.name!r}"
    overrides: dict[str, int] = {}
    if nodes is not None:
        overrides["nodes"] = nodes
    if gpus_per_node is not None:
        overrides["gpus_per_node"] = gpus_per_node
    if memory_limit is not None:
        overrides["memory_limit_bytes"] = parse_bytes(memory_limit, "memory limit")
    cluster = dataclasses.replace(cluster, **overrides)

    device = cluster.device
    if cluster.memory_limit_bytes > device.memory_bytes:
        raise DsautoError(
            f"The memory limit {format_bytes(cluster.memory_limit_bytes)} is more than the "
            f"{format_bytes(device.memory_bytes)} of one {device.name} ({where}); give at most "
            f"{format_bytes(device.memory_bytes)}."
        )
    return cluster


def _read(name_or_path: str, kind: PresetKind) -> tuple[dict[str, Any], str, Path | None]:
    """The mapping in the preset or file ``name_or_path``, how messages name it, and its path
    (None for a preset)."""
    preset = preset_file(kind, name_or_path)
    if preset is not None:
        where = f"the {_WHAT[kind]} preset {name_or_path!r}"
        return _parse(preset, where), where, None
    path = _existing_file(name_or_path, kind)
    return _parse(path, str(path)), str(path), path


def _existing_file(name_or_path: str, kind: PresetKind) -> Path:
    """The file ``name_or_path`` names, or a DsautoError saying why there is none."""
    path = Path(name_or_path).expanduser()
    if kind == "models" and (path / "config.json").is_file():
        return path / "config.json"  # a Hugging Face model folder
    if path.is_file():
        return path
    if path.is_dir() and kind == "models":
        raise DsautoError(f"{path} is a folder without a config.json; give a Hugging Face model folder, "
                          f"{_FILE_HINT[kind]}, or a preset name.")
    if path.exists():
        raise DsautoError(f"{path} is not a file; give {_FILE_HINT[kind]}, or a preset name.")
    presets = ", ".join(list_presets(kind))
    if path.suffix in _FILE_SUFFIXES or "/" in name_or_path or os.sep in name_or_path:
        raise DsautoError(f"The {_WHAT[kind]} file {path} does not exist; check the path, or use a "
                          f"preset: {presets}.")
    raise DsautoError(f"Unknown {_WHAT[kind]} preset {name_or_path!r}; use one of {presets}, or give "
                      f"the path of {_FILE_HINT[kind]}.")


def _parse(source: Path | Traversable, where: str) -> dict[str, Any]:
    """The mapping in a YAML or (by its suffix) JSON file."""
    data = read_data(source, where)
    if not isinstance(data, dict):
        got = "nothing" if data is None else f"a {type(data).__name__}"
        raise DsautoError(f"{where} must hold a mapping of keys to values, but holds {got}.")
    return data
