"""The command line: the main job end to end, and every bad input as one sentence with exit code 2."""

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from dsauto.cli import add_field_options, build_parser, field_values, main, problem_from_args
from dsauto.errors import DsautoWarning
from dsauto.plan_io import read_plan
from dsauto.search.space import Constraints
from dsauto.spec.training import TrainSpec

BIG = ["--model", "gpt3-175b", "--hardware", "a100-80gb", "--nodes", "128", "--gpus-per-node", "8",
       "--global-batch", "1536", "--seq-len", "2048"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tune_prints_the_plan_and_writes_four_artifacts(tmp_path, capsys):
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "tune", *BIG, "--top", "2", "--out", str(out_dir))
    assert code == 0, err
    for needle in ("degrees", "micro-batch", "layout", "predicted", "tokens/s", "MFU", "memory per rank",
                   "next plans:", "#3"):
        assert needle in out
    assert sorted(p.name for p in out_dir.iterdir()) == ["ds_config.json", "megatron_args.txt", "plan.png",
                                                         "plan.yaml"]
    plan = read_plan(out_dir / "plan.yaml")
    assert plan == read_plan(out_dir / "ds_config.json")
    config = json.loads((out_dir / "ds_config.json").read_text())
    assert config["train_batch_size"] == 1536
    assert config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * plan.dp == 1536
    assert f"--tensor-model-parallel-size {plan.tp}" in (out_dir / "megatron_args.txt").read_text()
    # The printed per-stage table has one row per pipeline stage.
    assert out.count("\n") > 10 + plan.pp


def test_default_job_runs_on_the_cpu_preset(tmp_path, capsys):
    code, out, err = run(capsys, "tune", "--out", str(tmp_path / "o"))
    assert code == 0, err
    assert "gpt-tiny on 1 x 2 cpu" in out


def test_pins_and_memory_limit(tmp_path, capsys):
    code, out, err = run(capsys, "plan", *BIG, "--tp", "8", "--pp", "8", "--memory-limit", "60GiB")
    assert code == 0, err
    assert "tp=8 pp=8" in out and "budget 60.0 GiB" in out


def test_explain_and_validate(tmp_path, capsys):
    out_dir = tmp_path / "out"
    assert run(capsys, "tune", "--engine", "deepspeed", "--out", str(out_dir))[0] == 0
    code, out, _ = run(capsys, "explain", str(out_dir / "plan.yaml"))
    assert code == 0 and "dsauto plan: gpt-tiny" in out
    code, out, err = run(capsys, "validate", str(out_dir / "ds_config.json"))
    assert code == 0, err
    assert "DeepSpeed accepts" in out and "warning" not in err


def test_validate_warns_of_settings_the_plan_does_not_price(tmp_path, capsys):
    out_dir = tmp_path / "out"
    assert run(capsys, "tune", "--zero-stage", "1", "--engine", "deepspeed", "--out", str(out_dir))[0] == 0
    path = out_dir / "ds_config.json"
    config = json.loads(path.read_text())
    config["zero_optimization"]["overlap_comm"] = False
    path.write_text(json.dumps(config))
    with pytest.warns(DsautoWarning, match="zero_optimization.overlap_comm is false.*restore the values dsauto wrote"):
        code, out, _ = run(capsys, "validate", str(path))
    assert code == 0 and "DeepSpeed accepts" in out


def bad_model_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nnum_layers: [oops\n")
    return str(path)


def odd_heads_yaml(tmp_path):
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump(dict(name="odd", architecture="decoder", num_layers=4, hidden_size=120,
                                        num_attention_heads=6, ffn_hidden_size=480, vocab_size=1000,
                                        max_position_embeddings=128)))
    return str(path)


MIXTRAL = Path(__file__).parent / "spec" / "configs" / "mixtral-8x7b.json"

BAD = [
    (lambda tmp: ["--model", "gpt-5"], r"Unknown model preset 'gpt-5'"),
    (lambda tmp: ["--hardware", "tpu-v9"], r"tpu-v9"),
    (lambda tmp: ["--model", str(tmp / "missing.yaml")], r"missing\.yaml"),
    (lambda tmp: ["--model", bad_model_yaml(tmp)], r"bad\.yaml"),
    (lambda tmp: ["--model", "llama2-70b", "--nodes", "1", "--gpus-per-node", "2", "--hardware",
                  "a100-40gb", "--global-batch", "2"], r"offload [0-9.]+ TiB a node, more than the 1.0 TiB of host memory"),
    (lambda tmp: ["--model", "llama2-70b", "--nodes", "1", "--gpus-per-node", "2", "--hardware",
                  "a100-40gb", "--global-batch", "2", "--offload", "none"], r"smallest plan needs at least [0-9.]+ [GT]iB"),
    (lambda tmp: ["--model", odd_heads_yaml(tmp), "--tp", "4", "--gpus-per-node", "4"],
     r"6 attention heads are not divisible by TP 4"),
    (lambda tmp: ["--tp", "2", "--pp", "2", "--gpus-per-node", "6", "--hardware", "a100-80gb"],
     r"does not divide"),
    (lambda tmp: ["--memory-limit", "lots"], r"memory limit"),
    # argparse would take the negative value for an option and say none was given
    (lambda tmp: ["--memory-limit", "-5GiB"], r"Cannot read the memory limit '-5GiB'"),
    (lambda tmp: ["--nodes", "0"], r"positive"),
    (lambda tmp: ["--zero-stage", "3", "--pp", "2", "--gpus-per-node", "4", "--hardware", "a100-80gb"],
     r"ZeRO stage 3 cannot run with pipeline"),
    (lambda tmp: ["--model", str(MIXTRAL), "--hardware", "h100-80gb", "--etp", "2", "--engine", "deepspeed",
                  "--global-batch", "64"], r"--etp 2 cannot run: DeepSpeed-MoE has no expert tensor parallelism"),
    (lambda tmp: ["--model", "llama3-8b", "--hardware", "a100-80gb", "--cp", "2", "--engine", "deepspeed", "--pp",
                  "2"], r"pipeline engine \(pp 2\); pin --pp 1 or --engine megatron, or leave --cp out\.$"),
    (lambda tmp: ["--model", str(MIXTRAL), "--hardware", "h100-80gb", "--nodes", "2", "--engine", "megatron", "--tp",
                  "2", "--no-sequence-parallel", "--global-batch", "64"],
     r"Sequence parallelism off \(--no-sequence-parallel\) cannot run with --tp 2: Megatron-core trains MoE layers "
     r"under tensor parallelism only with sequence parallelism; turn it on, or pin --tp 1\.$"),
    # gpt-tiny's learned position table would be indexed within each rank's shard, which the hook refuses
    (lambda tmp: ["--model", "gpt-tiny", "--cp", "2", "--engine", "deepspeed"],
     r"--cp 2 cannot run: DeepSpeed-Ulysses \(cp 2\) gives each rank a shard of the sequence, and the model's "
     r"learned position embeddings .*; pin --engine megatron, or leave --cp out\.$"),
]


@pytest.mark.parametrize("make_args, message", BAD)
def test_bad_input_is_one_sentence_exit_2_and_no_files(tmp_path, capsys, make_args, message):
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "tune", *make_args(tmp_path), "--out", str(out_dir))
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("dsauto: error:")]
    assert len(lines) == 1, err
    import re
    assert re.search(message, lines[0]), lines[0]
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_real_entry_point_exit_code(tmp_path):
    result = subprocess.run([sys.executable, "-m", "dsauto", "tune", "--model", "nope", "--out",
                             str(tmp_path / "o")], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.startswith("dsauto: error: ") and "Traceback" not in result.stderr


# The options that set TrainSpec and Constraints are built from their fields' metadata.
def option_cases(cls, field):
    """(argv, the value the field should get) for every spelling of ``field``'s option."""
    meta = field.metadata
    flag, choices = meta["flag"], meta.get("choices")
    if "const" in meta:
        return [([flag], meta["const"])]
    if isinstance(choices, dict):
        return [([flag, name], value) for name, value in choices.items()]
    if choices:
        return [([flag, str(value)], value) for value in choices]
    hint = typing.get_type_hints(cls)[field.name]
    literal = [a for a in typing.get_args(hint) if typing.get_origin(a) is typing.Literal]
    hint = literal[0] if literal else hint  # Literal[...] | None reads as the Literal
    if typing.get_origin(hint) is typing.Literal:
        return [([flag, value], value) for value in typing.get_args(hint)]
    if hint is int or int in typing.get_args(hint):
        return [([flag, "2"], 2)]
    if hint is str or str in typing.get_args(hint):  # --recompute-modules: a comma-separated list
        return [([flag, "core_attn,mlp"], "core_attn,mlp")]
    if hint is float or float in typing.get_args(hint):  # --moe-expert-capacity-factor
        return [([flag, "1.25"], 1.25)]
    raise AssertionError(f"add a sample value of {cls.__name__}.{field.name} ({hint}) to this test")


FIELDS = [(cls, f) for cls in (TrainSpec, Constraints) for f in dataclasses.fields(cls)]
NEEDS = {"fp8": ["--hardware", "h100-80gb"], "fp8_recipe": ["--hardware", "h100-80gb", "--fp8"],
         "fp8_param_gather": ["--hardware", "h100-80gb", "--fp8"],
         "expert_pad_to_capacity": ["--moe-expert-capacity-factor", "1.0"]}
"""What an option needs beside it: FP8 a device with an FP8 peak, its recipe and FP8 weights FP8 on,
filling the experts to capacity a capacity."""


@pytest.mark.parametrize("cls, field", FIELDS, ids=[f"{c.__name__}.{f.name}" for c, f in FIELDS])
def test_every_train_and_constraints_field_has_an_option_that_sets_it(cls, field):
    assert "flag" in field.metadata, f"{cls.__name__}.{field.name} has no command-line option"
    for argv, value in option_cases(cls, field):
        for command in ("tune", "plan"):
            problem = problem_from_args(build_parser().parse_args([command, *NEEDS.get(field.name, []), *argv]))
            spec = problem.train if cls is TrainSpec else problem.pins
            expected = field.default if value is None else value  # None: "not given", the default
            assert getattr(spec, field.name) == expected, (command, argv)


def test_options_not_given_leave_every_pin_to_the_search():
    args = build_parser().parse_args(["plan"])
    assert field_values(args, Constraints) == {}
    assert problem_from_args(args).pins == Constraints()


def test_a_new_field_becomes_an_option_without_touching_the_cli():
    @dataclasses.dataclass(frozen=True)
    class MorePins(Constraints):
        cp: int | None = dataclasses.field(default=None, metadata={"flag": "--cp", "help": "pin context parallelism"})

    parser = argparse.ArgumentParser()
    add_field_options(parser, MorePins)
    assert field_values(parser.parse_args(["--cp", "4", "--tp", "2", "--checkpoint", "none"]), MorePins) == {
        "cp": 4, "tp": 2, "checkpoint": False}
    assert "pin context parallelism" in parser.format_help()


def test_plans_its_own_runtime_would_refuse_are_not_written(tmp_path, capsys):
    """DeepSpeed plans of a mixture of experts keep one pipeline stage (dsauto builds no
    PipelineModule of MoE layers), --for hf keeps one (Hugging Face's Trainer builds no DeepSpeed
    pipeline), and a hand-edited plan whose engine cannot run it is refused by explain as by validate."""
    code, out, err = run(capsys, "plan", "--model", str(MIXTRAL), "--hardware", "h100-80gb", "--nodes", "2",
                         "--engine", "deepspeed", "--global-batch", "256", "--seq-len", "4096")
    assert code == 0 and "pp=1" in out
    code, out, err = run(capsys, "plan", "--model", str(MIXTRAL), "--hardware", "h100-80gb", "--nodes", "2",
                         "--engine", "deepspeed", "--pp", "2", "--global-batch", "256", "--seq-len", "4096")
    assert code == 2 and "dsauto places no MoE layer in DeepSpeed's pipeline engine; pin --pp 1" in err
    code, out, err = run(capsys, "tune", "--model", "llama2-13b", "--hardware", "a100-80gb", "--for", "hf",
                         "--global-batch", "64", "--out", str(tmp_path / "hf"))
    assert code == 0 and '"pipeline"' not in (tmp_path / "hf" / "ds_config.json").read_text()
    code, out, err = run(capsys, "tune", "--model", "llama2-13b", "--hardware", "a100-80gb", "--for", "hf", "--pp", "2",
                         "--out", str(tmp_path / "hf2"))
    assert code == 2 and "(--for hf) cannot run --pp 2" in err and not (tmp_path / "hf2").exists()
    plan = tmp_path / "hf" / "plan.yaml"
    import re

    text = plan.read_text().replace("\ntp: 1\n", "\ntp: 2\n").replace("\ndp: 8\n", "\ndp: 4\n")
    plan.write_text(re.sub(r"\ngrad_accum: (\d+)\n", lambda m: f"\ngrad_accum: {2 * int(m[1])}\n", text))
    code, out, err = run(capsys, "explain", str(plan))
    assert code == 2 and "its deepspeed plan cannot run: DeepSpeed plans have no tensor parallelism" in err, err
    code, out, err = run(capsys, "plan", "--out", "o")
    assert code == 2 and "see 'dsauto plan --help'" in err


LLAMA31 = Path(__file__).parent / "spec" / "configs" / "llama-3.1-8b.json"


def test_for_hf_plans_only_what_a_transformers_model_runs(tmp_path, capsys):
    """--for hf: a transformers decoder layer has no DistributedAttention and no attention core apart
    from its projections, and dsauto's hook splits no operator of a model Hugging Face's Trainer
    builds (its loss is inside the model; under ZeRO-3 it is built in zero.Init). At 32K tokens on 8
    H100s the search reaches for DeepSpeed-Ulysses without it; eager attention under 40 GiB reaches
    for the attention core's recomputation; neither with it, nor any split; a pin asking for one of
    them, or for Megatron-core, is refused before any search, and a plan that does not fit offers to
    unpin only what the user pinned."""
    shape = ["--model", str(LLAMA31), "--hardware", "h100-80gb", "--global-batch", "16"]
    long = [*shape, "--seq-len", "32768"]
    eager = [*shape, "--seq-len", "4096", "--no-flash-attention", "--memory-limit", "40GiB"]
    code, out, _ = run(capsys, "plan", *long)
    assert code == 0 and re.search(r"cp=[2-8]", out)
    code, out, _ = run(capsys, "plan", *eager)
    assert code == 0 and "core_attn" in out
    for argv in (long, eager):
        code, out, err = run(capsys, "tune", *argv, "--for", "hf", "--out", str(tmp_path / "hf"))
        plan = read_plan(tmp_path / "hf" / "plan.yaml")
        assert code == 0, err
        assert (plan.engine, plan.pp, plan.cp) == ("deepspeed", 1, 1)
        assert all(run.split == 1 and "core_attn" not in run.recompute_modules for run in plan.layers)
    for pin, said in ((["--engine", "megatron"], "--engine megatron: Hugging Face's Trainer and accelerate run "
                                                 "DeepSpeed"),
                      (["--cp", "2"], "--cp 2: a transformers decoder layer has no DistributedAttention"),
                      (["--recompute-modules", "core_attn"], "--recompute-modules core_attn: a transformers decoder "
                                                             "layer has no attention core"),
                      (["--model", str(MIXTRAL), "--ep", "2"], "--ep 2: a transformers model has no "
                                                               "deepspeed.moe.layer.MoE layers")):
        code, out, err = run(capsys, "tune", *shape, "--for", "hf", *pin, "--out", str(tmp_path / "no"))
        assert code == 2 and out == "" and not (tmp_path / "no").exists()
        assert f"A plan for Hugging Face's Trainer (--for hf) cannot run {said}" in err, err
    code, out, err = run(capsys, "plan", *shape, "--for", "hf", "--tp", "2")
    assert code == 2 and ("A plan for Hugging Face's Trainer (--for hf) runs DeepSpeed, and DeepSpeed plans have no "
                          "tensor parallelism (tp 2)") in err and err.rstrip().endswith("pin --tp 1, or plan without "
                                                                                     "--for hf."), err
    code, out, err = run(capsys, "tune", *shape, "--seq-len", "4096", "--memory-limit", "8GiB", "--for", "hf",
                         "--out", str(tmp_path / "no"))
    assert code == 2 and "does not fit" in err and "unpin" not in err, err


def test_explain_says_when_a_plan_was_edited_after_it_was_written(tmp_path, capsys):
    """The plan id a plan.yaml carries is its content's hash: an edit that leaves it makes the
    predicted figures those of the plan before the edit, and explain says so; an unedited plan reads
    back without a word."""
    import re
    import warnings as warns

    assert run(capsys, "tune", "--out", str(tmp_path / "out"))[0] == 0
    plan = tmp_path / "out" / "plan.yaml"
    with warns.catch_warnings():
        warns.simplefilter("error", DsautoWarning)
        assert run(capsys, "explain", str(plan))[0] == 0
    # a valid plan still, with another gradient bucket than the one its figures were priced with
    plan.write_text(re.sub(r"\nreduce_bucket_bytes: (\d+)\n", lambda m: f"\nreduce_bucket_bytes: {2 * int(m[1])}\n",
                           plan.read_text()))
    with pytest.warns(DsautoWarning, match=r"plan.yaml was edited after dsauto wrote it \(it carries plan id \w+, its "
                                           r"content is plan \w+\): the predicted time and memory below are those"):
        assert run(capsys, "explain", str(plan))[0] == 0


def test_warnings_say_whose_they_are():
    from dsauto.cli import _format_warning

    assert _format_warning("a key\nnot read", DsautoWarning, "/x/dsauto/spec/hf.py", 3) == \
        "dsauto: warning: a key\nnot read\n"
    # another package's warning (torch's, while a factory builds the model) is not presented as dsauto's
    line = _format_warning("`torch.x` is deprecated.\n  Use y.", FutureWarning,
                           "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", 12)
    assert line == "warning from torch: FutureWarning: `torch.x` is deprecated. Use y.\n"
    assert _format_warning("m", UserWarning, "/home/me/factory.py", 1) == "warning from factory: UserWarning: m\n"


def test_every_warning_of_dsauto_is_a_dsauto_warning():
    """dsauto's own warnings carry its category, so that they print as dsauto's and filter as one."""
    import ast

    root = Path(__file__).resolve().parent.parent / "dsauto"
    other = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warn"
                    and getattr(node.func.value, "id", "") == "warnings"):
                category = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "category"), None)
                if category is None or ast.unparse(category) != "DsautoWarning":
                    other.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not other, other


def test_each_command_names_the_file_kind_it_reads(tmp_path, capsys):
    assert main(["tune", "--model", "gpt-tiny", "--hardware", "cpu", "--out", str(tmp_path / "ds")]) == 0
    capsys.readouterr()
    code, _, err = run(capsys, "validate", str(tmp_path / "ds" / "plan.yaml"))
    assert code == 2 and "dsauto validate checks a ds_config.json" in err and "read by dsauto explain" in err
    code, _, err = run(capsys, "explain", str(tmp_path / "ds" / "megatron_args.txt"))
    assert code == 2 and "price it with dsauto plan --megatron-args" in err
    assert main(["tune", "--model", "gpt-tiny", "--hardware", "cpu", "--engine", "megatron",
                 "--out", str(tmp_path / "mg")]) == 0
    capsys.readouterr()
    code, _, err = run(capsys, "validate", str(tmp_path / "mg" / "ds_config.json"))
    assert code == 2 and "carries a megatron plan, which runs from megatron_args.txt" in err


def test_options_of_trials_without_trials_are_refused(tmp_path, capsys):
    code, _, err = run(capsys, "tune", "--model", "gpt-tiny", "--hardware", "cpu", "--script", "x.py", "--storage",
                       "sqlite:///s.db", "--trial-timeout", "5", "--out", str(tmp_path / "o"))
    assert code == 2 and err.strip() == (
        "dsauto: error: --script, --storage, --trial-timeout set how trials are measured, but no --trials were "
        "asked for; pass --trials N, or drop --script, --storage, --trial-timeout.")
    assert not (tmp_path / "o").exists()


def test_an_offload_nobody_asked_for_is_warned_of():
    """--offload auto offloads only what fits no other way, or runs faster so; a warning says so
    with its numbers, and pinning --offload (either way) is the user's answer, said by nothing."""
    one_gpu = ["plan", "--model", "llama3-8b", "--hardware", "h100-80gb", "--nodes", "1", "--gpus-per-node", "1",
               "--global-batch", "8"]
    with pytest.warns(DsautoWarning, match=r"the plan keeps its optimizer state in host memory \([0-9.]+ GiB a rank, "
                                           r"updated by the CPU in [0-9.]+ ms of its [0-9.]+ s step\): no plan that "
                                           r"keeps it on the device fits the 76\.6 GiB budget and runs faster; pin "
                                           r"--offload none to plan without offload, or --offload optimizer"):
        assert main(one_gpu) == 0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", DsautoWarning)
        assert main([*one_gpu, "--offload", "optimizer"]) == 0


def test_a_cp_neither_engine_runs_says_each_engines_reason(capsys):
    assert main(["tune", "--model", "llama3-8b", "--hardware", "h100-80gb", "--global-batch", "64", "--cp", "3",
                 "--out", "unused"]) == 2
    assert ("--cp 3 cannot run: DeepSpeed-Ulysses splits the 32 attention heads over cp 3, which does not divide them "
            "(DeepSpeed), and the sequence (2048 tokens) must split into 2 x cp = 6 equal chunks (Megatron-core); pin "
            "a cp that divides them, or leave --cp out.") in capsys.readouterr().err
