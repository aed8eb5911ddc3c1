"""Wall time of whole `dsauto tune` commands (start-up included) on large clusters.

Targets: gpt3-175b on 128 x 8 a100-80gb in 10 s or less; a 126-layer, 16384-wide model
(llama3-405b) on 2048 x 8 h100-80gb in 60 s or less. Each command runs three times in a fresh
process; the median is recorded in benchmarks/results/search_speed.md.

The search alone (``Planner.search`` in this process, no start-up, best of three) is timed too:
its target is 2 s for each case on one core.

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
SEARCH_TARGET_SECONDS = 2.0


def search_seconds(args: str) -> float:
    """Best of three in-process ``Planner.search`` calls for the case's options (the search alone)."""
    from dsauto.api import make_problem
    from dsauto.search.planner import Planner

    option = dict(zip(*[iter(shlex.split(args))] * 2))
    problem = make_problem(option["--model"], option["--hardware"], nodes=int(option["--nodes"]),
                           gpus_per_node=int(option["--gpus-per-node"]),
                           global_batch=int(option["--global-batch"]), seq_len=int(option["--seq-len"]))
    walls = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        Planner(problem.model, problem.cluster, problem.train, problem.pins).search()
        walls.append(time.perf_counter() - started)
    return min(walls)


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
        search = search_seconds(args)
        ok = median <= target and search <= SEARCH_TARGET_SECONDS
        failed += not ok
        rows.append(f"| {name} | `dsauto tune {args}` | {median:.2f} | {min(walls):.2f} | {target:.0f} | "
                    f"{search:.2f} | {plan_line} | {'ok' if ok else 'FAIL'} |")
        print(rows[-1], flush=True)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    text = (
        "# Search speed: whole `dsauto tune` commands\n\n"
        f"Command: `python benchmarks/search_speed.py` ({REPEATS} fresh processes per case; {machine}; "
        f"search alone: best of {REPEATS} in-process searches, target {SEARCH_TARGET_SECONDS:.0f} s)\n\n"
        "| case | command | median wall s | min wall s | target s | search alone s | plan | |\n"
        "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    (Path(__file__).parent / "results" / "search_speed.md").write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
