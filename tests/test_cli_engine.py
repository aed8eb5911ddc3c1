"""The command line and the plan's engine: a DeepSpeed plan never has degrees DeepSpeed cannot run,
and ``dsauto validate`` refuses one edited by hand to have them."""

from __future__ import annotations

import json

from dsauto.cli import main
from dsauto.plan_io import read_plan


def test_deepspeed_plans_for_8_h100_have_no_tensor_parallelism(tmp_path):
    assert main(["tune", "--model", "llama3-8b", "--hardware", "h100-80gb", "--engine", "deepspeed",
                 "--out", str(tmp_path)]) == 0
    plan = read_plan(tmp_path / "plan.yaml")
    assert plan.engine == "deepspeed" and plan.tp == 1


def test_validate_refuses_a_deepspeed_plan_edited_to_tensor_parallelism(tmp_path, capsys):
    assert main(["tune", "--model", "llama3-8b", "--hardware", "h100-80gb", "--engine", "deepspeed",
                 "--out", str(tmp_path)]) == 0
    path = tmp_path / "ds_config.json"
    config = json.loads(path.read_text())
    block = config["dsauto"]
    block["tp"], block["dp"], block["grad_accum"] = 2, block["dp"] // 2, block["grad_accum"] * 2
    config["gradient_accumulation_steps"] = block["grad_accum"]
    path.write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["validate", str(path)]) == 2
    error = capsys.readouterr().err.strip()
    assert "DeepSpeed plans have no tensor parallelism (tp 2)" in error and len(error.splitlines()) == 1


def test_a_megatron_plan_whose_flags_cannot_state_it_says_so(tmp_path, capsys):
    """llama3-70b on 64 H100s at 8K tokens checkpoints scattered layers, which Megatron's block
    recomputation cannot state: megatron_args.txt keeps them as a comment, and tune warns that a
    launch of the flags alone runs without what the plan's memory counts on; pinned
    --recompute-num-layers, the flags state it and nothing is said."""
    import pytest

    from dsauto.errors import DsautoWarning

    argv = ["tune", "--model", "llama3-70b", "--hardware", "h100-80gb", "--nodes", "8", "--global-batch", "512",
            "--seq-len", "8192", "--engine", "megatron"]
    with pytest.warns(DsautoWarning, match=r"megatron_args\.txt cannot state what the plan's memory and time count on "
                                           r"\(activation checkpointing of transformer layers .*\): a Megatron-LM "
                                           r"launch of its flags alone runs without it"):
        assert main([*argv, "--out", str(tmp_path / "scattered")]) == 0
    assert "# Not expressed: activation checkpointing" in (tmp_path / "scattered" / "megatron_args.txt").read_text()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", DsautoWarning)
        assert main([*argv, "--recompute-num-layers", "2", "--out", str(tmp_path / "block")]) == 0
    assert "--recompute-num-layers 2" in (tmp_path / "block" / "megatron_args.txt").read_text()
