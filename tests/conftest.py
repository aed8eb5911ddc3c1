"""Test-wide settings: DeepSpeed runs on the CPU accelerator here."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
