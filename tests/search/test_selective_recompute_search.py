"""Selective recomputation in the search, the plan, megatron_args.txt and the command line."""

import dataclasses
import warnings

import pytest

from dsauto.api import find_plans, make_problem
from dsauto.cli import main
from dsauto.describe import describe_plan
from dsauto.emit.megatron import megatron_args, megatron_argv
from dsauto.engines.megatron import selective_recompute_modules
from dsauto.errors import DsautoError, DsautoWarning
from dsauto.plan import LayerChoice, Plan
from dsauto.plan_io import read_plan, write_plan_yaml
from dsauto.search.ranking import TIE_TOLERANCE
from dsauto.search.space import Constraints, recompute_module_sets, strategies
from dsauto.spec.loaders import load_model
from dsauto.spec.training import TrainSpec

# Eager attention keeps each layer's s x s scores: llama2-13b on 8 A100-40GB at 2048 tokens does not
# fit with them in every layer, and recomputing the attention core (Korthikanti et al. 2022, Sec. 5)
# costs far less than checkpointing whole layers.
EAGER = dict(model="llama2-13b", hardware="a100-40gb", nodes=1, gpus_per_node=8, global_batch=64, seq_len=2048,
             flash_attention=False, engine="megatron")


@pytest.fixture(scope="module")
def eager_plans() -> dict[str, Plan]:
    return {pin: find_plans(make_problem(**EAGER, recompute_modules=pin))[0] for pin in (None, "none")}


def test_the_search_recomputes_the_attention_core_in_every_layer_when_it_pays(eager_plans):
    plan, without = eager_plans[None], eager_plans["none"]
    assert plan.uniform_recompute_modules() == ("core_attn",)
    assert not plan.checkpointed_layers()  # Megatron-core runs one granularity: never mixed with full
    assert all(run.recompute_modules == () for run in plan.layers if run.group in ("embedding", "head"))
    # Without it the same budget needs whole-layer checkpoints (or a slower layout).
    assert not without.selective_layers()
    assert plan.prediction.step_seconds < without.prediction.step_seconds
    assert "recomputes core_attn (selective)" in describe_plan(plan)


def test_megatron_args_say_selective_and_the_plugin_reads_the_same(eager_plans):
    plan = eager_plans[None]
    args = megatron_args(plan)
    assert "--recompute-granularity selective" in args and "--recompute-modules core_attn" in args
    assert not any(line.startswith("--recompute-method") for line in args)
    argv = megatron_argv(dataclasses.replace(plan, layers=tuple(
        dataclasses.replace(run, recompute_modules=("core_attn", "mlp")) if run.group == "decoder" else run
        for run in plan.layers)))
    i = argv.index("--recompute-modules")
    assert argv[i + 1:i + 3] == ["core_attn", "mlp"]  # argparse nargs="*": one word per argument
    assert selective_recompute_modules(plan) == ("core_attn",)


def test_plan_yaml_round_trips_the_modules(eager_plans, tmp_path):
    plan = eager_plans[None]
    assert read_plan(write_plan_yaml(plan, tmp_path / "plan.yaml")) == plan


def test_a_layer_is_checkpointed_whole_or_recomputes_known_modules():
    with pytest.raises(ValueError, match="checkpointed whole"):
        LayerChoice(1, 2, "decoder", 0, checkpoint=True, shard_params=False, split=1, recompute_modules=("core_attn",))
    with pytest.raises(ValueError, match="distinct names among core_attn, layernorm, mlp"):
        LayerChoice(1, 2, "decoder", 0, checkpoint=False, shard_params=False, split=1, recompute_modules=("router",))


def test_mixed_selective_layers_are_not_expressed_by_flags(eager_plans):
    plan = eager_plans[None]
    # the first run of layers that recompute selectively, its second half made to recompute nothing
    i, run = next((i, r) for i, r in enumerate(plan.layers) if r.recompute_modules and r.last > r.first)
    middle = (run.first + run.last) // 2
    halves = (dataclasses.replace(run, last=middle), dataclasses.replace(run, first=middle + 1, recompute_modules=()))
    mixed = dataclasses.replace(plan, layers=plan.layers[:i] + halves + plan.layers[i + 1:])
    assert selective_recompute_modules(mixed) is None
    assert any(line.startswith("# Not expressed: selective recomputation") for line in megatron_args(mixed))


def test_strategies_of_both_engines_come_in_pairs():
    problem = make_problem("gpt-tiny", "cpu", global_batch=8, seq_len=64, flash_attention=False)
    space = strategies(problem.model, problem.cluster, problem.train, problem.pins)
    for engine in ("deepspeed", "megatron"):
        ours = [s for s in space if s.engine == engine]
        plain = {dataclasses.replace(s, recompute_modules=()) for s in ours}
        assert {s.recompute_modules for s in ours} == {(), ("core_attn",)}
        assert len(ours) == 2 * len(plain)
    # Under fused attention the attention core keeps nothing: the search tries no selective
    # recomputation unless pinned.
    flash = make_problem("gpt-tiny", "cpu", global_batch=8, seq_len=64)
    assert not any(s.recompute_modules for s in strategies(flash.model, flash.cluster, flash.train, flash.pins))
    pinned = make_problem("gpt-tiny", "cpu", global_batch=8, seq_len=64, recompute_modules="layernorm")
    assert {s.recompute_modules for s in strategies(pinned.model, pinned.cluster, pinned.train, pinned.pins)} == {
        ("layernorm",)}


@pytest.mark.parametrize(("pins", "message"), [
    (dict(recompute_modules="core_attn,flash"), "'flash' is not a module Megatron-core recomputes"),
    (dict(recompute_modules="moe"), "'moe' recomputes part of a mixture of experts' layers, and the model has no experts"),
    (dict(recompute_modules="moe_act"), "'moe_act' recomputes the routed experts' activation, and the model has no experts"),
    (dict(recompute_modules="mlp", engine="megatron"),
     "cannot recompute the MLP of a model whose linear layers have biases"),
    (dict(recompute_modules="core_attn", checkpoint=True), "--checkpoint all recomputes them whole"),
])
def test_pins_an_engine_cannot_run_are_refused_in_one_sentence(pins, message):
    problem = make_problem("gpt-tiny", "cpu", global_batch=8, seq_len=64, **pins)
    with pytest.raises(DsautoError, match=message):
        find_plans(problem)


def test_the_pin_reaches_the_plan_from_the_command_line(tmp_path, capsys):
    code = main(["tune", "--model", "gpt-tiny", "--hardware", "cpu", "--global-batch", "8", "--seq-len", "64",
                 "--engine", "megatron", "--no-flash-attention", "--recompute-modules", "core_attn",
                 "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert read_plan(tmp_path / "plan.yaml").uniform_recompute_modules() == ("core_attn",)
    assert "--recompute-modules core_attn" in (tmp_path / "megatron_args.txt").read_text()
    assert main(["plan", "--model", "gpt-tiny", "--hardware", "cpu", "--recompute-modules", "moe"]) == 2
    assert "the model has no experts" in capsys.readouterr().err
    assert Constraints.__dataclass_fields__["recompute_modules"].metadata["flag"] == "--recompute-modules"


def test_deepspeed_recomputes_the_mlp_of_a_biased_model_that_megatron_cannot():
    # gpt-tiny's linear layers have biases: Megatron-core cannot recompute its MLP, the DeepSpeed hook can.
    plans = find_plans(make_problem("gpt-tiny", "cpu", global_batch=8, seq_len=64, recompute_modules="mlp"), top_k=50)
    assert plans and {p.engine for p in plans} == {"deepspeed"}
    assert all(p.uniform_recompute_modules() == ("mlp",) for p in plans)


def test_latent_attention_tries_its_up_projections_recomputation_on_megatron_core_only():
    """DeepSeek-V3 at NVIDIA's DGX Cloud layout (tp 2, pp 16, ep 64 on 1024 H100s, 4096 tokens), as
    NVIDIA ran it without recomputation, fits 80 GiB either way; recomputing its up projections and
    experts' activation in every layer costs 1% and frees 2.6 GiB, so the search, which prefers the
    roomier of plans within its tie tolerance, picks it itself. DeepSpeed cannot run mla_up_proj, so its
    strategies never carry it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        model = load_model("tests/spec/configs/deepseek-v3.json")
    train = TrainSpec(global_batch=8192, seq_len=4096, dtype="bf16", flash_attention=True)
    assert recompute_module_sets("megatron", model, train, Constraints()) == ((), ("moe_act", "mla_up_proj"))
    assert recompute_module_sets("deepspeed", model, train, Constraints()) == ((),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        [plan] = find_plans(make_problem(model, "h100-80gb", nodes=128, gpus_per_node=8, global_batch=8192,
                                         seq_len=4096, tp=2, pp=16, ep=64, engine="megatron", micro_batch=1,
                                         checkpoint=False))
    assert plan.uniform_recompute_modules() == ("moe_act", "mla_up_proj")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        [without] = find_plans(make_problem(model, "h100-80gb", nodes=128, gpus_per_node=8, global_batch=8192,
                                            seq_len=4096, tp=2, pp=16, ep=64, engine="megatron", micro_batch=1,
                                            checkpoint=False, recompute_modules="none"))
    assert without.uniform_recompute_modules() == ()
    assert without.prediction.step_seconds < plan.prediction.step_seconds <= (
        (1 + TIE_TOLERANCE) * without.prediction.step_seconds)
    assert plan.prediction.peak_memory_bytes < without.prediction.peak_memory_bytes - 2 * 2**30
