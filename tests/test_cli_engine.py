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


def test_a_megatron_plans_flags_state_every_choice_it_made(tmp_path):
    """llama3-70b on 64 H100s at 8K tokens, and llama3-8b at 16K tokens under 30 GiB (where the layer DP
    reaches for checkpointing and the head's loss chunks): Megatron-core checkpoints the first N layers
    of every model chunk and splits no operator, so a Megatron-core plan's checkpointing is that block
    and it splits nothing; megatron_args.txt states all of it, no '# Not expressed' line of the plan's
    own choices."""
    from dsauto.engines.megatron import block_recompute_layers

    for name, argv in (("big", ["--model", "llama3-70b", "--nodes", "8", "--global-batch", "512", "--seq-len", "8192"]),
                       ("tight", ["--model", "llama3-8b", "--seq-len", "16384", "--global-batch", "32",
                                  "--memory-limit", "30GiB", "--pp", "2"])):
        assert main(["tune", *argv, "--hardware", "h100-80gb", "--engine", "megatron", "--out",
                     str(tmp_path / name)]) == 0
        plan = read_plan(tmp_path / name / "plan.yaml")
        assert block_recompute_layers(plan) is not None and all(run.split == 1 for run in plan.layers)
        text = (tmp_path / name / "megatron_args.txt").read_text()
        assert "# Not expressed: activation checkpointing" not in text and "operator splitting" not in text


def test_deepspeed_pipelines_of_bf16_replicas_are_planned_as_zero_1(capsys):
    """DeepSpeed's pipeline engine runs bf16 without ZeRO through its BF16_Optimizer, which shards the
    optimizer state over the replicas: the search plans those pipelines as ZeRO stage 1, a pinned
    stage 0 is refused with that remedy, and fp32 (DeepSpeed's plain optimizer) keeps stage 0."""
    from dsauto.api import make_problem
    from dsauto.search.planner import Planner

    problem = make_problem("llama3-8b", "h100-80gb", global_batch=64, seq_len=4096, engine="deepspeed", pp=2)
    plans = Planner(problem.model, problem.cluster, problem.train, problem.pins).search(top_k=20)
    assert plans and all(p.zero_stage == 1 for p in plans)
    base = ["plan", "--model", "llama3-8b", "--hardware", "h100-80gb", "--global-batch", "64", "--seq-len", "4096",
            "--engine", "deepspeed", "--pp", "2", "--zero-stage", "0"]
    assert main(base) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("dsauto: error: --zero-stage 0 is not what DeepSpeed runs here: DeepSpeed's pipeline "
                            "engine (pp 2) trains bf16 over 4 data-parallel replicas with its BF16_Optimizer, which "
                            "shards the optimizer state as ZeRO stage 1 does; pin --zero-stage 1"), error
    assert len(error.splitlines()) == 1
    assert main([*base, "--dtype", "fp32"]) == 0
    assert "ZeRO stage 0" in capsys.readouterr().out


def test_a_deepspeed_plans_megatron_args_say_they_are_not_the_priced_run(tmp_path):
    assert main(["tune", "--model", "llama3-8b", "--hardware", "h100-80gb", "--engine", "deepspeed",
                 "--out", str(tmp_path)]) == 0
    header = (tmp_path / "megatron_args.txt").read_text().splitlines()[:6]
    assert any(line.startswith("# Not the priced run: this plan is priced for deepspeed (ds_config.json)")
               for line in header), header
    assert main(["tune", "--model", "llama3-8b", "--hardware", "h100-80gb", "--engine", "megatron",
                 "--out", str(tmp_path / "m")]) == 0
    assert "Not the priced run" not in (tmp_path / "m" / "megatron_args.txt").read_text()
