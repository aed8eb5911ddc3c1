"""The command line checks everything before it works: plain configs validate, configs that
contradict their own plan do not, limits are printed back in bytes, a closed pipe is no traceback,
one tune writes into a folder at a time, and trial options are refused before any profiling."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsauto.cli import main
from dsauto.emit.artifacts import folder_lock

HANG_GUARD_SECONDS = 600  # only a hung command reaches it

# Another process holding the lock of the folder it is given, until it is killed.
HOLDER = ("import sys, time\nfrom dsauto.emit.artifacts import folder_lock\n"
          "with folder_lock(sys.argv[1], 'x'):\n    print('held', flush=True)\n    time.sleep(600)\n")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error(err: str) -> str:
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("dsauto: error:")]
    return line


def test_a_plain_two_rank_deepspeed_config_is_valid(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
                                "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}))
    code, out, err = run(capsys, "validate", str(path))
    assert code == 0, err
    assert "DeepSpeed accepts this config (data-parallel size 2, from its batch keys)" in out
    assert run(capsys, "validate", str(path), "--world-size", "2")[0] == 0
    code, _, err = run(capsys, "validate", str(path), "--world-size", "3")
    assert code == 2 and "4 != 1 * 2 * 3" in one_error(err)
    path.write_text(json.dumps({"train_batch_size": 5, "train_micro_batch_size_per_gpu": 2,
                                "gradient_accumulation_steps": 1}))
    code, _, err = run(capsys, "validate", str(path))
    assert code == 2 and "train_batch_size 5 is not a multiple of" in one_error(err)


@pytest.mark.parametrize("change, phrase", [
    (lambda c: c["zero_optimization"].update(stage=3), "zero_optimization.stage is 3 but the plan was made for ZeRO stage"),
    (lambda c: c.update(bf16={"enabled": True}), "the config trains in bf16"),
    (lambda c: c.update(train_batch_size=64), "train_batch_size is 64 but the plan's global_batch is 8"),
])
def test_a_config_contradicting_its_own_plan_is_refused(tmp_path, capsys, change, phrase):
    assert run(capsys, "tune", "--engine", "deepspeed", "--out", str(tmp_path / "out"))[0] == 0
    config = json.loads((tmp_path / "out" / "ds_config.json").read_text())
    change(config)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(config))
    for command in ("validate", "explain"):
        code, _, err = run(capsys, command, str(path))
        assert code == 2 and phrase in one_error(err) and "contradicts its own 'dsauto' block" in err


def test_the_memory_limit_needs_a_unit_and_is_printed_back_in_bytes(capsys):
    code, _, err = run(capsys, "plan", "--memory-limit", "80")
    assert code == 2 and "'80' has no unit" in one_error(err)
    for text in ("4G", "4GiB"):
        code, _, err = run(capsys, "plan", "--memory-limit", text)
        assert code == 0 and f"memory limit {text} = 4294967296 bytes (4.0 GiB) per device" in err
    code, _, err = run(capsys, "plan", "--memory-limit", "4GB")
    assert code == 0 and "memory limit 4GB = 4000000000 bytes" in err


def test_a_reader_that_leaves_early_gets_no_traceback_and_the_artifacts_are_written(tmp_path):
    # `dsauto tune ... | head -1`: the pipe closes while dsauto is still printing.
    command = [sys.executable, "-c", "import sys; from dsauto.cli import main; sys.exit(main(sys.argv[1:]))",
               "tune", "--top", "3", "--out", str(tmp_path / "out")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.readline()
    process.stdout.close()
    _, err = process.communicate(timeout=HANG_GUARD_SECONDS)
    assert process.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ds_config.json", "megatron_args.txt",
                                                                    "plan.png", "plan.yaml"]


def test_one_tune_writes_into_a_folder_at_a_time(tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code, _, err = run(capsys, "tune", "--out", str(out))
        assert code == 2 and f"Another dsauto process (pid {holder.pid}) is using {out}" in one_error(err)
    finally:
        holder.kill()
        holder.wait()
    assert run(capsys, "tune", "--out", str(out))[0] == 0
    with folder_lock(out, "x"):
        pass


@pytest.mark.parametrize("argv, message", [
    (["--trials", "-1"], "Argument --trials: expected a whole number from 0 to 10000"),
    (["--trials", "1", "--trial-timeout", "nan"], "Argument --trial-timeout: expected seconds above 0"),
    (["--trials", "1", "--script", "no-such-train.py"], "The training script no-such-train.py does not exist"),
    (["--trials", "1", "--script", "examples/deepspeed/train_gpt.py", "--script-args", "'open"],
     "Cannot split --script-args"),
    (["--trials", "1", "--storage", "nosuchdb://x"], "Cannot open the study storage nosuchdb://x"),
    (["--trials", "2", "--model", "llama3-8b", "--hardware", "h100-80gb"], "of host memory each would have"),
    (["--trials", "1", "--nodes", "2"], "A trial over 2 nodes starts torchrun on every node"),
    (["--trials", "1", "--nodes", "2", "--master-addr", "n0"], "pass --storage with a database every node reaches"),
    (["--master-addr", "n0"], "--master-addr places the ranks of trials on several nodes, but no --trials"),
])
def test_trial_options_are_refused_before_any_profiling(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The machine as the memory check sees it: CPU ranks and 16 GiB available, whatever runs the test.
    monkeypatch.setattr("dsauto.profile.resources.ranks_on_cpu", lambda: True)
    monkeypatch.setattr("dsauto.profile.resources.available_memory_bytes", lambda: 16 * 2**30)
    profiles, out = tmp_path / "profiles", tmp_path / "out"
    code, _, err = run(capsys, "tune", *argv, "--profile-dir", str(profiles), "--out", str(out))
    assert code == 2 and message in one_error(err)
    assert not profiles.exists() and not out.exists()
