"""`dsauto tune` plans the issue's mixtures of experts with expert parallelism, within the memory
budget, and prints the expert degrees and the all-to-all time per step."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from dsauto.cli import main
from dsauto.plan_io import read_plan

CONFIGS = Path(__file__).parent / "spec" / "configs"


# Mixtral on 64 H100s: fully sharded data parallelism over all 64 ranks (ep 1, ZeRO-3) is priced
# within a few percent of the expert-parallel plans and can win; under the distributed optimizer
# (ZeRO-1), as Megatron-LM's Mixtral recipes run it, the experts must be spread.
@pytest.mark.parametrize("name, nodes, batch, pins", [("mixtral-8x7b", 8, 512, ["--zero-stage", "1"]),
                                                      ("deepseek-v3", 256, 4096, [])])
def test_tune_plans_expert_parallelism(name, nodes, batch, pins, tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["tune", "--model", str(CONFIGS / f"{name}.json"), "--hardware", "h100-80gb",
                     "--nodes", str(nodes), "--gpus-per-node", "8", "--global-batch", str(batch),
                     "--seq-len", "4096", *pins, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    plan = read_plan(tmp_path / "plan.yaml")
    assert plan.engine == "megatron" and plan.ep > 1
    assert plan.prediction.peak_memory_bytes <= plan_budget(out)
    assert re.search(rf"ep={plan.ep} etp={plan.etp}", out)
    assert re.search(r"experts .* ep \d+ x etp \d+ .* all-to-all [\d.]+ (ms|s) per step", out)
    assert plan.prediction.expert_all_to_all_seconds > 0
    args = (tmp_path / "megatron_args.txt").read_text()
    assert f"--expert-model-parallel-size {plan.ep}" in args and "--num-experts" in args


def plan_budget(report: str) -> float:
    value, unit = re.search(r"budget ([\d.]+) (GiB|MiB)", report).groups()
    return float(value) * (2**30 if unit == "GiB" else 2**20)


def test_a_pinned_experts_activation_recompute_is_planned_and_emitted(tmp_path, capsys):
    base = ["tune", "--model", str(CONFIGS / "mixtral-8x7b.json"), "--hardware", "h100-80gb", "--nodes", "8",
            "--gpus-per-node", "8", "--global-batch", "512", "--seq-len", "4096", "--zero-stage", "1"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main([*base, "--recompute-modules", "moe_act", "--out", str(tmp_path / "ok")])
    assert code == 0
    plan = read_plan(tmp_path / "ok" / "plan.yaml")
    assert plan.engine == "megatron"
    assert all(plan.layer_choice(j).recompute_modules == ("moe_act",) for j in range(1, plan.model.num_layers + 1)
               if not plan.layer_choice(j).checkpoint)
    assert "--recompute-modules moe_act" in (tmp_path / "ok" / "megatron_args.txt").read_text()
    capsys.readouterr()
    # DeepSpeed-MoE has no such recomputation: one sentence, exit 2, nothing written
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main([*base, "--recompute-modules", "moe_act", "--engine", "deepspeed", "--out", str(tmp_path / "no")])
    err = capsys.readouterr().err
    assert code == 2 and "moe_act" in err and "--engine megatron" in err
    assert not (tmp_path / "no").exists()
