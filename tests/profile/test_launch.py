"""Launched measurement processes die with dsauto, even on SIGKILL: the guard ends every descendant
(also those a launcher put in sessions of their own) and removes the job's shared memory; what a
killed guard leaves, the next launch cleans up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from dsauto.profile import launch
from dsauto.profile.launch import LAUNCH_ENV, clean_stale_launches

HANG_GUARD_SECONDS = 300  # only a broken guard ever waits this long
FAKE_PORT = 100_000 + 2 * os.getpid()
"""Beyond any TCP port: no real job's shared-memory buffers carry it (leftovers of others do carry
real ports, and must not be mistaken for this test's)."""

# A "launcher" that starts two workers in sessions of their own (as torchrun does), makes a
# shared-memory buffer named like DeepSpeed's, says so, and waits.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    from dsauto.profile.launch import all_reduce_buffer
    port = sys.argv[1]
    for rank in range(2):
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
        all_reduce_buffer("127.0.0.1", port, rank).write_bytes(b"x")
    print("started", flush=True)
    time.sleep(3600)
""")

# dsauto's side: launch the launcher under the guard, report the guard's pid, then wait to be killed.
DRIVER = textwrap.dedent("""
    import os, subprocess, sys
    from dsauto.profile.launch import launch
    process = launch([sys.executable, "-c", sys.argv[1], sys.argv[2]], dict(os.environ), int(sys.argv[2]),
                     stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "started"
    print(process.pid, flush=True)
    process.wait()
""")


def _carrying(token_holder_env: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(LAUNCH_ENV) == token_holder_env:
                found.append(p)
        except psutil.Error:
            pass
    return found


@pytest.fixture
def started(tmp_path):
    """Starts the driver (dsauto's side) and its launch; whatever a failing test leaves is ended."""
    launched = []

    def start(port: int):
        env = {**os.environ, "TMPDIR": str(tmp_path)}  # a registry of this test's own
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, LAUNCHER, str(port)], stdout=subprocess.PIPE,
                                  text=True, env=env)
        launched.append(driver)
        guard = psutil.Process(int(driver.stdout.readline()))
        token = guard.environ()[LAUNCH_ENV]
        launched.append(token)
        workers = _carrying(token)
        for _ in range(int(HANG_GUARD_SECONDS / 0.05)):  # a worker may be mid-exec: look again
            if len(workers) == 4:  # the guard, the launcher and its two workers
                break
            time.sleep(0.05)
            workers = _carrying(token)
        assert len(workers) == 4, workers
        return driver, guard, token, workers

    yield start
    for item in launched:
        if isinstance(item, str):
            for process in _carrying(item):
                process.kill()
        else:
            item.kill()
            item.wait()


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or sys.platform != "linux", reason="Linux only")
def test_a_sigkilled_dsauto_takes_its_launch_with_it(tmp_path, started):
    port = FAKE_PORT
    driver, _, _, workers = started(port)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    _, alive = psutil.wait_procs(workers, timeout=HANG_GUARD_SECONDS)
    assert alive == []
    assert not launch.all_reduce_buffers(port)
    assert not list((tmp_path / f"dsauto-{os.getuid()}" / "launches").glob("*.json"))


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or sys.platform != "linux", reason="Linux only")
def test_what_a_killed_guard_leaves_is_cleaned_by_the_next_launch(tmp_path, monkeypatch, started):
    port = FAKE_PORT + 1
    driver, guard, token, _ = started(port)
    guard.send_signal(signal.SIGKILL)  # the guard first, then dsauto: nobody is left to clean up
    guard.wait(HANG_GUARD_SECONDS)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert len(_carrying(token)) == 3 and launch.all_reduce_buffers(port)
    monkeypatch.setattr(launch, "registry", lambda: tmp_path / f"dsauto-{os.getuid()}" / "launches")
    (line,) = clean_stale_launches()
    assert line.startswith(f"cleaned up launch {token[:8]}") and "3 processes ended" in line
    assert _carrying(token) == []
    assert not launch.all_reduce_buffers(port)


def test_the_guard_passes_the_exit_code_on_and_unregisters(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "registry", lambda: tmp_path / "launches")
    process = launch.launch([sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ))
    assert process.wait(timeout=HANG_GUARD_SECONDS) == 3
    killed = launch.launch([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                           dict(os.environ))
    assert killed.wait(timeout=HANG_GUARD_SECONDS) == 128 + signal.SIGKILL
    assert list((tmp_path / "launches").iterdir()) == []


def test_a_registry_entry_of_a_live_run_is_left_alone(tmp_path, monkeypatch):
    folder = tmp_path / "launches"
    folder.mkdir()
    (folder / "abc.json").write_text(json.dumps({"owner": os.getpid(), "guard": os.getpid(), "port": None}))
    monkeypatch.setattr(launch, "registry", lambda: folder)
    assert clean_stale_launches() == [] and (folder / "abc.json").exists()
