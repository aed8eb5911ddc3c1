"""The command line: the main job end to end, and every bad input as one sentence with exit code 2."""

import json
import subprocess
import sys

import pytest
import yaml

from dsauto.cli import main
from dsauto.emit.plan_yaml import read_plan

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
    assert run(capsys, "tune", "--out", str(out_dir))[0] == 0
    code, out, _ = run(capsys, "explain", str(out_dir / "plan.yaml"))
    assert code == 0 and "dsauto plan: gpt-tiny" in out
    code, out, err = run(capsys, "validate", str(out_dir / "ds_config.json"))
    assert code == 0, err
    assert "DeepSpeed accepts" in out


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


BAD = [
    (lambda tmp: ["--model", "gpt-5"], r"Unknown model preset 'gpt-5'"),
    (lambda tmp: ["--hardware", "tpu-v9"], r"tpu-v9"),
    (lambda tmp: ["--model", str(tmp / "missing.yaml")], r"missing\.yaml"),
    (lambda tmp: ["--model", bad_model_yaml(tmp)], r"bad\.yaml"),
    (lambda tmp: ["--model", "llama2-70b", "--nodes", "1", "--gpus-per-node", "2", "--hardware",
                  "a100-40gb", "--global-batch", "2"], r"smallest plan needs about [0-9.]+ [GT]iB"),
    (lambda tmp: ["--model", odd_heads_yaml(tmp), "--tp", "4", "--gpus-per-node", "4"],
     r"6 attention heads are not divisible by TP 4"),
    (lambda tmp: ["--tp", "2", "--pp", "2", "--gpus-per-node", "6", "--hardware", "a100-80gb"],
     r"does not divide"),
    (lambda tmp: ["--memory-limit", "lots"], r"memory limit"),
    (lambda tmp: ["--nodes", "0"], r"positive"),
    (lambda tmp: ["--zero-stage", "3", "--pp", "2", "--gpus-per-node", "4", "--hardware", "a100-80gb"],
     r"ZeRO stage 3 cannot run with pipeline"),
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
