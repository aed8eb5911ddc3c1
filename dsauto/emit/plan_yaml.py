"""``plan.yaml``: the plan for people to read and for the hook to load, and reading a plan back.

The file opens with a comment block that summarises the plan (degrees, batch, pipeline layout, the
per-layer choices, the prediction per stage and what it was based on), then holds
``Plan.to_dict()`` in field order. Rows of a table (layer runs, lists of numbers) are written on one
line each so that the per-layer choices read as a table. The round trip is strict:
``read_plan(write_plan_yaml(plan, path)) == plan``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dsauto.emit.ds_config import PLAN_KEY
from dsauto.errors import DsautoError
from dsauto.plan import PLAN_VERSION, Plan
from dsauto.serde import read_data
from dsauto.units import format_bytes, format_count, format_flops, format_seconds


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
    """The text of ``plan.yaml``: the summary as comments, then the plan."""
    data = plan.to_dict()
    data["layers"] = [_Row(run) for run in data["layers"]]
    body = yaml.dump(data, Dumper=_PlanDumper, sort_keys=False, allow_unicode=True, width=100)
    return "".join(f"# {line}".rstrip() + "\n" for line in summary(plan)) + body


def write_plan_yaml(plan: Plan, path: Path | str) -> Path:
    """Writes ``plan`` to ``path`` as YAML with a commented summary on top."""
    path = Path(path)
    path.write_text(plan_yaml_text(plan))
    return path


def summary(plan: Plan) -> list[str]:
    """A few lines a person reads to know what the plan does and what it predicts."""
    model, pred = plan.model, plan.prediction
    lines = [
        f"dsauto plan v{plan.version} for {model.name} ({format_count(model.num_parameters())} "
        f"parameters) on {plan.nodes} x {plan.gpus_per_node} {plan.hardware}, "
        f"{format_bytes(plan.memory_budget_bytes)} per device",
        f"parallelism: dp {plan.dp} x tp {plan.tp} x pp {plan.pp}, ZeRO stage {plan.zero_stage}"
        + (", sequence parallel" if plan.sequence_parallel else ""),
        f"batch: {plan.global_batch} sequences of {plan.seq_len} tokens = micro-batch {plan.micro_batch}"
        f" x {plan.grad_accum} accumulation steps x dp {plan.dp}; {plan.dtype}, "
        + ("flash attention" if plan.flash_attention else "eager attention"),
        "pipeline layout (transformer layers per stage): "
        + " | ".join(str(count) for count in plan.stage_layers),
        "",
        "layers      group      stage  checkpoint  parameters  split",
    ]
    for run in plan.layers:
        span = str(run.first) if run.first == run.last else f"{run.first}-{run.last}"
        params = ("sharded" if run.shard_params else "resident") if plan.zero_stage == 3 else "replicated"
        lines.append(f"{span:<11} {run.group:<10} {run.stage:>5}  {'yes' if run.checkpoint else 'no':<10}"
                     f"  {params:<10}  {run.split:>5}")
    lines += [
        "",
        f"predicted ({pred.basis}): {format_seconds(pred.step_seconds)} per step, "
        f"{pred.tokens_per_second:,.0f} tokens/s, MFU {pred.mfu:.1%}, "
        f"{format_flops(pred.tflops_per_device * 1e12)} per device",
        f"step: compute {format_seconds(pred.compute_seconds)}, bubble {format_seconds(pred.bubble_seconds)}, "
        f"exposed communication {format_seconds(pred.exposed_comm_seconds)}, optimizer "
        f"{format_seconds(pred.optimizer_seconds)}",
        "stage  layers  forward    backward   peak memory  (params / grads / optimizer / activations / transient)",
    ]
    for st in plan.stages:
        lines.append(
            f"{st.stage:>5}  {st.first_layer}-{st.last_layer:<5} {format_seconds(st.forward_seconds):<10} "
            f"{format_seconds(st.backward_seconds):<10} {format_bytes(st.peak_bytes):<12} "
            f"({format_bytes(st.params_bytes)} / {format_bytes(st.grads_bytes)} / "
            f"{format_bytes(st.optimizer_bytes)} / {format_bytes(st.activation_bytes)} / "
            f"{format_bytes(st.transient_bytes)})"
        )
    return lines


def read_plan(path: Path | str) -> Plan:
    """Reads a plan from ``plan.yaml``, or from the ``"dsauto"`` block of a ``ds_config.json``."""
    path = Path(path)
    data, where = read_data(path, f"the plan file {path}"), str(path)
    if path.suffix == ".json":
        if not isinstance(data, dict) or PLAN_KEY not in data:
            raise DsautoError(f"{path} has no {PLAN_KEY!r} block; write it with dsauto, or pass "
                              f"the plan.yaml written next to it.")
        data, where = data[PLAN_KEY], f"the {PLAN_KEY} block of {path}"
    if isinstance(data, dict) and data.get("version", PLAN_VERSION) != PLAN_VERSION:
        raise DsautoError(f"{where} is a version {data['version']!r} plan, but this dsauto reads version "
                          f"{PLAN_VERSION}; re-plan with this dsauto.")
    return Plan.from_dict(data, where)
