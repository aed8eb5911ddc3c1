"""Wall time of whole `dsauto tune` commands (start-up included) on large clusters.

Targets: gpt3-175b on 128 x 8 a100-80gb in 10 s or less; a 126-layer, 16384-wide model
(llama3-405b) on 2048 x 8 h100-80gb in 60 s or less. Each command runs three times in a fresh
process; the median is recorded in benchmarks/results/search_speed.md.

Run: python benchmarks/search_speed.py
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [
    ("gpt3-175b", 10.0, "--model gpt3-175b --hardware a100-80gb --nodes 128 --gpus-per-node 8 "
                        "--global-batch 1536 --seq-len 2048"),
    ("llama3-405b", 60.0, "--model llama3-405b --hardware h100-80gb --nodes 2048 --gpus-per-node 8 "
                          "--global-batch 2048 --seq-len 8192"),
]
REPEATS = 3


def main() -> int:
    rows, failed = [], 0
    for name, target, args in CASES:
        walls = []
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, "-m", "dsauto", "tune", *shlex.split(args), "--out", out]
            for _ in range(REPEATS):
                started = time.perf_counter()
                result = subprocess.run(command, capture_output=True, text=True)
                walls.append(time.perf_counter() - started)
                if result.returncode != 0:
                    print(result.stderr, file=sys.stderr)
                    return 1
        plan_line = next(line for line in result.stdout.splitlines() if "degrees" in line).strip()
        median = statistics.median(walls)
        ok = median <= target
        failed += not ok
        rows.append(f"| {name} | `dsauto tune {args}` | {median:.2f} | {min(walls):.2f} | {target:.0f} | "
                    f"{plan_line} | {'ok' if ok else 'FAIL'} |")
        print(rows[-1], flush=True)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    text = (
        "# Search speed: whole `dsauto tune` commands\n\n"
        f"Command: `python benchmarks/search_speed.py` ({REPEATS} fresh processes per case; {machine})\n\n"
        "| case | command | median wall s | min wall s | target s | plan | |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    (Path(__file__).parent / "results" / "search_speed.md").write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
