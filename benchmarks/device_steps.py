"""Real Megatron-core training steps on one GPU against dsauto's prediction of them: step time and memory.

    python benchmarks/device_steps.py --measure benchmarks/results/device_steps_h100_run2.json   # on a GPU, ~6 minutes
    python benchmarks/device_steps.py      # anywhere: writes benchmarks/results/device_steps_h100-80gb.md
    python benchmarks/device_steps.py --list-saved benchmarks/results/device_steps_saved_h100.txt   # on a GPU

Each case is a plan dsauto makes for one GPU of the ``h100-80gb`` preset (engine megatron, the
distributed optimizer, bf16) for a model whose layers are a preset's own, fewer of them so that one
GPU holds the model: Llama 2 7B and 13B, Llama 3 8B (GQA, a 128,256-word head) and GPT-2 XL
(LayerNorm, GeLU, biases, learned positions, tied head). Some cases pin the recomputation and the
micro-batch; others leave them to the search, under the preset's budget or a tighter
``--memory-limit``, and so check that the plan the search picks fits the real GPU.

``--measure`` trains each plan with Megatron-core's own modules, as benchmarks/megatron_memory.py
does on CPU (GPTModel with the local layer spec, Float16Module, DistributedDataParallel,
get_megatron_optimizer and its schedules, through dsauto's Megatron plugin), one process per case,
and records the step time (wall, synchronised, the median of the timed steps after warm-up steps),
the peak of the CUDA caching allocator's live bytes over the first optimizer steps (the ones that
create Adam's moments) with the moment it peaked in, the allocator's reserved bytes and the GPU
memory the process holds outside the allocator (CUDA context, libraries). The local layer spec's
attention is Megatron-core's unfused DotProductAttention (Transformer Engine is not needed), so the
plans are priced with eager attention (``--no-flash-attention``).

Without ``--measure`` it reads the measurements and prices the same plans with the preset as it is
now (the measured plan's own choices, whatever the search would pick today), and prints

    device_step_median_error=X% device_memory_median_error=Y% max_under_prediction=Z% plans=N

(errors are predicted / measured - 1; an under-prediction of memory is a measured peak above the
predicted one). Nothing is fitted to these numbers: the preset's compute constants are fitted to
published runs at scale (benchmarks/fit_device.py), and this checks them on single-GPU steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.megatron_memory import batches, build, tracked_training, train_step  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_FILE = RESULTS / "device_steps_h100_run2.json"
HARDWARE = "h100-80gb"
TRACKED_STEPS = 3
"""Steps under the memory tracker: the first creates Adam's moments, the later ones run with them."""
WARMUP_STEPS = 2
TIMED_STEPS = 5
CASE_TIMEOUT_SECONDS = 300
GiB = 2**30


@dataclass(frozen=True)
class Case:
    """One plan to train: a preset's layers, fewer of them, and the pins of its search."""

    name: str
    preset: str
    num_layers: int
    seq_len: int
    global_batch: int
    pins: dict = field(default_factory=dict)
    """make_problem keywords besides the model, hardware, batch and the fixed ones (micro_batch,
    checkpoint, memory_limit, ...)."""

    def model(self):
        from dataclasses import replace

        from dsauto.spec.loaders import load_model

        base = load_model(self.preset)
        return replace(base, name=f"{self.preset}-{self.num_layers}l", num_layers=self.num_layers)

    def problem(self, hardware: str = HARDWARE):
        from dsauto.api import make_problem

        return make_problem(self.model(), hardware, nodes=1, gpus_per_node=1, global_batch=self.global_batch,
                            seq_len=self.seq_len, flash_attention=False, engine="megatron", zero_stage=1,
                            **self.pins)


CASES = (
    Case("llama2-7b x4, mb 2, no recompute", "llama2-7b", 4, 4096, 8, dict(micro_batch=2, checkpoint=False)),
    Case("llama2-7b x4, mb 2, recompute all", "llama2-7b", 4, 4096, 8, dict(micro_batch=2, checkpoint=True)),
    Case("llama2-7b x8, searched", "llama2-7b", 8, 4096, 16),
    Case("llama2-7b x8, searched under 48 GiB", "llama2-7b", 8, 4096, 16, dict(memory_limit="48GiB", offload="none")),
    Case("llama2-7b x8, mb 1, recompute the first 3", "llama2-7b", 8, 4096, 16,
         dict(micro_batch=1, recompute_num_layers=3)),
    Case("llama3-8b x4, mb 1, no recompute", "llama3-8b", 4, 4096, 8, dict(micro_batch=1, checkpoint=False)),
    Case("llama2-13b x4, mb 1, no recompute", "llama2-13b", 4, 4096, 8, dict(micro_batch=1, checkpoint=False)),
    Case("gpt2-xl x12, mb 8, no recompute", "gpt2-xl", 12, 1024, 16, dict(micro_batch=8, checkpoint=False)),
    Case("gpt2-xl x12, mb 8, recompute all", "gpt2-xl", 12, 1024, 16, dict(micro_batch=8, checkpoint=True)),
)
SMOKE_CASES = (
    Case("gpt-tiny, mb 2, no recompute", "gpt-tiny", 2, 128, 4, dict(micro_batch=2, checkpoint=False)),
    Case("gpt-tiny, searched", "gpt-tiny", 2, 128, 4),
)
"""``--smoke``: two tiny plans that run the whole harness on a CPU in a minute (priced on ``cpu``)."""


# ---- the worker: one process, one plan ----------------------------------------------------------------

def worker(plan_path: Path, out_path: Path) -> None:
    """Trains the plan in ``plan_path`` on this process's GPU (or, without one, on the CPU through
    dsauto's Megatron CPU shim) and writes what it measured to ``out_path``."""
    import torch
    import torch.distributed as dist

    import dsauto.megatron as dm
    from dsauto.profile.memory import MemoryTracker

    cuda = torch.cuda.is_available()
    shim = None
    if cuda:
        torch.cuda.set_device(0)
    else:
        from dsauto.compat import megatron_cpu

        shim = megatron_cpu.enable()
    dist.init_process_group("nccl" if cuda else "gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    plan = dm.load_plan(plan_path)
    dm.initialize_model_parallel(plan)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    device = "cuda" if cuda else "cpu"
    data = batches(plan, 1234, device)
    outside_before = _outside_allocator_bytes() if cuda else 0
    tracker = MemoryTracker(device)
    model, optimizer, losses = tracked_training(plan, data, tracker, TRACKED_STEPS)
    record: dict = {"peak_bytes": tracker.peak_bytes(), "losses": losses,
                    **{f"{name}_bytes": tracker.peak_bytes(name)
                       for name in ("built", "forward", "backward", "optimizer", "between")}}
    if cuda:
        record["reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
        record["outside_allocator_bytes"] = _outside_allocator_bytes()
        record["outside_allocator_before_bytes"] = outside_before
    steps = []
    for index in range(WARMUP_STEPS + TIMED_STEPS):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(plan, data, model, optimizer)
        if cuda:
            torch.cuda.synchronize()
        if index >= WARMUP_STEPS:
            steps.append(time.perf_counter() - start)
    record["step_seconds"] = steps
    out_path.write_text(json.dumps(record, indent=1))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if shim is not None:
        shim.disable()


SAVED_CASES = (
    Case("llama2-7b", "llama2-7b", 1, 4096, 1, dict(micro_batch=1, checkpoint=False)),
    Case("llama3-8b", "llama3-8b", 1, 4096, 1, dict(micro_batch=1, checkpoint=False)),
    Case("gpt2-xl", "gpt2-xl", 1, 1024, 8, dict(micro_batch=8, checkpoint=False)),
)
"""``--list-saved``: one layer of each model family the step cases train."""


def list_saved(path: Path) -> None:
    """Writes to ``path`` every tensor autograd saves, by storage, in one forward of each
    :data:`SAVED_CASES` plan's one-layer GPT (this process's GPU, one rank), with the prediction of
    the kept activations (tests/cost/test_megatron_memory.py reads the listing)."""
    import traceback

    import torch
    import torch.distributed as dist

    import dsauto.megatron as dm
    from dsauto.api import find_plans
    from dsauto.profile.launch import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    lines = []
    for case in SAVED_CASES:
        [plan] = find_plans(case.problem())
        dm.initialize_model_parallel(plan)
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        model, optimizer = build(plan, cuda=True)
        batch = next(batches(plan, 1, "cuda"))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, tuple[int, tuple, str, str]] = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in saved and storage.data_ptr() not in params:
                where = "/".join(frame.name for frame in traceback.extract_stack()[-5:-1])
                saved[storage.data_ptr()] = (storage.nbytes(), tuple(tensor.shape),
                                             str(tensor.dtype).removeprefix("torch."), where)
            return tensor

        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        allocated = torch.cuda.memory_allocated() - before
        [stage] = plan.stages
        tokens = plan.micro_batch * plan.seq_len
        lines.append(f"== {case.name}: mb {plan.micro_batch} s {plan.seq_len} tokens {tokens}; allocated by forward "
                     f"{allocated / 2**20:.1f} MiB; predicted activations {stage.activation_bytes / 2**20:.1f} MiB "
                     f"transient {stage.transient_bytes / 2**20:.1f} MiB")
        for nbytes, shape, dtype, where in sorted(saved.values(), key=lambda row: -row[0]):
            if nbytes >= 2**16:
                lines.append(f"{nbytes / 2**20:9.2f} MiB {nbytes / tokens:8.1f} B/tok {shape} {dtype} {where}")
        lines.append(f"total saved MiB {sum(row[0] for row in saved.values()) / 2**20}")
        del out, model, optimizer
        parallel_state.destroy_model_parallel()
        torch.cuda.empty_cache()
    path.write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def _outside_allocator_bytes() -> int:
    """GPU memory in use that the caching allocator has not reserved: the CUDA context, the
    libraries' own buffers (cuBLAS, NCCL) and any other process on the GPU."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


# ---- the driver ---------------------------------------------------------------------------------------

def measure(path: Path, cases: tuple[Case, ...], hardware: str, only: str = "") -> None:
    """Plans and trains every case (one process each) and writes the measurements to ``path``, case by
    case, so that what finished is kept if a later case fails or time runs out."""
    import torch

    from dsauto.api import find_plans
    from dsauto.plan_io import plan_id, write_plan_yaml
    from dsauto.profile.launch import free_port

    work = Path(tempfile.mkdtemp(prefix="dsauto-device-steps-"))
    doc = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "megatron_core": _version("megatron-core"), "hardware": hardware,
           "command": f"python benchmarks/device_steps.py --measure benchmarks/results/{path.name}"
                      + (f" --only '{only}'" if only else ""),
           "cases": []}
    for number, case in enumerate(cases):
        started = time.perf_counter()
        [plan] = find_plans(case.problem(hardware))
        plan_path = write_plan_yaml(plan, work / f"case{number}.yaml")
        out_path = work / f"case{number}.json"
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port())}
        log = work / f"case{number}.log"
        with log.open("w") as out:
            try:
                code = subprocess.run([sys.executable, __file__, "--worker", str(plan_path), str(out_path)], env=env,
                                      stdout=out, stderr=subprocess.STDOUT, timeout=CASE_TIMEOUT_SECONDS).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        entry = {"case": case.name, "plan_yaml": plan_path.read_text(), "plan_id": plan_id(plan)}
        if code == 0 and out_path.exists():
            entry["measured"] = json.loads(out_path.read_text())
            step = statistics.median(entry["measured"]["step_seconds"])
            print(f"{case.name}: step {step * 1e3:.1f} ms (predicted {plan.prediction.step_seconds * 1e3:.1f}), "
                  f"peak {entry['measured']['peak_bytes'] / GiB:.2f} GiB (predicted "
                  f"{plan.prediction.peak_memory_bytes / GiB:.2f}) [{time.perf_counter() - started:.0f} s]", flush=True)
        else:
            entry["failed"] = f"exit {code}: " + log.read_text()[-3000:]
            print(f"{case.name}: failed ({code}); log tail:\n{log.read_text()[-3000:]}", flush=True)
        doc["cases"].append(entry)
        path.write_text(json.dumps(doc, indent=1))


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


@dataclass(frozen=True)
class Row:
    """One measured plan, priced again with the preset as it is now."""

    case: Case
    plan: object
    measured: dict

    @property
    def step(self) -> float:
        return statistics.median(self.measured["step_seconds"])

    @property
    def step_error(self) -> float:
        return self.plan.prediction.step_seconds / self.step - 1

    @property
    def memory_error(self) -> float:
        return self.plan.prediction.peak_memory_bytes / self.measured["peak_bytes"] - 1


def reprice(case: Case, plan_yaml: str, hardware: str):
    """The measured plan's own choices priced with ``hardware``'s preset as it is now."""
    import yaml

    from dsauto.plan_io import plan_from_data
    from dsauto.refine.space import options_of, strategy_of
    from dsauto.search.planner import Planner

    measured_plan = plan_from_data(yaml.safe_load(plan_yaml), "the measured plan")
    problem = case.problem(hardware)
    planner = Planner(problem.model, problem.cluster, problem.train, problem.pins)
    return planner.build_plan(strategy_of(measured_plan), list(measured_plan.stage_layers), options_of(measured_plan))


def compare(path: Path, hardware: str, out: Path | None) -> None:
    """Prices the plans measured in ``path`` with ``hardware``'s preset, prints the summary line and
    (``out``) writes the table and the plot."""

    data = json.loads(path.read_text())
    by_name = {case.name: case for case in CASES + SMOKE_CASES}
    rows, failed = [], []
    for entry in data["cases"]:
        if "measured" not in entry:
            failed.append(entry["case"])
            continue
        case = by_name[entry["case"]]
        rows.append(Row(case, reprice(case, entry["plan_yaml"], hardware), entry["measured"]))
    if not rows:
        sys.exit(f"{path} holds no measured case")
    step_errors = [row.step_error for row in rows]
    memory_errors = [row.memory_error for row in rows]
    under = max([-e for e in memory_errors if e < 0], default=0.0)
    summary = (f"device_step_median_error={statistics.median(abs(e) for e in step_errors):.1%} "
               f"device_memory_median_error={statistics.median(abs(e) for e in memory_errors):.1%} "
               f"max_under_prediction={under:.1%} plans={len(rows)}")
    reserve = _reserve_bytes(hardware)
    lines = [f"# Megatron-core steps on one {data['device']} against the {hardware} preset", "",
             f"Measured with `{data['command']}` (torch {data['torch']}, Megatron-core {data['megatron_core']}, bf16, "
             f"Megatron-core's local layer spec: unfused attention, no Transformer Engine); priced with "
             f"`python benchmarks/device_steps.py --hardware {hardware}` (the measured plan's own choices, priced "
             "with eager attention). Error = predicted / measured - 1 (negative: the preset is too fast, or "
             "memory under-predicted).", "", f"`{summary}`", "",
             "| case | plan | measured step ms | predicted ms | error | measured peak GiB | predicted GiB | error | "
             "peaked in | reserved GiB | outside the allocator GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        m = row.measured
        moment = max(("forward", "backward", "optimizer"), key=lambda name: m[f"{name}_bytes"])
        lines.append(
            f"| {row.case.name} | {_plan_words(row.plan)} | {row.step * 1e3:.1f} | "
            f"{row.plan.prediction.step_seconds * 1e3:.1f} | {row.step_error:+.1%} | {m['peak_bytes'] / GiB:.2f} | "
            f"{row.plan.prediction.peak_memory_bytes / GiB:.2f} | {row.memory_error:+.1%} | {moment} | "
            f"{m.get('reserved_peak_bytes', 0) / GiB:.2f} | {m.get('outside_allocator_bytes', 0) / GiB:.2f} |")
    lines += ["", "Model state and the peaks of each moment of the step (GiB): the allocator's live bytes after the "
              "model and optimizer are built, against the prediction's parameters, gradients and optimizer "
              "states (Adam's moments appear at the first step), and the predicted peak.", "",
              "| case | built | predicted state | between steps | forward peak | backward peak | optimizer peak | "
              "predicted peak |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        m, [stage] = row.measured, row.plan.stages
        state = stage.params_bytes + stage.grads_bytes + stage.optimizer_bytes
        lines.append(f"| {row.case.name} | {m['built_bytes'] / GiB:.2f} | {state / GiB:.2f} | "
                     f"{m['between_bytes'] / GiB:.2f} | {m['forward_bytes'] / GiB:.2f} | "
                     f"{m['backward_bytes'] / GiB:.2f} | "
                     f"{m['optimizer_bytes'] / GiB:.2f} | {stage.peak_bytes / GiB:.2f} |")
    if reserve:
        worst = max(m.get("reserved_peak_bytes", 0) - m["peak_bytes"] + m.get("outside_allocator_bytes", 0)
                    for m in (row.measured for row in rows))
        lines += ["", f"What the GPU holds beyond the live bytes (the allocator's reserve over its peak, plus the "
                  f"memory outside the allocator) reached {worst / GiB:.2f} GiB; the preset sets aside "
                  f"{reserve / GiB:.2f} GiB (memory_reserve_bytes) for it."]
    if failed:
        lines += ["", f"Cases that did not run: {', '.join(failed)}."]
    text = "\n".join(lines) + "\n"
    print(summary)
    if out is not None:
        from benchmarks.device_layers import write_report

        write_report(out, text)
        _plot(rows, out.with_suffix(".png"), f"Megatron-core on one {data['device']} vs {hardware}\n{summary}")
        print(f"wrote {out} and {out.with_suffix('.png')}")


def _plan_words(plan) -> str:
    choices = [plan.layer_choice(j) for j in range(1, plan.model.num_layers + 1)]
    checkpointed = sum(c.checkpoint for c in choices)
    modules = sorted({m for c in choices for m in c.recompute_modules})
    selective = f", {'+'.join(modules)} recomputed" if modules else ""
    return (f"mb {plan.micro_batch} x {plan.grad_accum}, {checkpointed} of {plan.model.num_layers} layers "
            f"recomputed{selective}")


def _reserve_bytes(hardware: str) -> int:
    from dsauto.spec.loaders import load_hardware

    return load_hardware(hardware).device.memory_reserve_bytes


def _plot(rows: list[Row], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4.8))
    FigureCanvasAgg(figure)
    for index, (label, unit, measured, predicted) in enumerate((
            ("step time", "ms", [r.step * 1e3 for r in rows], [r.plan.prediction.step_seconds * 1e3 for r in rows]),
            ("peak memory", "GiB", [r.measured["peak_bytes"] / GiB for r in rows],
             [r.plan.prediction.peak_memory_bytes / GiB for r in rows]))):
        ax = figure.add_subplot(1, 2, index + 1)
        low, high = min(measured + predicted) * 0.9, max(measured + predicted) * 1.1
        ax.plot([low, high], [low, high], color="grey", linewidth=0.8)
        ax.scatter(measured, predicted, s=18)
        for row, x, y in zip(rows, measured, predicted):
            ax.annotate(row.case.name, (x, y), fontsize=6, xytext=(3, -8), textcoords="offset points")
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
        ax.set_xlabel(f"measured {label} ({unit})")
        ax.set_ylabel(f"predicted {label} ({unit})")
    figure.suptitle(title, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", type=Path, default=None, metavar="FILE", help="train the cases here into FILE")
    parser.add_argument("--only", default="",
                        help="with --measure: only the cases whose name contains one of these comma-separated words")
    parser.add_argument("--smoke", action="store_true", help="two tiny cases priced on the cpu preset (a CPU check)")
    parser.add_argument("--file", type=Path, default=DEFAULT_FILE, help="measurements to compare against")
    parser.add_argument("--hardware", default=None, help=f"preset to price with (default: {HARDWARE})")
    parser.add_argument("--list-saved", type=Path, default=None, metavar="FILE",
                        help="on a GPU: list the tensors one layer of each model family saves into FILE")
    parser.add_argument("--worker", nargs=2, type=Path, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if args.list_saved is not None:
        list_saved(args.list_saved)
        return
    hardware = args.hardware or ("cpu" if args.smoke else HARDWARE)
    if args.measure is not None:
        words = args.only.split(",")
        cases = tuple(case for case in (SMOKE_CASES if args.smoke else CASES) if any(w in case.name for w in words))
        if not cases:
            sys.exit(f"no case's name contains {args.only!r}")
        measure(args.measure, cases, hardware, args.only)
        return
    out = None if args.smoke else RESULTS / f"device_steps_{hardware}.md"
    compare(args.file, hardware, out)


if __name__ == "__main__":
    main()
