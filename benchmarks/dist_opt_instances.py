"""Megatron-core's partial distributed optimizer in the search: what it costs the search, and what the
cost model predicts for it.

1. The search alone (``Planner.search`` in this process, best of three) for the two cases of
   benchmarks/search_speed.py, with the instances pinned to 1 (``--dist-opt-instances 1``: the
   dimension off) and searched (the default), and the number of strategies of each space. Compare the
   two within one run: the machine's load moves both.
2. The predicted step and peak of llama2-7b with the distributed optimizer over every device of 4 and
   of 64 nodes of 8 H100s (tp 1 and 2, pp 1, micro-batch 1), in one instance and in one instance per
   node (the README's figures).

Run: python benchmarks/dist_opt_instances.py  (results: benchmarks/results/dist_opt_instances.md)
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

from dsauto.api import make_problem
from dsauto.cost.step import predict_step
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.search.planner import Planner
from dsauto.search.space import strategies

SEARCH_CASES = [
    ("gpt3-175b", dict(hardware="a100-80gb", nodes=128, global_batch=1536, seq_len=2048)),
    ("llama3-405b", dict(hardware="h100-80gb", nodes=2048, global_batch=2048, seq_len=8192)),
]
STEP_CASES = [(4, 256, 1), (64, 1024, 1), (64, 1024, 2)]  # (nodes, global batch, tp)
OUT = Path(__file__).resolve().parent / "results" / "dist_opt_instances.md"


def search_row(model: str, options: dict) -> str:
    cells = []
    for pin in (1, None):
        problem = make_problem(model, options["hardware"], nodes=options["nodes"], gpus_per_node=8,
                               global_batch=options["global_batch"], seq_len=options["seq_len"],
                               dist_opt_instances=pin)
        count = len(strategies(problem.model, problem.cluster, problem.train, problem.pins))
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            plan = Planner(problem.model, problem.cluster, problem.train, problem.pins).search()[0]
            best = min(best, time.perf_counter() - start)
        cells.append((count, best, plan))
    (n1, t1, _), (n2, t2, plan) = cells
    return (f"| {model} | {n1} | {t1:.2f} | {n2} | {t2:.2f} | {t2 / t1:.2f} | {plan.dims.describe()}, "
            f"{plan.dist_opt_instances} instance(s) |")


def step_rows(nodes: int, global_batch: int, tp: int) -> list[str]:
    problem = make_problem("llama2-7b", "h100-80gb", nodes=nodes, gpus_per_node=8, global_batch=global_batch,
                           seq_len=2048)
    dp = nodes * 8 // tp
    rows, flat = [], None
    for instances in (1, nodes):
        strategy = Strategy(dims=ParallelDims(dp=dp, tp=tp), zero_stage=1, micro_batch=1,
                            grad_accum=global_batch // dp, sequence_parallel=tp > 1, engine="megatron",
                            dist_opt_instances=instances)
        options = [LayerOption(checkpoint=False, shard_params=False, split=1)] * (problem.model.num_layers + 2)
        got = predict_step(problem.model, problem.cluster, problem.train, strategy, (problem.model.num_layers,),
                           options).prediction
        flat = flat or got
        rows.append(f"| {nodes} x 8 | tp {tp} dp {dp} | {instances} | {got.step_seconds:.4f} "
                    f"({got.step_seconds / flat.step_seconds - 1:+.1%}) | {got.exposed_comm_seconds * 1e3:.1f} | "
                    f"{got.peak_memory_bytes / 2**30:.1f} |")
    return rows


def main() -> None:
    lines = [
        "# Megatron-core's partial distributed optimizer: search cost and predictions",
        "",
        f"Command: `python benchmarks/dist_opt_instances.py` ({platform.machine()}, Python "
        f"{sys.version.split()[0]}; search alone: best of 3 in-process searches)",
        "",
        "| case | strategies, instances pinned to 1 | search s | strategies, searched | search s | ratio | plan |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [search_row(model, options) for model, options in SEARCH_CASES]
    lines += [
        "",
        "Predicted llama2-7b steps (bf16, 2048 tokens, flash attention, ZeRO 1, pp 1, micro-batch 1, no recompute):",
        "",
        "| H100 nodes | degrees | instances | step s (vs 1) | exposed comm ms | peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for case in STEP_CASES:
        lines += step_rows(*case)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
