"""plan.yaml: a summary for people, the plan in field order, a strict round trip, clear errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from dsauto.emit.ds_config import write_ds_config
from dsauto.errors import DsautoError
from dsauto.plan import Plan
from dsauto.plan_io import read_plan, write_plan_yaml


def test_round_trip(plan, tmp_path):
    assert read_plan(write_plan_yaml(plan, tmp_path / "plan.yaml")) == plan


def test_round_trip_keeps_awkward_values(zero3_plan, tmp_path):
    # Floats that need all their digits, a name YAML would read as a boolean, huge byte counts.
    odd = dataclasses.replace(
        zero3_plan, hardware="yes", memory_budget_bytes=2**53 + 1,
        model=dataclasses.replace(zero3_plan.model, name="on"),
        prediction=dataclasses.replace(zero3_plan.prediction, step_seconds=0.1 + 0.2, mfu=1 / 3),
    )
    assert read_plan(write_plan_yaml(odd, tmp_path / "plan.yaml")) == odd


def test_reads_the_plan_block_of_a_ds_config(plan, tmp_path):
    assert read_plan(write_ds_config(plan, tmp_path / "ds_config.json")) == plan


def test_summary_comes_first_then_the_plan_in_field_order(zero3_plan, tmp_path):
    text = write_plan_yaml(zero3_plan, tmp_path / "plan.yaml").read_text()
    head = text.split("\nmodel:", 1)[0].splitlines()
    assert all(line.startswith("#") for line in head)
    summary = "\n".join(head)
    assert "tiny-llama" in summary and "dp 2 x tp 1 x pp 1, ZeRO stage 3" in summary
    assert "micro-batch 2 x 4 accumulation steps x dp 2" in summary
    assert "predicted (analytic)" in summary
    top_level = [line.split(":", 1)[0] for line in text.splitlines()
                 if line and not line.startswith(("#", " ", "-"))]
    assert top_level == [field.name for field in dataclasses.fields(Plan)]
    # One layer run per line, so the per-layer choices read as a table.
    runs = [line for line in text.splitlines() if line.startswith("- {first:")]
    assert len(runs) == len(zero3_plan.layers)
    assert "stage_layers: [4]" in text


def one_sentence(message: str) -> bool:
    # Not checked: the full stop, which dsauto.serde leaves off its "is invalid: ..." messages.
    return "\n" not in message and "Traceback" not in message


@pytest.mark.parametrize("name, content, expected", [
    ("plan.yaml", "model: [unclosed\n", r"is not valid YAML: .* at line 2"),
    ("plan.yaml", "- just\n- a list\n", r"is not a plan \(it holds no mapping of a plan.s keys\)"),
    ("megatron_args.txt", "--tp 2 --pp 2\n", r"is not a plan .*give the plan.yaml dsauto tune wrote\."),
    ("ds_config.json", '{"train_batch_size": 8}', r"has no 'dsauto' block"),
    ("ds_config.json", '{"train_batch_size": ', r"is not valid JSON: .* line 1"),
])
def test_bad_files_are_one_sentence_errors(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DsautoError, match=expected) as info:
        read_plan(path)
    assert one_sentence(str(info.value)) and str(info.value).endswith(".")


def test_missing_file(tmp_path):
    with pytest.raises(DsautoError, match="Cannot read the plan file .*nowhere.yaml") as info:
        read_plan(tmp_path / "nowhere.yaml")
    assert one_sentence(str(info.value)) and str(info.value).endswith(".")


def edit(plan: Plan, tmp_path, change) -> DsautoError:
    data = plan.to_dict()
    change(data)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(DsautoError) as info:
        read_plan(path)
    assert one_sentence(str(info.value))
    return info.value


def test_unknown_key(zero3_plan, tmp_path):
    error = edit(zero3_plan, tmp_path, lambda d: d.update(pipeline_degree=2))
    assert "unknown key(s) 'pipeline_degree'" in str(error)


def test_wrong_type(zero3_plan, tmp_path):
    error = edit(zero3_plan, tmp_path, lambda d: d["layers"][1].update(checkpoint="sometimes"))
    assert "layers[1]: checkpoint must be true or false" in str(error)


def test_broken_batch_equation(zero3_plan, tmp_path):
    error = edit(zero3_plan, tmp_path, lambda d: d.update(global_batch=17))
    assert "micro_batch(2) * grad_accum(4) * dp(2) != global_batch(17)" in str(error)


def test_newer_plan_version(zero3_plan, tmp_path):
    error = edit(zero3_plan, tmp_path, lambda d: d.update(version=2))
    assert "version 2 plan" in str(error)


def test_json_plan_block_errors_name_the_block(zero3_plan, tmp_path):
    config = {"train_batch_size": 16, "dsauto": {**zero3_plan.to_dict(), "dp": "two"}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(DsautoError, match="the dsauto block of .*ds_config.json: dp must be a whole number"):
        read_plan(path)
