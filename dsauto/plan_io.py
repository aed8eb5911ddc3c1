"""Reading and writing a plan: ``plan.yaml`` (for people to read and for the hooks to load) and the
``"dsauto"`` block that carries the plan inside ``ds_config.json``.

Both runtime hooks read plans through this module, so they depend on the plan, not on the emitters.
``plan.yaml`` opens with the plan's report (:func:`dsauto.describe.describe_plan`) as comments, then holds
``Plan.to_dict()`` in field order. Rows of a table (layer runs, lists of numbers) are written on one
line each so that the per-layer choices read as a table. The round trip is strict:
``read_plan(write_plan_yaml(plan, path)) == plan``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import re
from pathlib import Path
from typing import Any

import yaml

from dsauto.describe import describe_plan
from dsauto.errors import DsautoError
from dsauto.plan import PLAN_VERSION, Plan
from dsauto.serde import content_dict, read_data

PLAN_KEY = "dsauto"
"""Top-level key of ``ds_config.json`` holding the whole plan (DeepSpeed ignores unknown keys)."""
PLAN_ID_KEY = "dsauto_plan_id"
"""Top-level key of ``ds_config.json`` holding the plan's id, next to the plan block (the block
itself is exactly ``Plan.to_dict()``)."""
PLAN_ID_COMMENT = "# dsauto plan_id: "
"""How ``plan.yaml`` and ``megatron_args.txt`` carry the plan's id: a comment line."""

PLAN_YAML_NAME = "plan.yaml"
DS_CONFIG_NAME = "ds_config.json"
MEGATRON_ARGS_NAME = "megatron_args.txt"
TRIALS_CSV_NAME = "trials.csv"
ARTIFACT_NAMES = (DS_CONFIG_NAME, MEGATRON_ARGS_NAME, PLAN_YAML_NAME, TRIALS_CSV_NAME)
"""The files of one written set that carry its plan id (the pictures do not; nothing reads them)."""


class _Row(dict):
    """A mapping written in flow style, on one line: one row of a table."""


class _PlanDumper(yaml.SafeDumper):
    """Safe YAML with rows and lists of numbers written on one line each, and no aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_row(dumper: yaml.SafeDumper, row: _Row) -> yaml.Node:
    return dumper.represent_mapping("tag:yaml.org,2002:map", row.items(), flow_style=True)


def _represent_list(dumper: yaml.SafeDumper, items: list) -> yaml.Node:
    flat = all(not isinstance(item, (dict, list)) for item in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flat)


_PlanDumper.add_representer(_Row, _represent_row)
_PlanDumper.add_representer(list, _represent_list)


def plan_yaml_text(plan: Plan) -> str:
    """The text of ``plan.yaml``: the report as comments, then the plan."""
    data = plan.to_dict()
    data["layers"] = [_Row(run) for run in data["layers"]]
    body = yaml.dump(data, Dumper=_PlanDumper, sort_keys=False, allow_unicode=True, width=100)
    report = "".join(f"# {line}".rstrip() + "\n" for line in describe_plan(plan).splitlines())
    return report + PLAN_ID_COMMENT + plan_id(plan) + "\n" + body


def plan_id(plan: Plan) -> str:
    """A short hash of the plan's content, carried by every artifact written for it, so that files
    of two different plans (a run cut off between two renames) are never taken for one set; fields
    at their defaults do not count (:func:`dsauto.serde.content_dict`), so a field a later dsauto adds
    leaves the ids of the plans written before it as they were."""
    text = json.dumps(content_dict(plan), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def write_plan_yaml(plan: Plan, path: Path | str) -> Path:
    """Writes ``plan`` to ``path`` as YAML with its report as comments on top."""
    path = Path(path)
    path.write_text(plan_yaml_text(plan))
    return path


def read_plan(path: Path | str) -> Plan:
    """Reads a plan from ``plan.yaml``, or from the ``"dsauto"`` block of a ``ds_config.json``;
    refuses it when the artifacts written with it belong to another plan (:func:`check_artifact_set`)."""
    path = Path(path)
    check_artifact_set(path)
    data, where = read_data(path, f"the plan file {path}"), str(path)
    if path.suffix == ".json":
        if not isinstance(data, dict) or PLAN_KEY not in data:
            raise DsautoError(f"{path} has no {PLAN_KEY!r} block; write it with dsauto, or pass "
                              f"the plan.yaml written next to it.")
        data, where = data[PLAN_KEY], f"the {PLAN_KEY} block of {path}"
    return plan_from_data(data, where)


def plan_from_data(data: Any, where: str) -> Plan:
    """The plan in ``data`` (``Plan.to_dict()`` as read back), refusing other plan format versions;
    ``where`` names the source in error messages."""
    if not isinstance(data, dict):
        raise DsautoError(f"{where} is not a plan (it holds no mapping of a plan's keys); give the plan.yaml "
                          f"dsauto tune wrote.")
    if data.get("version", PLAN_VERSION) != PLAN_VERSION:
        raise DsautoError(f"{where} is a version {data['version']!r} plan, but this dsauto reads version "
                          f"{PLAN_VERSION}; re-plan with this dsauto.")
    return Plan.from_dict(data, where)


def artifact_ids(folder: Path | str) -> dict[str, str]:
    """The plan id each artifact in ``folder`` carries, by file name; files that are missing, carry
    no id (written by an older dsauto, or not by dsauto) or cannot be read are left out."""
    folder = Path(folder)
    ids = {name: _carried_id(folder / name, name) for name in ARTIFACT_NAMES}
    return {name: found for name, found in ids.items() if found}


def _carried_id(path: Path, kind: str) -> str | None:
    """The plan id the file at ``path`` carries, read as the artifact ``kind`` (its file name)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    found: Any = None
    if kind == DS_CONFIG_NAME:
        try:
            config = json.loads(text)
        except ValueError:
            return None
        found = config.get(PLAN_ID_KEY) if isinstance(config, dict) else None
    elif kind == TRIALS_CSV_NAME:
        rows = list(itertools.islice(csv.DictReader(io.StringIO(text)), 1))
        found = rows[0].get("plan_id") if rows else None
    else:
        match = re.search(f"^{re.escape(PLAN_ID_COMMENT)}(\\S+)$", text, re.MULTILINE)
        found = match.group(1) if match else None
    return found if isinstance(found, str) and found else None


def edited_since_written(path: Path | str, plan: Plan) -> str | None:
    """The id ``path`` (a plan.yaml, or a ds_config.json with its plan) carries where it is not the
    id of the plan it now holds: the file was edited after dsauto wrote it, so its predicted time
    and memory are those of the plan before the edit. None when they agree or it carries none."""
    path = Path(path)
    found = _carried_id(path, DS_CONFIG_NAME if path.suffix == ".json" else PLAN_YAML_NAME)
    return found if found is not None and found != plan_id(plan) else None


def check_artifact_set(path: Path | str) -> None:
    """Raises DsautoError, naming the files, when ``path`` is one of a written set of artifacts
    (``plan.yaml``, ``ds_config.json``, ...) and the set's files carry different plan ids."""
    path = Path(path)
    if path.name not in ARTIFACT_NAMES:
        return  # a renamed or copied file stands alone
    ids = artifact_ids(path.parent)
    if len(set(ids.values())) <= 1:
        return
    groups: dict[str, list[str]] = {}
    for name, found in ids.items():
        groups.setdefault(found, []).append(name)
    parts = "; ".join(f"{' and '.join(names)} {'carry' if len(names) > 1 else 'carries'} plan {found}"
                      for found, names in groups.items())
    raise DsautoError(f"The artifacts in {path.parent} belong to different plans ({parts}), as a run cut "
                      f"off while writing them leaves them; write them again with `dsauto tune --out "
                      f"{path.parent}`.")
