"""Published runs held out from every fit, priced through dsauto's command line as a user would.

Usage: python benchmarks/holdout.py            (writes benchmarks/results/holdout.md)

benchmarks/holdout_runs.yaml holds training runs published with their whole configuration that
benchmarks/fidelity.py never fitted on: they were gathered after the presets' constants were
written, picked for how completely their configuration is published, not for how well dsauto
prices them. Each record carries the ``dsauto plan`` options that pin the published configuration
(parallel degrees, micro-batch, recomputation, dtype, layout, attention kernel, FP8); this script
parses them with the command line's own parser (:func:`dsauto.cli.build_parser`) and solves the
problem the command would (:func:`dsauto.cli.problem_from_args`), so the numbers are those a user
gets. A configuration the memory model refuses is priced again under a generous limit, since it
ran, and says so; its published memory, where the source gives one, is set beside the predicted peak.

The headline covers the runs dsauto prices as they ran, on a GPU a preset describes; runs of other
stacks (PyTorch DDP, ZeroRedundancyOptimizer, FSDP) are priced on the Megatron-core sharding they
match, as benchmarks/fidelity.py maps them. A record with
``apart`` (a GPU no preset describes, such as the 96 GB H100 at 500 W, or a setting priced with a
stand-in, such as PyTorch's per-operator selective checkpointing) is priced and reported apart with
that reason; a configuration dsauto refuses is reported with its refusal.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent
if str(ROOT.parent) not in sys.path:
    sys.path.insert(0, str(ROOT.parent))

from dsauto.api import find_plans  # noqa: E402
from dsauto.cli import build_parser, problem_from_args  # noqa: E402
from dsauto.errors import DsautoError  # noqa: E402
from dsauto.plan import Plan  # noqa: E402
from dsauto.units import GiB  # noqa: E402
from fidelity import GENEROUS_BYTES, configuration_label  # noqa: E402

RUNS = ROOT / "holdout_runs.yaml"
MODELS = ROOT / "holdout_models"
CONFIGS = ROOT / "hf_configs"
RESULTS = ROOT / "results" / "holdout.md"


@dataclass(frozen=True)
class Priced:
    """One held-out run as dsauto prices it."""

    record: dict
    plan: Plan | None
    fits: bool
    refusal: str | None
    warned: tuple[str, ...]

    @property
    def error(self) -> float | None:
        if self.plan is None:
            return None
        return self.plan.prediction.step_seconds / self.record["published_step_seconds"] - 1


def command(record: dict) -> list[str]:
    """The ``dsauto plan`` arguments of a record: its model, GPU and node count, and its pins."""
    model = record["model"]
    # a model the fidelity benchmark also prices (benchmarks/hf_configs/) is read from there
    path = MODELS / model if (MODELS / model).exists() or not (CONFIGS / model).exists() else CONFIGS / model
    return ["plan", "--model", str(path) if path.suffix == ".json" else model, "--hardware", record["hardware"],
            "--nodes", str(record["gpus"] // record["gpus_per_node"]), "--gpus-per-node",
            str(record["gpus_per_node"]), *shlex.split(record["options"])]


def price(record: dict) -> Priced:
    """The plan ``dsauto plan`` returns for the record's command, or why it refuses it."""
    args = build_parser().parse_args(command(record))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            problem = problem_from_args(args)
        except DsautoError as error:
            return Priced(record, None, False, str(error), ())
        try:
            return Priced(record, find_plans(problem)[0], True, None, _said(caught))
        except DsautoError as error:
            if "does not fit" not in str(error):
                return Priced(record, None, False, str(error), _said(caught))
        generous = dataclasses.replace(problem, cluster=dataclasses.replace(
            problem.cluster, memory_limit_bytes=GENEROUS_BYTES))
        try:
            return Priced(record, find_plans(generous)[0], False, None, _said(caught))
        except DsautoError as error:
            return Priced(record, None, False, str(error), _said(caught))


def _said(caught: Sequence[warnings.WarningMessage]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(str(w.message) for w in caught))


def _headline(priced: Sequence[Priced]) -> tuple[float, float, int]:
    errors = [abs(p.error) for p in priced if p.error is not None]
    return (statistics.median(errors), max(errors), len(errors)) if errors else (float("nan"), float("nan"), 0)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _memory(p: Priced) -> str:
    if p.plan is None:
        return "-"
    predicted = f"{p.plan.prediction.peak_memory_bytes / GiB:.1f} GiB"
    published = p.record.get("published_memory")
    return f"{predicted} (published {published})" if published else predicted


def report(priced: Sequence[Priced], seconds: float) -> str:
    matched = [p for p in priced if not p.record.get("apart")]
    other = [p for p in priced if p.record.get("apart")]
    median, worst, runs = _headline(matched)
    lines = [
        "# Published runs held out from every fit",
        "",
        f"Command: `python benchmarks/holdout.py` ({seconds:.0f} s on two cores). Data: benchmarks/holdout_runs.yaml "
        "(every number as published, with its source; derived step times carry their formula). Models that are not "
        "presets: benchmarks/holdout_models/ (and benchmarks/hf_configs/ for those benchmarks/fidelity.py prices too).",
        "",
        f"`holdout_median_error={median:.1%} holdout_max_error={worst:.1%} runs={runs}`",
        "",
        "None of these runs was fitted on: the presets' constants come from benchmarks/fidelity.py's runs, and these "
        "were gathered afterwards, picked for how completely their configuration is published. Each is priced with "
        "the `dsauto plan` options in its record, parsed by the command line's own parser, as a user would type them. "
        "The headline covers the runs priced as they ran on a GPU a preset describes; the others are reported apart "
        "with the reason. Runs of other stacks are priced on the engine whose sharding they match, as "
        "benchmarks/fidelity.py maps them: PyTorch DDP as Megatron-core with ZeRO 0, DDP with "
        "ZeroRedundancyOptimizer as ZeRO 1, FSDP as ZeRO 3 (Megatron-FSDP). Error = predicted / published step "
        "time - 1.",
        "",
        "## Per source",
        "",
        "| source | device | runs priced | median abs error | max abs error | refused |",
        "|---|---|---|---|---|---|",
    ]
    for key in dict.fromkeys((p.record["source_key"], p.record["hardware"], bool(p.record.get("apart")))
                             for p in priced):
        group = [p for p in priced if (p.record["source_key"], p.record["hardware"],
                                       bool(p.record.get("apart"))) == key]
        m, w, n = _headline(group)
        device = f"{key[1]} (apart)" if key[2] else key[1]
        refused = sum(p.plan is None for p in group)
        lines.append(f"| {key[0]} | {device} | {n} | {m:.1%} | {w:.1%} | {refused} |" if n else
                     f"| {key[0]} | {device} | 0 | - | - | {refused} |")
    if other:
        m, w, n = _headline(other)
        lines += ["", f"Apart from the headline (each run's reason in its notes): median {m:.1%}, max {w:.1%} over "
                  f"{n} runs."]
    lines += ["", "## Runs", "",
              "| id | device | configuration | published | published s | predicted s | error | memory | notes |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in priced:
        r = p.record
        notes = [] if p.fits or p.plan is None else ["over the memory budget: priced under a generous limit"]
        notes += [f"refused: {p.refusal}"] if p.refusal else []
        notes += [f"apart: {r['apart']}"] if r.get("apart") else []
        notes += list(p.warned)
        configuration = "-" if p.plan is None else configuration_label(p.plan)
        predicted = "-" if p.plan is None else f"{p.plan.prediction.step_seconds:.3g}"
        lines.append(f"| {r['id']} | {r['hardware']} | {configuration} | {r['published']} | "
                     f"{r['published_step_seconds']:.3g} | {predicted} | {_percent(p.error)} | {_memory(p)} | "
                     f"{'; '.join(notes)} |")
    lines += ["", "## Sources", ""]
    for citation in dict.fromkeys(p.record["citation"] for p in priced):
        lines.append(f"- {citation}")
    lines += ["", "## Commands", "", "Each run's command (run from the repository root):", ""]
    lines += [f"- {p.record['id']}: `dsauto {shlex.join(command(p.record))}`" for p in priced]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Published runs held out from every fit, priced as a user would.")
    parser.add_argument("--only", default="", help="comma-separated run ids to price (no results written)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    records = yaml.safe_load(RUNS.read_text())
    only = {i for i in args.only.split(",") if i}
    if only:
        records = [r for r in records if r["id"] in only]
    priced = []
    for i, record in enumerate(records, 1):
        p = price(record)
        priced.append(p)
        print(f"[{i}/{len(records)}] {record['id']:<48} {_percent(p.error):>8}"
              + ("" if p.fits or p.plan is None else "  (over the memory budget)")
              + (f"  refused: {p.refusal}" if p.refusal else ""), flush=True)
    median, worst, runs = _headline([p for p in priced if not p.record.get("apart")])
    print(f"holdout_median_error={median:.1%} holdout_max_error={worst:.1%} runs={runs}")
    if not only:
        RESULTS.write_text(report(priced, time.perf_counter() - started))
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
