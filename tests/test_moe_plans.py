"""`dsauto tune` plans the issue's mixtures of experts with expert parallelism, within the memory
budget, and prints the expert degrees and the all-to-all time per step."""

from __future__ import annotations

import dataclasses
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
    assert plan.engine == "megatron" and plan.uniform_recompute_modules() == ("moe_act",)
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


def test_a_pinned_deepep_dispatch_is_priced_emitted_and_applied(tmp_path, capsys):
    base = ["tune", "--model", str(CONFIGS / "qwen3-30b-a3b.json"), "--hardware", "h100-80gb", "--nodes", "4",
            "--gpus-per-node", "8", "--global-batch", "256", "--seq-len", "4096", "--zero-stage", "1",
            "--ep", "16"]  # two nodes per expert group: DeepEP crosses the network once per node
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*base, "--out", str(tmp_path / "a2a")]) == 0
        assert main([*base, "--moe-dispatcher", "deepep", "--out", str(tmp_path / "deepep")]) == 0
    out = capsys.readouterr().out
    assert "DeepEP dispatch" in out
    a2a, deepep = read_plan(tmp_path / "a2a" / "plan.yaml"), read_plan(tmp_path / "deepep" / "plan.yaml")
    assert (a2a.expert_dispatcher, deepep.expert_dispatcher) == ("alltoall", "deepep")
    assert 0 < deepep.prediction.expert_all_to_all_seconds < a2a.prediction.expert_all_to_all_seconds
    args = (tmp_path / "deepep" / "megatron_args.txt").read_text()
    assert "--moe-token-dispatcher-type flex" in args and "--moe-flex-dispatcher-backend deepep" in args
    assert "--moe-token-dispatcher-type alltoall" in (tmp_path / "a2a" / "megatron_args.txt").read_text()
    # the Megatron-core plugin gives the config the plan's dispatcher
    from megatron.core.transformer import TransformerConfig

    import dsauto.runtime.megatron as dm

    config = TransformerConfig(**dm.transformer_config_kwargs(deepep.model), use_cpu_initialization=True)
    applied = dm.apply(deepep, config)
    assert (applied.moe_token_dispatcher_type, applied.moe_flex_dispatcher_backend) == ("flex", "deepep")


@pytest.mark.parametrize("flag", [["--moe-dispatcher", "deepep"], ["--moe-router-force-load-balancing"]])
@pytest.mark.parametrize("model, extra, message", [
    ("gpt-tiny", [], "the model has no experts"),
    (str(CONFIGS / "mixtral-8x7b.json"), ["--engine", "deepspeed"], "plan with --engine megatron"),
])
def test_expert_options_where_they_cannot_run_are_one_sentence(flag, model, extra, message, tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["tune", "--model", model, *flag, *extra, "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and " ".join(flag) in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_routing_forced_to_balance_is_priced_emitted_and_applied(tmp_path, capsys):
    """--moe-router-force-load-balancing (NVIDIA's MoE performance tables set it): the busiest
    expert-parallel rank carries the mean load instead of 1.1x it, so the experts' GEMMs and
    all-to-alls of the same configuration are priced shorter; the flag is emitted and the plugin
    sets it. Never chosen unless pinned."""
    base = ["tune", "--model", str(CONFIGS / "qwen3-30b-a3b.json"), "--hardware", "h100-80gb", "--nodes", "2",
            "--gpus-per-node", "8", "--global-batch", "256", "--seq-len", "4096", "--zero-stage", "1",
            "--ep", "8", "--pp", "1", "--micro-batch", "1", "--checkpoint", "none", "--engine", "megatron"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*base, "--out", str(tmp_path / "own")]) == 0
        assert main([*base, "--moe-router-force-load-balancing", "--out", str(tmp_path / "even")]) == 0
    assert "routing forced to balance" in capsys.readouterr().out
    own, even = read_plan(tmp_path / "own" / "plan.yaml"), read_plan(tmp_path / "even" / "plan.yaml")
    assert (own.expert_load_balanced, even.expert_load_balanced) == (False, True)
    assert (own.dims, own.micro_batch) == (even.dims, even.micro_batch)
    # the dispatch is the busiest rank's: its bytes 1.1x the mean without the pin (EXPERT_LOAD_IMBALANCE),
    # its latency the same
    a2a_own, a2a_even = own.prediction.expert_all_to_all_seconds, even.prediction.expert_all_to_all_seconds
    assert a2a_even < a2a_own < 1.1 * a2a_even
    assert even.prediction.step_seconds < own.prediction.step_seconds
    assert "--moe-router-force-load-balancing" in (tmp_path / "even" / "megatron_args.txt").read_text()
    assert "--moe-router-force-load-balancing" not in (tmp_path / "own" / "megatron_args.txt").read_text()
    from megatron.core.transformer import TransformerConfig

    import dsauto.runtime.megatron as dm

    config = TransformerConfig(**dm.transformer_config_kwargs(even.model), use_cpu_initialization=True)
    assert dm.apply(even, config).moe_router_force_load_balancing
    with pytest.raises(ValueError, match="expert_load_balanced needs"):
        dataclasses.replace(even, engine="deepspeed", attention_kernel="flash")



def test_a_plan_for_the_trainer_gathers_each_sparse_block_whole(tmp_path):
    """transformers 5 keeps each MoE layer's experts in one 3-D parameter per matrix and DeepSpeed 0.19
    gathers Qwen2-MoE's sparse block as one leaf module: a ZeRO-3 plan for Hugging Face's Trainer
    prices that unit, and its stage3_max_live_parameters lets two of them live (the one in use and
    the one prefetched), where a plan for dsauto's own experts gathers one expert matrix at a time.
    The plan says so in plan.yaml, and its model is the config's, which the runtime checks."""
    from dsauto.api import make_plan
    from dsauto.emit.ds_config import ds_config
    from dsauto.plan_io import write_plan_yaml
    from dsauto.refine.space import strategy_of
    from dsauto.spec.loaders import load_model

    path = str(CONFIGS / "qwen1.5-moe-a2.7b.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pins = dict(gpus_per_node=8, global_batch=64, seq_len=4096, engine="deepspeed", zero_stage=3)
        trainer = make_plan(path, "h100-80gb", hf_trainer=True, **pins)
        own = make_plan(path, "h100-80gb", **pins)
        model = load_model(path)
    h, fe, fs = model.hidden_size, model.expert_ffn_hidden_size, model.shared_expert_ffn_hidden_size
    block = model.num_experts * 3 * h * fe + 3 * h * fs + model.num_experts * h + h  # experts, shared, router, gate
    assert trainer.experts_gathered_whole and not own.experts_gathered_whole
    assert trainer.model == model  # a pricing choice of the plan, not of the model
    assert ds_config(trainer)["zero_optimization"]["stage3_max_live_parameters"] == 2 * block
    assert ds_config(own)["zero_optimization"]["stage3_max_live_parameters"] < block
    assert trainer.prediction.peak_memory_bytes <= trainer.memory_budget_bytes
    written = read_plan(write_plan_yaml(trainer, tmp_path / "plan.yaml"))
    assert written.experts_gathered_whole and strategy_of(written).experts_gathered_whole
