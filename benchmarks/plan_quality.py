"""Plan quality: is the plan ``dsauto tune --trials`` picks the truly fastest, and how much faster is it
than DeepSpeed configured by hand? Two CPU ranks, under a per-rank memory limit that forces trade-offs.

    python benchmarks/plan_quality.py            # about 35 minutes, 9 of them DeepSpeed's autotuner
    python benchmarks/plan_quality.py --quick    # fewer steps per measurement, for a smoke run

1. Profiles the model on 2 ranks (``dsauto profile``).
2. Tunes: the search plus an Optuna study of ``--trials`` real measurements (``dsauto.refine``).
3. Oracle: measures *every* candidate of the tune's space, the tuned plan among them, in one pass;
   the grid's fastest feasible plan is the oracle. The grid and plain DeepSpeed (4.) both train
   ``examples/deepspeed/train_gpt.py`` through the trial hook, with the same steps, so only the
   config differs.
4. Plain DeepSpeed: ZeRO 0, 1, 2 and 3 without per-layer choices (no checkpointing, no splitting,
   every ZeRO-3 group sharded), each at the largest micro-batch whose measured peak fits the limit
   (tried from the largest down), with the same optimizer and dsauto's bucket and prefetch sizes:
   with DeepSpeed's own defaults (5e8-element buckets) nothing fits the limit, which is recorded too.
5. DeepSpeed's own autotuner on the same script, when it can run here (``benchmarks/ds_autotuner.py``).

Results go to ``benchmarks/results/plan_quality.md`` and ``plan_quality.png``; the last line printed is

    tuned_vs_oracle=X tuned_vs_best_default=Y real_steps=N wall_s=T

(throughput ratios measured in the grid pass; ``real_steps`` and ``wall_s`` are the tune's own:
timed steps it measured and its wall time, profiling included).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.profile.launch import all_reduce_buffers
from dsauto.profile.run import launch_profile
from dsauto.profile.store import find_profile
from dsauto.refine.runner import TrialOutcome, TrialSettings, run_trial
from dsauto.refine.study import TuneSettings, refine
from dsauto.search.planner import Planner
from dsauto.serde import to_dict
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec
from dsauto.units import format_bytes

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "examples" / "deepspeed" / "train_gpt.py"

SEQ_LEN = 128
MODEL = ModelSpec(name="bench-wide", architecture="decoder", num_layers=4, hidden_size=512,
                  num_attention_heads=8, ffn_hidden_size=2048, vocab_size=8192,
                  max_position_embeddings=SEQ_LEN, dropout=False)
GLOBAL_BATCH = 16
MEMORY_LIMIT = "300MiB"
"""Tight enough that ZeRO-0 never fits, ZeRO-1 and ZeRO-2 fit only with per-layer help, and plain
ZeRO-3 only at small micro-batches."""
TRIALS = 6
TOP_PLANS = 3
RANKS = 2


@dataclass(frozen=True)
class Row:
    """One measured configuration."""

    kind: str  # "grid", "plain" or "tuned"
    label: str
    predicted_seconds: float | None
    outcome: TrialOutcome


def plain_config(zero: int, micro_batch: int, grad_accum: int) -> dict:
    """DeepSpeed as a user would write it: stage and batch, DeepSpeed's defaults for the rest, and
    the optimizer dsauto's configs use (so only the parallel strategy differs)."""
    from dsauto.emit.ds_config import (
        GRADIENT_CLIPPING,
        OPTIMIZER_PARAMS,
        STEPS_PER_PRINT,
    )

    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": grad_accum, "steps_per_print": STEPS_PER_PRINT,
            "gradient_clipping": GRADIENT_CLIPPING, "wall_clock_breakdown": False,
            "optimizer": {"type": "AdamW", "params": dict(OPTIMIZER_PARAMS)},
            "zero_optimization": {"stage": zero}}


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 timed steps per measurement instead of 3")
    parser.add_argument("--work", type=Path, default=None, help="folder for profiles, studies and logs")
    parser.add_argument("--skip-autotuner", action="store_true", help="do not run DeepSpeed's autotuner")
    parser.add_argument("--only-autotuner", action="store_true",
                        help="run only DeepSpeed's autotuner and replace its section of the recorded results")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="dsauto-plan-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    model_file = work / f"{MODEL.name}.yaml"
    model_file.write_text(yaml.safe_dump(to_dict(MODEL), sort_keys=False))
    if args.only_autotuner:
        results = RESULTS / "plan_quality.md"
        text = results.read_text()
        head, rest = text.split(AUTOTUNER_HEADING, 1)
        tail = rest[rest.index("\n```\ntuned_vs_oracle"):]
        section = _autotuner_section(_autotuner(work, model_file, say), "python benchmarks/plan_quality.py --only-autotuner")
        results.write_text(head + AUTOTUNER_HEADING + section + tail)
        print(section.strip().splitlines()[-1])
        return
    steps = 2 if args.quick else 3
    trial = TrialSettings(steps=steps, warmup_steps=1, memory_steps=2, timeout_seconds=600)
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=RANKS, memory_limit=MEMORY_LIMIT)
    train = TrainSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN, dtype="fp32")
    budget = cluster.memory_budget_bytes

    # 1-2. The tune, timed as a user would see it: profiling, search and trials.
    started = time.perf_counter()
    launch_profile(str(model_file), "fp32", SEQ_LEN, (1, 2), RANKS, work / "profiles", say)
    profile = find_profile(work / "profiles", MODEL, "fp32", SEQ_LEN)
    planner = Planner(MODEL, cluster, train, profile=profile)
    result = refine(planner, work / "tune", TuneSettings(trials=TRIALS, top_plans=TOP_PLANS, trial=trial), say)
    tune_wall = time.perf_counter() - started
    measured_trials = [r for r in result.records if r.measured_seconds is not None]
    real_steps = len(measured_trials) * (trial.steps + trial.warmup_steps + trial.memory_steps)
    tuned_label = result.winner.knobs.describe()
    say(f"tuned: {tuned_label} in {tune_wall:.0f} s over {len(result.records)} trials")

    # 3. The oracle: every candidate of the same space, measured the same way.
    space = result.space
    # The grid and plain DeepSpeed run the same script, so that only the config differs.
    per_replica = GLOBAL_BATCH // RANKS
    script_config = work / "plain_ds_config.json"  # the script's own; each run replaces it by its trial's
    script_config.write_text(json.dumps(plain_config(0, 1, per_replica)))
    script = TrialSettings(steps=steps, warmup_steps=1, memory_steps=2, timeout_seconds=600,
                           script=str(SCRIPT), script_args=("--model", str(model_file), "--seq-len", str(SEQ_LEN),
                                                            "--steps", "1000000", "--deepspeed_config",
                                                            str(script_config)),
                           launcher="deepspeed")
    rows: list[Row] = []
    for i, c in enumerate(space):
        say(f"grid {i + 1}/{len(space)}: {c.knobs.describe()}")
        outcome = run_trial(c.plan, RANKS, script, work / "grid" / f"{i}", budget)
        rows.append(Row("grid", c.knobs.describe(), c.plan.prediction.step_seconds, outcome))
        say(f"  {outcome.status} {_ms(outcome)} {outcome.reason}")

    # 4. Plain DeepSpeed: each ZeRO stage at the largest micro-batch that fits, no per-layer choices
    # (nothing checkpointed or split, every ZeRO-3 group sharded), with dsauto's bucket and prefetch
    # sizes: DeepSpeed's defaults (5e8-element buckets) do not fit the limit at all (row "defaults").
    micro_batches = [m for m in range(per_replica, 0, -1) if per_replica % m == 0]
    layers = MODEL.num_layers
    for zero in (0, 1, 2, 3):
        for mb in micro_batches:
            strategy = Strategy(dims=ParallelDims(dp=RANKS, tp=1, pp=1), zero_stage=zero, micro_batch=mb, grad_accum=per_replica // mb,
                                sequence_parallel=False)
            plain = planner.build_plan(strategy, [layers], [LayerOption(False, zero == 3, 1)] * (layers + 2))
            outcome = run_trial(plain, RANKS, script, work / "plain" / f"z{zero}-mb{mb}", budget)
            say(f"plain ZeRO-{zero} mb {mb}: {outcome.status} {_ms(outcome)} {outcome.reason}")
            rows.append(Row("plain", f"ZeRO-{zero} mb{mb}x{per_replica // mb}", plain.prediction.step_seconds, outcome))
            if outcome.status != "infeasible":
                break  # the largest micro-batch that fits (or a failure, recorded as such)
        defaults = run_trial(result.plan, RANKS, script, work / "defaults" / f"z{zero}", budget,
                             config=plain_config(zero, 1, per_replica))
        say(f"DeepSpeed defaults ZeRO-{zero} mb 1: {defaults.status} {_ms(defaults)} {defaults.reason}")
        rows.append(Row("defaults", f"ZeRO-{zero} mb1x{per_replica}", None, defaults))

    # 5. DeepSpeed's autotuner.
    autotuner = None
    if not args.skip_autotuner:
        autotuner = _autotuner(work, model_file, say)

    grid = [r for r in rows if r.kind == "grid" and r.outcome.status == "complete"]
    plain = [r for r in rows if r.kind == "plain" and r.outcome.status == "complete"]
    oracle = min(grid, key=lambda r: r.outcome.measurement.step_seconds)
    tuned = next(r for r in rows if r.kind == "grid" and r.label == tuned_label)
    best_plain = min(plain, key=lambda r: r.outcome.measurement.step_seconds) if plain else None
    if tuned.outcome.status == "complete":
        tuned_seconds = tuned.outcome.measurement.step_seconds
    else:  # noise near the limit: fall back on the tune's own measurement, and say so
        tuned_seconds = result.plan.measured.step_seconds
        say(f"the tuned plan was {tuned.outcome.status} in the grid pass ({tuned.outcome.reason}); "
            f"using the tune's measurement")
    vs_oracle = oracle.outcome.measurement.step_seconds / tuned_seconds
    vs_default = best_plain.outcome.measurement.step_seconds / tuned_seconds if best_plain else float("inf")
    summary = (f"tuned_vs_oracle={vs_oracle:.3f} tuned_vs_best_default={vs_default:.3f} "
               f"real_steps={real_steps} wall_s={tune_wall:.0f}")
    write_results(rows, result, tuned_label, oracle, best_plain, autotuner, summary, args, budget, tune_wall)
    print(summary)


def _ms(outcome: TrialOutcome) -> str:
    m = outcome.measurement
    return f"{m.step_seconds * 1e3:.1f} ms, peak {format_bytes(m.peak_bytes)}" if m else ""


def _autotuner(work: Path, model_file: Path, say) -> object | None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: benchmarks/ is not a package path
    from ds_autotuner import run_ds_autotuner

    say("running DeepSpeed's autotuner on the same script")
    result = run_ds_autotuner(work / "autotuner", SCRIPT, ["--model", str(model_file), "--seq-len", str(SEQ_LEN)],
                              train_batch_size=GLOBAL_BATCH, ranks=RANKS)
    # Its experiments leave DeepSpeed's CPU all-reduce buffers behind (see refine.runner); this
    # benchmark owns the machine, so all of them go.
    for path in all_reduce_buffers():
        path.unlink(missing_ok=True)
    return result


def write_results(rows, result, tuned_label, oracle, best_plain, autotuner, summary, args, budget, wall) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS.mkdir(exist_ok=True)
    command = f"python benchmarks/plan_quality.py{' --quick' if args.quick else ''}"
    lines = [
        "# Plan quality: tuned plan vs exhaustive measured grid vs plain DeepSpeed, 2 CPU ranks",
        "",
        f"Command: `{command}`. Model {MODEL.name} ({MODEL.num_parameters() / 1e6:.1f}M parameters: "
        f"{MODEL.num_layers} layers, hidden {MODEL.hidden_size}, vocabulary {MODEL.vocab_size}), "
        f"{GLOBAL_BATCH} sequences of {SEQ_LEN} tokens per step, fp32, per-rank limit {format_bytes(budget)} "
        f"(peak live tensor bytes). Each measurement: 2 memory steps, 2 warm-up steps, then the median "
        f"of the timed steps (slowest rank); gloo, one core per rank.",
        "",
        f"The tune (profile + search + {len(result.records)} trials) took {wall:.0f} s and wrote "
        f"**{tuned_label}**. Calibration fitted to its trials: {result.calibration.describe()}.",
        "",
        "## Trials of the tune",
        "",
        "| trial | candidate | predicted | measured | measured peak | status |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(result.records, key=lambda r: r.number):
        lines.append(f"| {r.number} | {r.label} | {_fmt(r.predicted_seconds)} | {_fmt(r.measured_seconds)} | "
                     f"{format_bytes(r.measured_peak_bytes) if r.measured_peak_bytes else '-'} | {r.status} {r.reason} |")
    lines += ["", "## Every candidate measured (grid pass) and plain DeepSpeed", "",
              "| kind | configuration | predicted | measured step | peak | status |", "|---|---|---|---|---|---|"]
    for r in rows:
        m = r.outcome.measurement
        mark = " (tuned)" if r.kind == "grid" and r.label == tuned_label else ""
        mark += " (oracle)" if r is oracle else ""
        mark += " (best plain)" if r is best_plain else ""
        lines.append(f"| {r.kind} | {r.label}{mark} | {_fmt(r.predicted_seconds)} | "
                     f"{_fmt(m.step_seconds if m else None)} | {format_bytes(m.peak_bytes) if m else '-'} | "
                     f"{r.outcome.status} {r.outcome.reason} |")
    lines += ["", AUTOTUNER_HEADING.strip(), _autotuner_section(autotuner, command).rstrip("\n")]
    lines += ["", "```", summary, "```", ""]
    (RESULTS / "plan_quality.md").write_text("\n".join(lines))

    done = [r for r in rows if r.outcome.measurement is not None]
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.28 * len(done) + 1)))
    colors = {"grid": "#4c72b0", "plain": "#c44e52", "defaults": "#dd8452"}
    labels, values, bar_colors = [], [], []
    for r in sorted(done, key=lambda r: r.outcome.measurement.step_seconds, reverse=True):
        labels.append(f"{r.kind}: {r.label}" + (" [tuned]" if r.kind == "grid" and r.label == tuned_label else ""))
        values.append(GLOBAL_BATCH * SEQ_LEN / r.outcome.measurement.step_seconds)
        bar_colors.append("#bbbbbb" if r.outcome.status != "complete" else colors[r.kind])
    ax.barh(range(len(values)), values, color=bar_colors)
    ax.set_yticks(range(len(values)), labels, fontsize=7)
    ax.set_xlabel("measured tokens/s (grey: over the memory limit)")
    ax.set_title(summary, fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "plan_quality.png", dpi=110)


AUTOTUNER_HEADING = "\n## DeepSpeed's autotuner\n"


def _autotuner_section(autotuner, command: str) -> str:
    """The results section of DeepSpeed's autotuner run (one summary line last)."""
    if autotuner is None:
        return "\nNot run.\n"
    config = autotuner.best_config or {}
    zero = (config.get("zero_optimization") or {}).get("stage")
    chosen = (f"ZeRO-{zero}, micro-batch {config.get('train_micro_batch_size_per_gpu')} x "
              f"{config.get('gradient_accumulation_steps')} accumulation" if config else "nothing")
    return (f"\nCommand: `{command}` (DeepSpeed's `--autotuning tune` on the same script and batch, its "
            f"ZeRO stage and micro-batch grid; it measures throughput only and knows no memory limit).\n\n"
            f"```\n{json.dumps(to_dict(autotuner), indent=1, default=str)}\n```\n\n"
            f"autotuner: ran={autotuner.ran} wall_s={autotuner.wall_seconds:.0f} "
            f"experiments={autotuner.experiments} chose {chosen}"
            + (f" ({autotuner.best_metric:.1f} {autotuner.metric_name})" if autotuner.best_metric else "")
            + (f"; {autotuner.reason}" if autotuner.reason else "") + "\n")


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


if __name__ == "__main__":
    main()
