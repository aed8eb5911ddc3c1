"""The examples run as written."""

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_plan_api_example(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "plan_api.py"), "--model", "gpt-tiny", "--hardware", "cpu",
         "--nodes", "1", "--gpus-per-node", "2", "--global-batch", "8", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, result.stderr
    assert "dsauto plan: gpt-tiny" in result.stdout and "next plans:" in result.stdout
    assert (tmp_path / "o" / "ds_config.json").exists()
