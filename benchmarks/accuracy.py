"""Predicted vs measured step time and peak memory of real training steps, on two CPU ranks.

    python benchmarks/accuracy.py                 # both parts below; about 11 minutes
    python benchmarks/accuracy.py --plans dp      # data-parallel plans through DeepSpeed only
    python benchmarks/accuracy.py --plans mp      # model-parallel plans through Megatron-core only
    python benchmarks/accuracy.py --plans moe     # mixture-of-experts plans through DeepSpeed only
    python benchmarks/accuracy.py --plans variants  # DeepSpeed's pipeline engine, offload and bf16 plans only
    python benchmarks/accuracy.py --quick         # fewer steps, for a smoke run

For each of two model shapes it (1) profiles the layers with ``dsauto profile`` launched on two ranks
(rank 0 times the layers with one thread, both ranks fit the gloo collectives), (2) builds plans
spanning ZeRO 0-3, checkpointing on, off and partial, several micro-batch sizes, gradient
accumulation, mixed replicate/shard groups and operator splitting, and prices them with the
profile, and (3) trains each for real through ``dsauto.deepspeed.initialize`` on two ranks (gloo,
one thread each), measuring the median step time and the peak tensor bytes per rank
(:mod:`dsauto.profile.steps`).

The model-parallel plans (tensor parallelism 2; pipeline parallelism 2 under 1F1B with even and
uneven layouts; recomputation of all, some or none of the layers; several micro-batch sizes) train
Megatron-core's own GPT in fp32 on two ranks through dsauto's Megatron plugin, with the worker of
benchmarks/megatron_memory.py (one measurement code path for both benchmarks): peak tensor bytes
over tracked steps, then the median time of timed steps without the tracker (slowest rank; on a
shared machine less the time other processes ran on the ranks' cores). They
are priced with a profile measured in the same run (``dsauto profile`` in fp32, TP shards 1 and 2:
layer times, and the gloo collectives, send/recv included, that price the tensor-parallel all-reduces
and the pipeline transfers). Each is also predicted by the model calibrated on the other plans'
measurements (leave one plan out; :func:`dsauto.refine.calibrate.fit_calibration`).

Results go to ``benchmarks/results/accuracy.md`` (one section per part) and ``accuracy.png``; the
last lines printed are

    median_time_error=X max_time_error=Y median_memory_error=Z max_under_prediction=U plans=N
    mp_median_time_error=X mp_max_time_error=Y mp_median_memory_error=Z mp_max_under_prediction=U mp_plans=N
    moe_median_time_error=X moe_max_time_error=Y moe_median_memory_error=Z moe_max_under_prediction=U moe_plans=N
    variants_median_time_error=X ... variants_max_under_prediction=U variants_plans=N

where U, the largest under-prediction of a peak, is the maximum over plans of (measured - predicted) /
measured, 0 when no peak is under-predicted: a plan predicted below its real peak is an
out-of-memory waiting to happen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.plan import Plan
from dsauto.plan_io import write_plan_yaml
from dsauto.profile.store import find_profile
from dsauto.refine.runner import remove_shared_memory
from dsauto.search.planner import Planner
from dsauto.serde import to_dict
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec

try:
    from benchmarks import megatron_memory
except ImportError:  # run as a script: its own folder is on the path
    import megatron_memory

RESULTS = Path(__file__).resolve().parent / "results"
SEQ_LEN = 256

SHAPES = (
    ModelSpec(name="bench-gpt", architecture="decoder", num_layers=4, hidden_size=256,
              num_attention_heads=4, ffn_hidden_size=1024, vocab_size=4096,
              max_position_embeddings=SEQ_LEN, dropout=False),
    ModelSpec(name="bench-llama", architecture="decoder", num_layers=6, hidden_size=192,
              num_attention_heads=6, num_kv_heads=2, ffn_hidden_size=512, vocab_size=2048,
              max_position_embeddings=SEQ_LEN, mlp="swiglu", norm="rmsnorm", position_embedding="rope",
              tied_embeddings=False, linear_bias=False, dropout=False),
)


@dataclass(frozen=True)
class Case:
    """One plan of the benchmark: the global strategy and the per-layer options, in words."""

    zero: int
    micro_batch: int
    grad_accum: int
    checkpoint: str  # "none", "all" or "half" (the first half of the blocks)
    shard: str = "all"  # ZeRO-3: "all" sharded, "mixed" (blocks replicated, embedding and head sharded)
    split: int = 1  # operator splitting of the sharded blocks and the head's loss chunks
    pp: int = 1  # DeepSpeed's pipeline engine over pp of the two ranks (even stages; dp = 2 / pp)
    offload: str = "none"  # "optimizer": ZeRO-Offload, the optimizer state and its update on the host
    dtype: str = "fp32"

    def label(self) -> str:
        parts = [f"pp{self.pp}"] if self.pp > 1 else []
        parts += [f"zero{self.zero}", f"mb{self.micro_batch}", f"acc{self.grad_accum}", f"ckpt-{self.checkpoint}"]
        if self.zero == 3:
            parts.append(f"shard-{self.shard}")
        if self.split > 1:
            parts.append(f"split{self.split}")
        if self.offload != "none":
            parts.append(f"offload-{self.offload}")
        if self.dtype != "fp32":
            parts.append(self.dtype)
        return " ".join(parts)


CASES = (
    Case(0, 1, 1, "none"), Case(0, 4, 1, "all"),
    Case(1, 2, 1, "none"), Case(1, 4, 2, "half"),
    Case(2, 2, 2, "none"), Case(2, 8, 1, "all"),
    Case(3, 2, 1, "none"), Case(3, 4, 1, "half", shard="mixed"),
    Case(3, 1, 2, "none", split=2), Case(3, 8, 1, "all", shard="mixed", split=4),
)

VARIANT_CASES = (  # (index of the shape in SHAPES, case)
    # DeepSpeed's pipeline engine (1F1B, even stages): the untied bench-llama, as a PipelineModule
    # (dsauto.profile.steps.pipeline_module). Two ranks leave dp = 1, where ZeRO-1 partitions over
    # one rank (the search plans ZeRO-0 there; the pipeline engine runs either).
    (1, Case(0, 1, 1, "none", pp=2)), (1, Case(0, 2, 4, "none", pp=2)), (1, Case(0, 1, 4, "all", pp=2)),
    (1, Case(1, 2, 2, "half", pp=2)), (1, Case(1, 4, 1, "none", pp=2)),
    # The tied bench-gpt as a pipeline: TiedLayerSpecs at both ends, so the last stage holds the
    # embedding module too (dsauto.models.pipeline.pipeline_layer_specs).
    (0, Case(0, 2, 2, "none", pp=2)), (0, Case(1, 1, 4, "all", pp=2)),
    # ZeRO-Offload: the optimizer on the host (DeepSpeedCPUAdam).
    (0, Case(1, 1, 1, "none", offload="optimizer")), (0, Case(1, 2, 1, "none", offload="optimizer")),
    (0, Case(1, 4, 2, "half", offload="optimizer")), (0, Case(2, 1, 1, "none", offload="optimizer")),
    (0, Case(2, 2, 2, "none", offload="optimizer")), (0, Case(2, 4, 1, "all", offload="optimizer")),
    # bf16 (DeepSpeed's CPU accelerator trains bf16: CPU_Accelerator.is_bf16_supported).
    (0, Case(0, 2, 1, "none", dtype="bf16")), (0, Case(1, 1, 1, "none", dtype="bf16")),
    (0, Case(1, 2, 2, "half", dtype="bf16")), (0, Case(2, 4, 1, "all", dtype="bf16")),
    # bf16 through DeepSpeed's pipeline engine: its BF16_Optimizer (engine.py, _do_optimizer_sanity_check).
    (1, Case(0, 2, 2, "none", pp=2, dtype="bf16")), (1, Case(0, 1, 4, "all", pp=2, dtype="bf16")),
    # bf16 ZeRO-3: 16-bit gathers, buckets and gradient partitions, and the update's flat copies.
    (0, Case(3, 2, 1, "none", dtype="bf16")), (0, Case(3, 1, 2, "half", shard="mixed", dtype="bf16")),
    (1, Case(3, 4, 1, "all", shard="mixed", split=2, dtype="bf16")),
)
"""Plans beyond the data-parallel fp32 ones (``--plans variants``)."""


def options_of(case: Case, num_layers: int) -> list[LayerOption]:
    """Per flat layer (0 embedding, 1..L blocks, L+1 head) options of a case."""
    options = []
    for layer in range(num_layers + 2):
        block = 1 <= layer <= num_layers
        checkpoint = block and (case.checkpoint == "all" or (case.checkpoint == "half" and layer <= num_layers // 2))
        shard = case.zero == 3 and not (case.shard == "mixed" and block)
        split = case.split if (layer == num_layers + 1 or (block and shard)) else 1
        options.append(LayerOption(checkpoint=checkpoint, shard_params=shard, split=split))
    return options


def build_plans(model: ModelSpec, profile_dir: Path, cases=CASES) -> list[tuple[Case, Plan]]:
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=2)
    plans = []
    for case in cases:
        dp = 2 // case.pp
        train = TrainSpec(global_batch=dp * case.micro_batch * case.grad_accum, seq_len=SEQ_LEN, dtype=case.dtype)
        profile = find_profile(profile_dir, model, case.dtype, SEQ_LEN)
        planner = Planner(model, cluster, train, profile=profile)
        strategy = Strategy(dims=ParallelDims(dp=dp, tp=1, pp=case.pp), zero_stage=case.zero,
                            micro_batch=case.micro_batch, grad_accum=case.grad_accum, sequence_parallel=False,
                            offload=case.offload)
        plans.append((case, planner.build_plan(strategy, [model.num_layers // case.pp] * case.pp,
                                               options_of(case, model.num_layers))))
    return plans


def _launch(args: list[str], log: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    port = 29500 + os.getpid() % 1000
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(port), *args]
    with log.open("a") as out:
        result = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    remove_shared_memory(port)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed (exit {result.returncode}); see {log}")


def _profile(model: ModelSpec, dtype: str, micro_batches: str, tps: str, quick: bool, work: Path, log: Path,
             engine: str = "deepspeed") -> None:
    """``dsauto profile`` of ``model`` on 2 ranks into ``work/profiles``: layer times and activations
    at every micro-batch size and TP shard (of ``engine``'s transformer layers), the gloo collectives
    of 2 ranks."""
    model_file = work / f"{model.name}.yaml"
    model_file.write_text(yaml.safe_dump(to_dict(model), sort_keys=False))
    print(f"{model.name}: profiling on 2 ranks ({dtype})", file=sys.stderr, flush=True)
    _launch(["-m", "dsauto.cli", "profile", "--model", str(model_file), "--hardware", "cpu", "--dtype", dtype,
             "--seq-len", str(SEQ_LEN), "--micro-batches", micro_batches, "--tp", tps,
             "--repeats", "3" if quick else "11", "--out", str(work / "profiles"), "--engine", engine], log)


def measure_dp(quick: bool, work: Path, log: Path) -> list[tuple]:
    """The data-parallel plans of every shape, measured through DeepSpeed."""
    rows = []
    for model in SHAPES:
        _profile(model, "fp32", "1,2,4,8", "1", quick, work, log)
        rows += _measure(model, build_plans(model, work / "profiles"), quick, work, log, model.name)
    return rows


def measure_variants(quick: bool, work: Path, log: Path, render_only: bool = False) -> list[tuple]:
    """The pipeline, offload and bf16 plans (:data:`VARIANT_CASES`), measured through DeepSpeed.

    On CPU ranks the host is the device: the tracker counts an offloaded optimizer's host buffers
    with the rest, so an offloaded plan's predicted peak is its device peak plus its host bytes
    (``Prediction.offloaded_bytes``). ``render_only``: price the plans again against the
    measurements a run left in ``work``, measuring nothing."""
    rows = []
    for index, model in enumerate(SHAPES):
        cases = [case for shape, case in VARIANT_CASES if shape == index]
        for dtype in sorted({case.dtype for case in cases}) if not render_only else ():
            _profile(model, dtype, "1,2,4", "1", quick, work, log)
        if cases:
            rows += _measure(model, build_plans(model, work / "profiles", cases), quick, work, log,
                             f"{model.name}-variants", render_only)
    return rows


def _measure(model: ModelSpec, plans: list[tuple[Case, Plan]], quick: bool, work: Path, log: Path,
             name: str, render_only: bool = False) -> list[tuple]:
    """Trains ``plans`` on 2 ranks (``render_only``: reads what an earlier run measured): (model,
    plan, predicted s, measured s, predicted bytes, measured bytes) rows."""
    plans_file = work / f"{name}-plans.json"
    plans_file.write_text(json.dumps([plan.to_dict() for _, plan in plans]))
    measured_file = work / f"{name}-measured.json"
    if not render_only:
        print(f"{model.name}: measuring {len(plans)} plans on 2 ranks", file=sys.stderr, flush=True)
        _launch(["-m", "dsauto.profile.steps", "--plans", str(plans_file), "--out", str(measured_file),
                 "--steps", "3" if quick else "15", "--warmup", "3"], log)
    return [(model.name, case.label(), plan.prediction.step_seconds, measured["step_seconds"],
             plan.prediction.peak_memory_bytes + plan.prediction.offloaded_bytes, measured["peak_bytes"])
            for (case, plan), measured in zip(plans, json.loads(measured_file.read_text()))]


# ---- model-parallel plans through Megatron-core ------------------------------------------------------

MP_DTYPE = "fp32"
"""Megatron-core on CPU in fp32: torch's CPU kernels time fp32 steadily, while its bf16 backward at
these shapes ran 5-10 times its forward and varied by 2x between micro-batch sizes (measured with
``dsauto profile --dtype bf16`` on this benchmark's model)."""


def mp_cases():
    """The model-parallel plans: TP 2 and PP 2 (1F1B; even, 1+3 and 3+1 layouts), recomputation of
    every layer, of the first of each stage or none, micro-batches of 1 to 4 sequences."""
    case = megatron_memory.Case
    return (
        case(tp=2, dtype=MP_DTYPE),
        case(tp=2, recompute=True, dtype=MP_DTYPE),
        case(tp=2, micro_batch=4, micro_batches=2, recompute_first=2, dtype=MP_DTYPE),
        case(tp=2, micro_batch=1, micro_batches=8, dtype=MP_DTYPE),
        case(pp=2, dtype=MP_DTYPE),
        case(pp=2, recompute=True, dtype=MP_DTYPE),
        case(pp=2, layout=(1, 3), dtype=MP_DTYPE),
        case(pp=2, layout=(3, 1), dtype=MP_DTYPE),
        case(pp=2, micro_batch=1, micro_batches=8, recompute_first=1, dtype=MP_DTYPE),
        case(pp=2, micro_batch=4, micro_batches=2, dtype=MP_DTYPE),
    )


@dataclass(frozen=True)
class MpRow:
    """One model-parallel plan: its prediction, what its steps measured, and its prediction by the
    model calibrated on the other plans."""

    label: str
    plan: Plan
    step_seconds: float
    """Median measured step time on cores of the ranks' own: the slowest rank's wall time, less
    the most time other processes ran on the core a rank is bound to."""
    peak_bytes: int
    """Measured peak live tensor bytes (largest rank)."""
    cross_validated_seconds: float = 0.0
    """Predicted by the model calibrated on every other plan's measurement."""
    wall_seconds: float = 0.0
    """Median wall time of a step, as it ran on the shared machine."""
    waiting_share: float = 0.0
    """Median share of a step's wall time that other processes ran on a rank's core (the most of any
    rank)."""
    all_threads_seconds: float = 0.0
    """Median wall time scaled by all the ranks' threads' time on a core over their time on a core or
    waiting for one: counts the gloo threads' waits for the core their rank's step holds, which the
    step does not lose, as other processes' time (below the busiest rank's own compute time in
    pipelines with idle stages)."""

    @property
    def time_error(self) -> float:
        return (self.plan.prediction.step_seconds - self.step_seconds) / self.step_seconds

    @property
    def memory_error(self) -> float:
        return (self.plan.prediction.peak_memory_bytes - self.peak_bytes) / self.peak_bytes

    @property
    def wall_error(self) -> float:
        """The prediction against the step's wall time as it ran on the shared machine."""
        return (self.plan.prediction.step_seconds - self.wall_seconds) / self.wall_seconds

    @property
    def cross_validated_error(self) -> float:
        return (self.cross_validated_seconds - self.step_seconds) / self.step_seconds


def measure_mp(quick: bool, work: Path, log: Path, render_only: bool = False) -> tuple[list[MpRow], dict[str, float]]:
    """The model-parallel plans, each trained by Megatron-core on 2 ranks, priced with the profile;
    and Megatron-core's layers timed against the reference layers
    (:func:`megatron_memory.layer_times`; the profile times Megatron-core's transformer layer). ``render_only``: read the measurements a run left in
    ``work`` instead of measuring."""
    model = megatron_memory.bench_model()
    if not render_only:
        _profile(model, MP_DTYPE, "1,2,4", "1,2", quick, work, log, engine="megatron")
    profile = find_profile(work / "profiles", model, MP_DTYPE, SEQ_LEN, "megatron")
    # Megatron-core's layers against the reference layers, on one rank.
    if not render_only:
        one_rank = megatron_memory.build_plan(megatron_memory.Case(dtype=MP_DTYPE))
        megatron_memory.launch(write_plan_yaml(one_rank, work / "one-rank.yaml"), work / "layer-times.json", log, 1,
                               layers=True)
    rows = []
    for case in mp_cases():
        name = "mp-" + case.label().replace(" ", "_")
        plan = megatron_memory.build_plan(case, profile)
        out = work / f"{name}.json"
        if not render_only:
            out.unlink(missing_ok=True)
            print(f"{case.label()}: training with Megatron-core on 2 ranks", file=sys.stderr, flush=True)
            megatron_memory.launch(write_plan_yaml(plan, work / f"{name}.yaml"), out, log, plan.world_size,
                                   timed_steps=3 if quick else 5)
        ranks = json.loads(out.read_text())
        steps = ranks[0]["timed_steps"]  # the slowest rank's wall time, the ranks' time on and off cores
        row = MpRow(case.label(), plan,
                    statistics.median(t["wall_seconds"] - t["others_seconds"] for t in steps),
                    max(r["step"] for r in ranks), wall_seconds=statistics.median(t["wall_seconds"] for t in steps),
                    waiting_share=statistics.median(t["others_seconds"] / t["wall_seconds"] for t in steps),
                    all_threads_seconds=statistics.median(t["wall_seconds"] * t["on_core_seconds"]
                                                          / (t["on_core_seconds"] + t["waiting_seconds"])
                                                          for t in steps))
        print(f"  step {row.step_seconds * 1e3:.1f} ms (predicted {row.time_error:+.1%}), peak "
              f"{row.peak_bytes / 2**20:.1f} MiB (predicted {row.memory_error:+.1%})", file=sys.stderr, flush=True)
        rows.append(row)
    return cross_validate(rows, profile), json.loads((work / "layer-times.json").read_text())


def cross_validate(rows: list[MpRow], profile) -> list[MpRow]:
    """Each row with its step predicted by the model calibrated on the other rows' measurements
    (leave one plan out): what the refiner's calibration would have predicted before measuring it."""
    from dsauto.refine.calibrate import Observation, fit_calibration
    from dsauto.refine.space import Candidate, Knobs, calibrated_planner, strategy_of
    from dsauto.refine.space import options_of as plan_options

    planners = [megatron_memory.planner_of(case, profile) for case in mp_cases()]
    candidates = [Candidate(Knobs(row.label), strategy_of(row.plan), tuple(row.plan.stage_layers),
                            plan_options(row.plan), row.plan) for row in rows]
    observed = [Observation(c, row.step_seconds, row.peak_bytes, planner=p)
                for c, row, p in zip(candidates, rows, planners)]
    out = []
    for i, row in enumerate(rows):
        others = observed[:i] + observed[i + 1:]
        fitted = fit_calibration(planners[i], others)
        predicted = candidates[i].price(calibrated_planner(planners[i], fitted)).prediction.step_seconds
        out.append(dataclasses.replace(row, cross_validated_seconds=predicted))
        print(f"  without {row.label}: {fitted.describe()}", file=sys.stderr, flush=True)
    return out


def mp_summary(rows: list[MpRow]) -> str:
    times = [abs(r.time_error) for r in rows]
    return (f"mp_median_time_error={statistics.median(times):.3f} mp_max_time_error={max(times):.3f} "
            f"mp_median_memory_error={statistics.median(abs(r.memory_error) for r in rows):.3f} "
            f"mp_max_under_prediction="
            f"{max_under_prediction([(r.plan.prediction.peak_memory_bytes, r.peak_bytes) for r in rows]):.3f} "
            f"mp_plans={len(rows)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 timed steps instead of 15 (5 for Megatron-core), 3 profiling repeats instead of 11")
    parser.add_argument("--plans", choices=("all", "dp", "mp", "moe", "variants"), default="all",
                        help="data-parallel plans (DeepSpeed), model-parallel plans (Megatron-core), "
                             "mixture-of-experts plans (DeepSpeed), DeepSpeed's pipeline engine, offload "
                             "and bf16 plans, or all")
    parser.add_argument("--work", type=Path, default=None, help="folder for profiles and logs (default: a temporary one)")
    parser.add_argument("--render-only", action="store_true",
                        help="with --plans mp or variants and --work: write the results of the run that left its "
                             "measurements in the work folder, measuring nothing")
    args = parser.parse_args()
    if args.render_only and (args.plans not in ("mp", "variants") or args.work is None):
        parser.error("--render-only needs --plans mp or variants and the --work folder of a finished run")
    work = args.work or Path(tempfile.mkdtemp(prefix="dsauto-accuracy-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    command = "python benchmarks/accuracy.py" + (" --quick" if args.quick else "") + \
        (f" --plans {args.plans}" if args.plans != "all" else "")
    summaries = []
    if args.plans in ("all", "dp"):
        started = time.perf_counter()
        rows = measure_dp(args.quick, work, log)
        summary = dp_summary(rows)
        write_section("dp", dp_lines(rows, summary, time.perf_counter() - started, command))
        plot_dp(rows, summary)
        summaries.append(summary)
    if args.plans in ("all", "mp"):
        started = time.perf_counter()
        mp_rows, layer_seconds = measure_mp(args.quick, work, log, render_only=args.render_only)
        summary = mp_summary(mp_rows)
        wall = 0.0 if args.render_only else time.perf_counter() - started
        write_section("mp", mp_lines(mp_rows, summary, wall, command, layer_seconds))
        plot_mp(mp_rows, summary)
        summaries.append(summary)
    if args.plans in ("all", "moe"):
        started = time.perf_counter()
        rows = measure_moe(args.quick, work, log)
        summary = "moe_" + " moe_".join(dp_summary(rows).split())
        write_section("moe", moe_lines(rows, summary, time.perf_counter() - started, command))
        summaries.append(summary)
    if args.plans in ("all", "variants"):
        started = time.perf_counter()
        rows = measure_variants(args.quick, work, log, render_only=args.render_only)
        summary = "variants_" + " variants_".join(dp_summary(rows).split())
        wall = 0.0 if args.render_only else time.perf_counter() - started
        write_section("variants", variant_lines(rows, summary, wall, command))
        summaries.append(summary)
    for summary in summaries:
        print(summary)


TITLE = "# Accuracy: predicted vs measured training steps on 2 CPU ranks"
SECTIONS = ("dp", "mp", "moe", "variants")


def write_section(name: str, lines: list[str]) -> None:
    """Replaces one part's section of the results file, keeping the other's."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "accuracy.md"
    text = path.read_text() if path.exists() else ""
    sections = {}
    for other in SECTIONS:
        begin, end = f"<!-- {other} -->", f"<!-- /{other} -->"
        if begin in text and end in text:
            sections[other] = text[text.index(begin):text.index(end) + len(end)]
    sections[name] = "\n".join([f"<!-- {name} -->", *lines, f"<!-- /{name} -->"])
    path.write_text("\n\n".join([TITLE, *(sections[n] for n in SECTIONS if n in sections)]) + "\n")


UNDER_PREDICTION_NOTE = ("`max_under_prediction` is the largest (measured - predicted) / measured peak over the "
                         "plans, 0 when none is under-predicted (a peak predicted low is an out-of-memory waiting "
                         "to happen).")


def dp_lines(rows, summary: str, wall: float, command: str) -> list[str]:
    lines = [
        "## Data-parallel plans (DeepSpeed)",
        "",
        f"Command: `{command}` "
        f"(wall {wall:.0f} s for this part; gloo, one thread per rank, DeepSpeed through `dsauto.deepspeed.initialize`).",
        "Predictions use the profile measured in the same run (`dsauto profile` on 2 ranks: layer times and",
        "activations on rank 0, gloo collectives fitted on both); memory is the peak of live tensor bytes",
        "per rank during a step (tensor-level: every storage an operator creates, until it is freed), not RSS.",
        UNDER_PREDICTION_NOTE,
        "",
        "| model | plan | predicted step | measured step | time error | predicted peak | measured peak | memory error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, label, pt, mt, pm, mm in rows:
        lines.append(f"| {name} | {label} | {pt * 1e3:.1f} ms | {mt * 1e3:.1f} ms | {(pt - mt) / mt:+.1%} | "
                     f"{pm / 2**20:.1f} MiB | {mm / 2**20:.1f} MiB | {(pm - mm) / mm:+.1%} |")
    return lines + ["", "```", summary, "```"]


def mp_lines(rows: list[MpRow], summary: str, wall: float, command: str,
             layer_seconds: dict[str, float]) -> list[str]:
    from importlib.metadata import version

    model = megatron_memory.bench_model()
    ms = 1e3
    when = (f"wall {wall:.0f} s for this part" if wall else
            "this text written again from that run's measurements with --work and --render-only")
    lines = [
        "## Model-parallel plans (Megatron-core)",
        "",
        (f"Command: `{command}` ({when}; "
         f"Megatron-core {version('megatron-core')}, torch {version('torch')}, gloo, one thread per rank, each rank "
         "on its own core)."),
        "",
        (f"Model: the GPT of benchmarks/megatron_memory.py ({model.num_layers} layers, hidden {model.hidden_size}, "
         f"{model.num_attention_heads} heads, FFN {model.ffn_hidden_size}, vocabulary {model.vocab_size}, "
         f"tied head, {SEQ_LEN} tokens per sequence), Megatron-core's own GPTModel (local layer spec, unfused "
         f"attention) in **{MP_DTYPE}**, trained through `dsauto.megatron` with its CPU shim by the worker of "
         "benchmarks/megatron_memory.py. Each plan is priced by `Planner.build_plan` (engine megatron) with "
         "the profile measured in the same run (`dsauto profile --engine megatron --dtype fp32 --tp 1,2` on 2 "
         "ranks: Megatron-core's own transformer layer, local spec, and the reference embedding and head, "
         "timed at each micro-batch size and TP shard; the gloo all-reduce and send/recv "
         "fits price the tensor-parallel all-reduces and the pipeline transfers). Measured: the median of "
         "the timed steps (after 3 tracked and 2 untimed ones; each between barriers, so the slowest "
         "rank's), timed without the memory tracker. The machine is shared with other work, whose time "
         "slices stretch every step: from each step's wall time is taken the most time other processes "
         "ran on the core a rank is bound to (the core's busy time, `busy_seconds` in "
         "dsauto/profile/resources.py, less the rank's threads' time on it from the scheduler's statistics, "
         "`run_queue_seconds`), and the profile's layer timings are scaled to their thread's time on its "
         "core (`dsauto.profile.layers.uncontended`); *wall* is the step as it ran, *waiting* the share of "
         "it other processes took. *All threads*: the wall time scaled by all the ranks' threads' time on "
         "a core over their time on a core or waiting for one, which counts the waits of each rank's gloo "
         "threads for the core its own step holds as other processes' time (in pipelines with an idle "
         "stage it falls below the busiest rank's own compute time). Memory is the peak of live tensor bytes per rank "
         "over the tracked steps. The columns *TP comm*, *p2p* and *bubble* are the prediction's share of the step "
         "(`Prediction.tp_comm_seconds`, `p2p_seconds`, `bubble_seconds`). *Cross-validated*: the step "
         "predicted by the model calibrated (`fit_calibration`) on the other plans' measurements, leaving "
         "this one out."),
        "",
        ("| plan | micro-batches | predicted step | TP comm | p2p | bubble | measured step | wall (waiting, error) "
         "| all threads | time error | cross-validated | predicted peak | measured peak | memory error |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.plan.prediction
        lines.append(
            f"| {r.label} | {r.plan.grad_accum} x {r.plan.micro_batch} | {p.step_seconds * ms:.1f} ms | "
            f"{p.tp_comm_seconds * ms:.1f} ms | {p.p2p_seconds * ms:.1f} ms | {p.bubble_seconds * ms:.1f} ms | "
            f"{r.step_seconds * ms:.1f} ms | {r.wall_seconds * ms:.0f} ms ({r.waiting_share:.0%}, {r.wall_error:+.0%}) | "
            f"{r.all_threads_seconds * ms:.0f} ms | "
            f"{r.time_error:+.1%} | {r.cross_validated_error:+.1%} | "
            f"{p.peak_memory_bytes / 2**20:.1f} MiB | {r.peak_bytes / 2**20:.1f} MiB | {r.memory_error:+.1%} |")
    cross = [abs(r.cross_validated_error) for r in rows]
    walls = [abs(r.wall_error) for r in rows]
    lines += ["", UNDER_PREDICTION_NOTE, "", "```", summary, "```", "",
              (f"Cross-validated (leave one plan out): median time error {statistics.median(cross):.3f}, "
               f"max {max(cross):.3f}. Against the wall time as the steps ran (other processes' time "
               f"included): median {statistics.median(walls):.3f}, max {max(walls):.3f}."),
              "",
              (f"Megatron-core's layers against the reference layers (which a profile without `--engine "
               f"megatron` times), one micro-batch of "
               f"{megatron_memory.MICRO_BATCH} x {SEQ_LEN} tokens forward and backward on one rank "
               "(`megatron_memory.layer_times`, median of 15 runs, each scaled to its time on the core):"),
              "",
              "| part | Megatron-core (local spec) | reference (`dsauto.models`) | ratio |",
              "|---|---|---|---|"]
    for part, name in (("layer", "transformer layer"), ("attention", "core attention"), ("head", "loss head")):
        m, r = layer_seconds[f"megatron_{part}"], layer_seconds[f"reference_{part}"]
        lines.append(f"| {name} | {m * ms:.1f} ms | {r * ms:.1f} ms | {m / r:.2f} |")
    return lines


def _scatter(ax, series, unit: str) -> None:
    top = max(max(m, p) for _, pts in series for m, p in pts) * 1.1
    for name, pts in series:
        ax.scatter(*zip(*pts), label=name, s=18)
    ax.plot([0, top], [0, top], color="grey", linewidth=0.8)
    ax.fill_between([0, top], [0, top * 0.9], [0, top * 1.1], color="grey", alpha=0.15, label="±10%")
    ax.set_xlabel(f"measured ({unit})")
    ax.set_ylabel(f"predicted ({unit})")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.legend(fontsize=7)


def _figure(name: str, summary: str, series_time, series_memory) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4.5))
    FigureCanvasAgg(figure)
    ax_t, ax_m = figure.subplots(1, 2)
    _scatter(ax_t, series_time, "ms")
    _scatter(ax_m, series_memory, "MiB")
    ax_t.set_title("step time")
    ax_m.set_title("peak memory per rank")
    figure.suptitle(summary, fontsize=9)
    figure.tight_layout()
    RESULTS.mkdir(exist_ok=True)
    figure.savefig(RESULTS / name, dpi=120)


def plot_dp(rows, summary: str) -> None:
    names = list(dict.fromkeys(r[0] for r in rows))
    _figure("accuracy.png", summary,
            [(n, [(r[3] * 1e3, r[2] * 1e3) for r in rows if r[0] == n]) for n in names],
            [(n, [(r[5] / 2**20, r[4] / 2**20) for r in rows if r[0] == n]) for n in names])


def plot_mp(rows: list[MpRow], summary: str) -> None:
    kinds = (("tp2", "tp2"), ("pp2", "pp2 (1F1B)"))
    _figure("accuracy_mp.png", summary,
            [(label, [(r.step_seconds * 1e3, r.plan.prediction.step_seconds * 1e3) for r in rows
                      if r.label.startswith(k)]) for k, label in kinds]
            + [("calibrated, leave-one-out", [(r.step_seconds * 1e3, r.cross_validated_seconds * 1e3) for r in rows])],
            [(label, [(r.peak_bytes / 2**20, r.plan.prediction.peak_memory_bytes / 2**20) for r in rows
                      if r.label.startswith(k)]) for k, label in kinds])


# ---- mixture-of-experts plans through DeepSpeed (DeepSpeed-MoE for ep > 1) --------------------------

MOE_SHAPE = ModelSpec(
    name="bench-moe", architecture="decoder", num_layers=4, hidden_size=192, num_attention_heads=6,
    num_kv_heads=2, ffn_hidden_size=512, vocab_size=2048, max_position_embeddings=SEQ_LEN, mlp="swiglu",
    norm="rmsnorm", position_embedding="rope", tied_embeddings=False, linear_bias=False, dropout=False,
    num_experts=4, moe_top_k=2, moe_ffn_hidden_size=256, moe_first_dense_layers=1)
"""A small mixture of experts: 4 experts, top-2, a dense first layer (DeepSeek's layout)."""

MOE_CASES = (  # (ep, ZeRO stage, micro-batch, accumulation, checkpointing)
    (1, 0, 2, 1, "none"), (1, 2, 4, 1, "all"), (1, 3, 2, 1, "none"),
    (2, 0, 2, 1, "none"), (2, 1, 2, 2, "none"), (2, 2, 4, 1, "half"),
)
"""ep = 1 runs the reference's own dropless MoE layers; ep = 2 DeepSpeed-MoE's, its experts split over
the two ranks with an all-to-all each way (DeepSpeed runs its MoE layers under ZeRO 0-2 only)."""


def measure_moe(quick: bool, work: Path, log: Path) -> list[tuple]:
    """The mixture-of-experts plans, profiled (dense and MoE layers) and measured through DeepSpeed."""
    model = MOE_SHAPE
    _profile(model, "fp32", "1,2,4", "1", quick, work, log)
    profile = find_profile(work / "profiles", model, "fp32", SEQ_LEN)
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=2)
    plans = []
    for ep, zero, micro, accum, checkpoint in MOE_CASES:
        train = TrainSpec(global_batch=2 * micro * accum, seq_len=SEQ_LEN, dtype="fp32")
        strategy = Strategy(dims=ParallelDims(dp=2, tp=1, pp=1, ep=ep), zero_stage=zero, micro_batch=micro,
                            grad_accum=accum, sequence_parallel=False)
        case = Case(zero, micro, accum, checkpoint)
        plan = Planner(model, cluster, train, profile=profile).build_plan(
            strategy, [model.num_layers], options_of(case, model.num_layers))
        plans.append((f"ep{ep} {case.label()}", plan))
    plans_file, measured_file = work / f"{model.name}-plans.json", work / f"{model.name}-measured.json"
    plans_file.write_text(json.dumps([plan.to_dict() for _, plan in plans]))
    print(f"{model.name}: measuring {len(plans)} plans on 2 ranks", file=sys.stderr, flush=True)
    _launch(["-m", "dsauto.profile.steps", "--plans", str(plans_file), "--out", str(measured_file),
             "--steps", "3" if quick else "15", "--warmup", "3"], log)
    # The step on cores of the ranks' own (the machine is shared: StepMeasurement.on_core_step_seconds).
    return [(model.name, label, plan.prediction.step_seconds, measured.get("on_core_step_seconds") or measured["step_seconds"],
             plan.prediction.peak_memory_bytes, measured["peak_bytes"])
            for (label, plan), measured in zip(plans, json.loads(measured_file.read_text()))]


def moe_lines(rows, summary: str, wall: float, command: str) -> list[str]:
    m = MOE_SHAPE
    lines = dp_lines(rows, summary, wall, command)
    lines[0] = "## Mixture-of-experts plans (DeepSpeed)"
    note = (f"Model: {m.num_layers} layers (the first dense), hidden {m.hidden_size}, {m.num_experts} experts "
            f"top-{m.moe_top_k} of width {m.moe_ffn_hidden_size} (SwiGLU), vocabulary {m.vocab_size}, "
            f"{SEQ_LEN} tokens per sequence, fp32. ep1: the reference model's own dropless MoE layers, every "
            "expert on both ranks; ep2: DeepSpeed-MoE (`deepspeed.moe.layer.MoE(ep_size=2)`, capacity factor 1) "
            "with two experts per rank. The profile times the dense and the MoE layer apart; the all-to-all "
            "is priced from the CPU hardware file. The measured step is the median step on cores of the "
            "ranks' own (`StepMeasurement.on_core_step_seconds`: each step's wall time times the ranks' "
            "time on a core over their time on a core and waiting for one; the machine is shared).")
    return [*lines[:2], note, "", *lines[2:]]


def variant_lines(rows, summary: str, wall: float, command: str) -> list[str]:
    lines = dp_lines(rows, summary, wall, command)
    if not wall:
        lines[2] = lines[2].replace("(wall 0 s for this part; ", "(this text written again from that run's "
                                    "measurements with --work and --render-only; ")
    lines[0] = "## Pipeline, offload and bf16 plans (DeepSpeed)"
    note = ("pp2: DeepSpeed's pipeline engine (`PipelineModule` of the reference layers, logits as the last "
            "layer and the cross-entropy as its `loss_fn`, `engine.train_batch`; bench-llama 3 + 3 blocks, the tied "
            "bench-gpt 2 + 2 with its table as `TiedLayerSpec`s at both ends, so its last stage holds the "
            "embedding module too; "
            "`dsauto.profile.steps.measure_pipeline_plan`: cut and built through the DeepSpeed hook, "
            "`dsauto.deepspeed.pipeline_module`), "
            "dp 1. offload-optimizer: ZeRO-Offload (`offload_optimizer` to the CPU, DeepSpeedCPUAdam); on CPU "
            "ranks the host is the device, so the predicted peak is the device peak plus the host bytes "
            "(`Prediction.offloaded_bytes`). bf16: the model and gradients in bf16 on DeepSpeed's CPU "
            "accelerator, priced with a bf16 profile; without ZeRO DeepSpeed wraps the optimizer in "
            "FP16_UnfusedOptimizer, and through the pipeline engine in BF16_Optimizer, whose 16-bit gradient "
            "accumulator the pp2 bf16 rows hold beside `.grad` (`dsauto.plan.deepspeed_bf16_optimizer`).")
    return [*lines[:2], note, "", *lines[2:]]


def dp_summary(rows) -> str:
    """The summary line of (model, plan, predicted s, measured s, predicted bytes, measured bytes) rows."""
    time_errors = [abs(p - m) / m for _, _, p, m, _, _ in rows]
    memory_errors = [abs(p - m) / m for _, _, _, _, p, m in rows]
    return (f"median_time_error={statistics.median(time_errors):.3f} max_time_error={max(time_errors):.3f} "
            f"median_memory_error={statistics.median(memory_errors):.3f} "
            f"max_under_prediction={max_under_prediction([(p, m) for _, _, _, _, p, m in rows]):.3f} plans={len(rows)}")


def max_under_prediction(peaks) -> float:
    """The largest (measured - predicted) / measured over (predicted, measured) peak pairs, 0 when
    no peak is under-predicted."""
    return max([0.0] + [(m - p) / m for p, m in peaks])


if __name__ == "__main__":
    main()
