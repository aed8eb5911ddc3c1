"""Test-wide settings: DeepSpeed runs on the CPU accelerator here; the shared-memory buffers its CPU
all-reduce leaves behind are removed after each test."""

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

@pytest.fixture(scope="session")
def _buffers_before_the_tests() -> set:
    from dsauto.profile.launch import all_reduce_buffers

    return set(all_reduce_buffers())


@pytest.fixture(autouse=True)
def _remove_deepspeed_buffers(_buffers_before_the_tests):
    """Launches outside dsauto's guard (the tests' own DeepSpeed launcher and torchrun runs) leave
    DeepSpeed's buffers in /dev/shm: without this a run of the suite leaves gigabytes there, and the
    host memory that later trials and profiles check for runs out. After each test, the buffers made
    since the tests began (by it or by a module's fixture, whose launches have ended) are removed;
    those that were there before are not touched."""
    from dsauto.profile.launch import all_reduce_buffers

    yield
    made = set(all_reduce_buffers()) - _buffers_before_the_tests
    for path in made - (_mapped_by_live_processes(made) if made else set()):
        path.unlink(missing_ok=True)


def _mapped_by_live_processes(made: set) -> set:
    """Those of the buffers ``made`` that some running process maps: the buffers of a job still
    running, which may be another session's (two runs of the suite at once must not pull each
    other's buffers away while their ranks are still opening them). Matched by name, wherever the
    shared-memory folder's path resolves."""
    from pathlib import Path

    names = {path.name: path for path in made}
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process has gone, or is not ours to read
            continue
        for line in text.splitlines():
            name = line.rsplit("/", 1)[-1].removesuffix(" (deleted)")
            if name in names:
                mapped.add(names[name])
    return mapped
