"""The examples run as written."""

import os
import subprocess
import sys
from pathlib import Path

from dsauto.profile.launch import free_port

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_plan_api_example(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "plan_api.py"), "--model", "gpt-tiny", "--hardware", "cpu",
         "--nodes", "1", "--gpus-per-node", "2", "--global-batch", "8", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, result.stderr
    assert "dsauto plan: gpt-tiny" in result.stdout and "next plans:" in result.stdout
    assert (tmp_path / "o" / "ds_config.json").exists()


def test_a_refused_plan_is_one_line_not_a_traceback(tmp_path):
    # a two-stage plan launched on one process: the plugin's refusal, as the example script prints it
    subprocess.run([sys.executable, "-m", "dsauto", "tune", "--model", "gpt-tiny", "--hardware", "cpu", "--nodes", "1",
                    "--gpus-per-node", "2", "--pp", "2", "--out", str(tmp_path)], check=True, capture_output=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = subprocess.run([sys.executable, str(EXAMPLES / "megatron" / "train_gpt.py"), "--plan",
                             str(tmp_path / "plan.yaml"), "--steps", "1"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 2
    assert "train_gpt.py: error (rank 0): The plan is for 2 ranks (tp=1 pp=2 dp=1) but torch.distributed has 1; " \
           "launch 2 processes or re-plan for 1 device." in result.stderr
    assert "Traceback" not in result.stderr


def test_the_deepspeed_hook_refuses_another_world_size_before_deepspeed_does(tmp_path):
    # DeepSpeed's own batch assertion would end the run with a traceback on every rank
    subprocess.run([sys.executable, "-m", "dsauto", "tune", "--model", "gpt-tiny", "--hardware", "cpu", "--nodes", "1",
                    "--gpus-per-node", "2", "--engine", "deepspeed", "--out", str(tmp_path)],
                   check=True, capture_output=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = subprocess.run([sys.executable, str(EXAMPLES / "deepspeed" / "train_gpt.py"), "--deepspeed_config",
                             str(tmp_path / "ds_config.json")], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 2
    assert "train_gpt.py: error (rank 0): The plan is for 2 ranks (tp=1 pp=1 dp=2) but this launch has 1; " \
           "launch 2 processes or re-plan for 1 device." in result.stderr
    assert "Traceback" not in result.stderr
