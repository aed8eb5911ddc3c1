"""Multi-rank launches of the tests under dsauto's launch guard (dsauto.profile.launch): a run past its
(generous, loaded-machine) limit is stopped with all its ranks, not left computing beside the tests
that follow, as ``subprocess.run(timeout=...)`` leaves them (it kills the launcher alone)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from dsauto.profile.launch import launch, stop

LIMIT_SECONDS = 900
"""A launch's limit: about ten times what the slowest takes alone on two cores."""


def guarded_run(command: Sequence[str], env: dict[str, str], port: int, cwd: Path | None = None,
                timeout: float = LIMIT_SECONDS) -> subprocess.CompletedProcess:
    """Runs ``command`` (a launcher and its ranks, ``port`` its master port) to the end, its output
    captured; stops every rank and raises TimeoutExpired past ``timeout`` seconds."""
    process = launch(list(command), {**os.environ, **env}, port, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True, cwd=cwd)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(process)
        raise
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)
