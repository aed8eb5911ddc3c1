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
    for path in set(all_reduce_buffers()) - _buffers_before_the_tests:
        path.unlink(missing_ok=True)
