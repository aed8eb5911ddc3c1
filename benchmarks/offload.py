"""Offload: the host optimizer against what the cost model assumes, and what offload costs the search.

1. Times one Adam update of 2^24 fp32 host parameters with DeepSpeedCPUAdam (built on first use if
   needed: minutes) and with torch's AdamW, on this process's threads, against the bound the cost
   model uses without a profile: the hardware preset's host DRAM bandwidth over 30 bytes of traffic
   per parameter (dsauto/cost/offload.py), for one rank alone on the host.
2. Times the search alone (``Planner.search``, best of ``REPEATS``, interleaved) for the two cases of
   benchmarks/search_speed.py with offload left to the search (its post-pass over strategies that fit
   nowhere) and with ``--offload none``, in the same process, so that the difference is the post-pass.

Results in benchmarks/results/offload.md.

Run: OMP_NUM_THREADS=1 python benchmarks/offload.py [--hardware cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from dsauto.api import make_problem
from dsauto.cost.offload import CPU_ADAM_BYTES_PER_PARAM
from dsauto.profile import cpu_optimizer
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_hardware

sys.path.insert(0, str(Path(__file__).parent))
from search_speed import CASES  # noqa: E402  (the same two cases)

REPEATS = 4


def host_optimizer_rows(bound: float) -> list[str]:
    ds_seconds, ds_name = cpu_optimizer.measure_cpu_optimizer(2**24, build=True)
    # Megatron-core's host optimizer, and DeepSpeed's stand-in where its extension is not built
    torch_seconds, torch_name = cpu_optimizer.measure_cpu_optimizer(2**24, engine="megatron")
    return [f"| {name} | {seconds * 1e9:.2f} | {1 / seconds:.3g} | {1 / seconds / bound:.0%} |"
            for name, seconds in ((ds_name, ds_seconds), (torch_name, torch_seconds))]


def search_rows() -> list[str]:
    rows = []
    for name, _, args in CASES:
        option = dict(zip(*[iter(shlex.split(args))] * 2))
        problem = make_problem(option["--model"], option["--hardware"], nodes=int(option["--nodes"]),
                               gpus_per_node=int(option["--gpus-per-node"]),
                               global_batch=int(option["--global-batch"]), seq_len=int(option["--seq-len"]))
        walls: dict[str, list[float]] = {"auto": [], "none": []}
        plans = {}
        for _ in range(REPEATS):
            for label, pins in (("auto", problem.pins), ("none", dataclasses.replace(problem.pins, offload="none"))):
                started = time.perf_counter()
                plans[label] = Planner(problem.model, problem.cluster, problem.train, pins).search()[0]
                walls[label].append(time.perf_counter() - started)
        plan = plans["auto"]
        rows.append(f"| {name} | {min(walls['auto']):.2f} | {min(walls['none']):.2f} | "
                    f"{plan.engine} {plan.dims.describe()} ZeRO {plan.zero_stage}, offload {plan.offload} |")
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hardware", default="cpu", help="preset whose host bandwidth bounds the update")
    args = parser.parse_args()
    hardware = load_hardware(args.hardware)
    bound = hardware.host_memory_bandwidth_gbps * 1e9 / CPU_ADAM_BYTES_PER_PARAM
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads "
               f"{torch.get_num_threads()}, Python {platform.python_version()}")
    lines = [
        "# Offload: the host optimizer and the search",
        "",
        f"Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python benchmarks/offload.py "
        f"--hardware {args.hardware}` ({machine})",
        "",
        "## The host optimizer",
        "",
        f"The cost model's bound without a profile: the `{args.hardware}` preset's host DRAM bandwidth "
        f"{hardware.host_memory_bandwidth_gbps:g} GB/s / {CPU_ADAM_BYTES_PER_PARAM} bytes per parameter = "
        f"{bound:.3g} parameters/s for one rank alone on the host (a plan divides it among a node's ranks). "
        "Above 100%, the preset's bandwidth is below what this machine streams (the GPU presets give their "
        "DRAM's peak; the cpu preset's figure is a rough one).",
        "",
        "| optimizer | ns per parameter | parameters/s | of the bound |",
        "|---|---|---|---|",
        *host_optimizer_rows(bound),
        "",
        "## The search alone, with and without the offload post-pass",
        "",
        f"Best of {REPEATS} in-process searches each, interleaved (the machine's load moves both alike).",
        "",
        "| case | offload searched s | --offload none s | plan |",
        "|---|---|---|---|",
        *search_rows(),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    (Path(__file__).parent / "results" / "offload.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
