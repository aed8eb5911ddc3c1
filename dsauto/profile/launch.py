"""Launching measurement processes (profiling ranks, trial ranks) that never outlive dsauto.

A launcher (torchrun, DeepSpeed's) puts each rank in a session of its own, so killing the
launcher's process group does not reach the ranks, and a ``kill -9`` of dsauto would leave the
launcher, its ranks and their shared-memory buffers behind. Every such command therefore runs under
a small guard process (``python -m dsauto.profile.launch``), which

- asks the kernel for a signal when dsauto dies, however it dies (``prctl(PR_SET_PDEATHSIG)``), and
  checks its parent between waits in case the signal is missed;
- adopts every orphaned descendant (``prctl(PR_SET_CHILD_SUBREAPER)``), so that ranks whose launcher
  died are still its descendants;
- on that signal, on SIGTERM or SIGINT, and when the command ends, terminates every descendant (SIGTERM,
  then SIGKILL after a grace period), removes DeepSpeed's shared-memory buffers of the job's port,
  and exits with the command's exit code (128 + the signal when a signal ended it).

Each launch is also registered under the user's temporary folder with a token that every
descendant carries in its environment (``DSAUTO_LAUNCH``). Should the guard itself be killed, the
next dsauto run finds the launch whose owner and guard are gone (:func:`clean_stale_launches`), ends
the processes carrying its token and removes its buffers.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LAUNCH_ENV = "DSAUTO_LAUNCH"
"""Environment variable carrying the launch's token to every process it starts."""
GRACE_SECONDS = 5.0
"""Time descendants get to exit after SIGTERM before they are killed."""
SHARED_MEMORY = Path("/dev/shm")
"""Where DeepSpeed's CPU all-reduce keeps its per-rank buffers."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PR_SET_CHILD_SUBREAPER = 36


def free_port() -> int:
    """A TCP port free on every interface of this machine, for a launch's rendezvous: node 0's store
    binds them all, and two launches at once must not meet."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def registry() -> Path:
    """The folder where this user's running launches are registered."""
    return Path(tempfile.gettempdir()) / f"dsauto-{os.getuid()}" / "launches"


def all_reduce_buffer(addr: str, port: int | str, rank: int | str) -> Path:
    """The shared-memory buffer DeepSpeed's CPU all-reduce makes for ``rank`` of a one-node job with
    master address ``addr`` and port ``port`` (about 66 MiB, named after the user too:
    ops/csrc/cpu/comm/shm.cpp, ``shm_initialize``; ``"*"`` in any part makes a glob pattern)."""
    return SHARED_MEMORY / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def all_reduce_buffers(port: int | str = "*") -> list[Path]:
    """The CPU all-reduce buffers of this user's jobs with master port ``port`` (default: every job)."""
    return list(SHARED_MEMORY.glob(all_reduce_buffer("*", port, "*").name))


def remove_shared_memory(port: int) -> None:
    """Delete the shared-memory buffers DeepSpeed's CPU all-reduce made for a job with master port
    ``port``. It creates one per rank (:func:`all_reduce_buffer`) and never unlinks them, so without
    this every job, each on its own port, would leave its ranks' buffers in memory for good."""
    for path in all_reduce_buffers(port):
        path.unlink(missing_ok=True)


def launch(command: Sequence[str], env: dict[str, str], port: int | None = None, **popen: Any) -> subprocess.Popen:
    """Start ``command`` under a guard (see the module doc) in a session of its own and return the
    guard's process; ``port`` is the job's master port (its shared-memory buffers are removed at
    the end). ``popen`` goes to :class:`subprocess.Popen` (stdout, stderr, text, ...)."""
    clean_stale_launches()
    token = uuid.uuid4().hex
    entry = registry() / f"{token}.json"
    guard = [sys.executable, "-m", "dsauto.profile.launch", "--parent", str(os.getpid()), "--entry", str(entry)]
    if port is not None:
        guard += ["--port", str(port)]
    process = subprocess.Popen([*guard, "--", *command], env={**env, LAUNCH_ENV: token},
                               start_new_session=True, **popen)
    _register(entry, {"owner": os.getpid(), "guard": process.pid, "port": port})
    return process


def stop(process: subprocess.Popen, grace_seconds: float = 2 * GRACE_SECONDS) -> None:
    """Stop a launch: SIGTERM to the guard's process group (the guard then ends every descendant),
    SIGKILL to the group if it is still there after ``grace_seconds``."""
    for sig, grace in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def clean_stale_launches() -> list[str]:
    """End what launches of dead dsauto runs left (processes carrying their token, shared-memory
    buffers) and unregister them; returns one line per launch cleaned."""
    cleaned = []
    folder = registry()
    for entry in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            info = json.loads(entry.read_text())
        except (OSError, ValueError):
            entry.unlink(missing_ok=True)
            continue
        if process_alive(info.get("owner")) or process_alive(info.get("guard")):
            continue
        ended = _end_processes(_carrying(entry.stem))
        if info.get("port"):
            remove_shared_memory(int(info["port"]))
        entry.unlink(missing_ok=True)
        cleaned.append(f"cleaned up launch {entry.stem[:8]} of dead dsauto pid {info.get('owner')}: "
                       f"{ended} processes ended")
    return cleaned


def _register(entry: Path, info: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # without a registry only the guard cleans up
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.write_text(json.dumps({**info, "started": time.time()}))


def process_alive(pid: Any) -> bool:
    """Whether ``pid`` names a live process of this machine (a zombie is not)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    import psutil

    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def _carrying(token: str) -> list[Any]:
    """This user's processes whose environment carries ``token``."""
    import psutil

    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.pid != os.getpid() and process.environ().get(LAUNCH_ENV) == token:
                found.append(process)
    return found


def _end_processes(processes: list[Any]) -> int:
    """SIGTERM, then SIGKILL after the grace period; the number of processes that were running."""
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=GRACE_SECONDS)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=GRACE_SECONDS)
    return len(processes)


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _guard(parent: int, entry: Path, port: int | None, command: list[str]) -> int:
    """The guard's life: run ``command``, end every descendant when it ends or dsauto dies."""
    import psutil

    stopping: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    child = None
    if os.getppid() == parent:  # else dsauto died before the death signal was armed
        try:
            child = subprocess.Popen(command)
        except OSError as exc:
            print(f"dsauto: cannot start {command[0]}: {exc.strerror or exc}", file=sys.stderr)
            return 127
    code = 128 + signal.SIGTERM
    while child is not None:
        try:
            code = child.wait(timeout=0.5)
            code = 128 - code if code < 0 else code
            break
        except subprocess.TimeoutExpired:
            pass
        if stopping or os.getppid() != parent:
            code = 128 + (stopping[0] if stopping else signal.SIGTERM)
            break
    me = psutil.Process()
    with contextlib.suppress(psutil.Error):
        _end_processes(me.children(recursive=True))
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:  # reap the adopted orphans
            pass
    if port is not None:
        remove_shared_memory(port)
    entry.unlink(missing_ok=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dsauto.profile.launch",
                                     description="run a command that dies with dsauto (internal)")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--entry", type=Path, required=True)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return _guard(args.parent, args.entry, args.port, command)


if __name__ == "__main__":
    sys.exit(main())
