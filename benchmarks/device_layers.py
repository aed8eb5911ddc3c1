"""The device constants of a GPU preset against layers and GEMMs timed on that GPU.

The H100 / H200 constants of ``templates/hardware`` are fitted to published step times of whole
runs (benchmarks/fit_device.py); nothing in them was measured on the chip itself. This benchmark
checks them on one: it times, on a GPU,

- bf16 GEMMs of [8192 x 8192] by [8192 x d] and [8192 x d] by [d x 8192] for d from 128 to 8192,
  against ``matmul_efficiency * d / (d + matmul_half_dim)`` (the preset's shape model);
- torch's AdamW over 2^24 fp32 parameters, multi-tensor and fused (dsauto's DeepSpeed configs ask
  for the fused one), against the preset's bandwidth-bound price of the update
  (``memory_bandwidth_efficiency``);
- the forward and backward of the reference transformer layer (the one DeepSpeed plans train,
  dsauto.models.gpt.Block, with PyTorch's scaled-dot-product attention) at each tensor-parallel
  shard shape of several model presets, against the analytic compute of that shard
  (:func:`dsauto.cost.terms.compute_passes`: the roofline with the preset's constants);

and writes what it timed to a JSON file (``--measure``). Without ``--measure`` it reads that file,
prices the same shapes with the preset and prints the errors, and writes a table and a plot. Nothing
is fitted to these numbers: they check constants fitted elsewhere. Collectives are not timed (one
GPU).

Run: python benchmarks/device_layers.py --measure benchmarks/results/device_layers_h100.json   (on a GPU)
     python benchmarks/device_layers.py                                                      (anywhere)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_FILE = RESULTS / "device_layers_h100.json"
MODELS = ("gpt2-xl", "llama2-7b", "llama3-8b", "llama2-13b", "llama3-70b", "gpt3-175b", "llama3-405b")
"""Model presets whose layers are timed: hidden sizes 1600 to 16384."""
GEMM_DIMS = (128, 256, 512, 1024, 2048, 4096, 8192)
GEMM_SIZE = 8192
"""The two large dimensions of every timed GEMM."""
MICRO_BATCHES = (1, 2)
SEQ_LEN = 2048


def _event_seconds(run, warmup: int, repeats: int) -> float:
    """Median GPU seconds of ``run()`` between CUDA events, after ``warmup`` untimed calls."""
    import torch

    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _gemm_seconds(m: int, k: int, n: int) -> float:
    """Median seconds of one bf16 [m x k] by [k x n] product on the current GPU."""
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return _event_seconds(lambda: a @ b, warmup=5, repeats=20)


def measure(path: Path, models: list[str]) -> None:
    """Times the GEMMs and the layers on this machine's GPU and writes them to ``path`` (rewritten
    after each model, so that a run cut short keeps what it timed)."""
    import torch

    from dsauto.profile.layers import profile_layers
    from dsauto.profile.run import measure_optimizer
    from dsauto.spec.loaders import load_model

    if not torch.cuda.is_available():
        sys.exit("--measure needs a CUDA GPU.")
    device = torch.device("cuda", 0)
    data: dict = {
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(), "dtype": "bf16",
        "command": "python benchmarks/device_layers.py --measure benchmarks/results/" + path.name, "gemms": [], "layers": [], "stacks": [], "graphs": [],
    }
    for d in GEMM_DIMS:
        for shape in ((GEMM_SIZE, GEMM_SIZE, d), (GEMM_SIZE, d, GEMM_SIZE)):
            seconds = _gemm_seconds(*shape)
            flops = 2 * shape[0] * shape[1] * shape[2]
            data["gemms"].append({"m": shape[0], "k": shape[1], "n": shape[2], "seconds": seconds})
            print(f"gemm m={shape[0]} k={shape[1]} n={shape[2]}: {flops / seconds / 1e12:.0f} TFLOP/s", flush=True)
    data["optimizer_seconds_per_param"] = measure_optimizer(2**24, torch.float32, device, 3, 7, fused=False)
    data["fused_optimizer_seconds_per_param"] = measure_optimizer(2**24, torch.float32, device, 3, 7, fused=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    for name in models:
        model = load_model(name)
        tps = [t for t in (1, 2, 4, 8) if model.tp_problem(t) is None]
        seq_len = min(SEQ_LEN, model.max_position_embeddings)
        started = time.perf_counter()
        with torch.device(device):  # build each shard on the GPU: a 16384-wide layer takes minutes on the host
            layers = profile_layers(model, seq_len, MICRO_BATCHES, tps, torch.bfloat16, device, warmup=3, repeats=7)
            data["stacks"] += _stack_rows(name, model, seq_len, tps, device)
            data["graphs"] += _graph_rows(name, model, seq_len, tps)
        for m in layers:
            data["layers"].append({"model": name, "group": m.group, "tp": m.tp, "micro_batch": m.micro_batch, "seq_len": seq_len,
                                   "checkpoint": m.checkpoint, "forward_seconds": m.forward_seconds,
                                   "backward_seconds": m.backward_seconds})
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"{name}: {len(layers)} layer measurements in {time.perf_counter() - started:.0f} s", flush=True)
        torch.cuda.empty_cache()


STACK = 8
"""Transformer layers in the stack timed as a whole (one synchronisation per pass, as in a step)."""


def _stacks(model, tps: list[int], seq_len: int):
    """For each TP degree: :data:`STACK` bf16 shards of the reference layer in a row and an input of
    micro-batch 1; skipped where 8 shards and their gradients would not fit (GPU-bound anyway)."""
    import torch

    from dsauto.models.gpt import Block

    for tp in tps:
        torch.manual_seed(0)
        first = Block(model, tp=tp).to(dtype=torch.bfloat16)
        if STACK * sum(p.numel() for p in first.parameters()) > 8e9:
            continue
        stack = torch.nn.Sequential(first, *(Block(model, tp=tp).to(dtype=torch.bfloat16) for _ in range(STACK - 1)))
        yield tp, stack, torch.randn(1, seq_len, model.hidden_size, dtype=torch.bfloat16, requires_grad=True)


def _stack_rows(name: str, model, seq_len: int, tps: list[int], device) -> list[dict]:
    """Forward and backward of :data:`STACK` layer shards in a row, micro-batch 1, per layer, one
    synchronisation per pass: the host issues each layer while the GPU runs the one before."""
    from dsauto.profile.layers import median_seconds

    rows = []
    for tp, stack, x in _stacks(model, tps, seq_len):
        def step() -> None:
            stack(x).sum().backward()
            stack.zero_grad(set_to_none=True)

        forward = median_seconds(lambda: stack(x), device, warmup=3, repeats=7)
        both = median_seconds(step, device, warmup=3, repeats=7)
        rows.append({"model": name, "tp": tp, "micro_batch": 1, "seq_len": seq_len, "layers": STACK,
                     "forward_seconds": forward / STACK, "backward_seconds": (both - forward) / STACK})
    return rows


def _graph_rows(name: str, model, seq_len: int, tps: list[int]) -> list[dict]:
    """The same stacks run as one CUDA graph (forward and backward captured, then replayed): the
    GPU's own time per layer, without the host issuing kernels; models without dropout only."""
    import torch

    if model.dropout:
        return []
    rows = []
    for tp, stack, x in _stacks(model, tps, seq_len):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                stack(x).sum().backward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            stack(x).sum().backward()
        rows.append({"model": name, "tp": tp, "micro_batch": 1, "seq_len": seq_len, "layers": STACK,
                     "seconds": _event_seconds(graph.replay, warmup=3, repeats=7) / STACK})
        del graph
    return rows


def predicted_gemm_seconds(hardware: str, m: int, k: int, n: int) -> float:
    from dsauto.cost.terms import DeviceModel
    from dsauto.spec.loaders import load_hardware

    device = DeviceModel.of(load_hardware(hardware).device, "bf16")
    return device.matmul_seconds(2 * m * k * n, min(m, k, n))


def predicted_layer(hardware: str, model_name: str, group_name: str, tp: int, micro_batch: int,
                    seq_len: int) -> tuple[float, float]:
    """(forward, backward) seconds the preset's roofline gives one shard of a layer (compute only)."""
    from dsauto.cost.layer import CostModel
    from dsauto.cost.strategy import LayerOption, Strategy
    from dsauto.cost.terms import compute_passes
    from dsauto.parallel import ParallelDims
    from dsauto.spec.loaders import load_cluster, load_model
    from dsauto.spec.model import layer_groups
    from dsauto.spec.training import TrainSpec

    model = load_model(model_name)
    cluster = load_cluster(hardware, nodes=1)
    train = TrainSpec(global_batch=micro_batch, seq_len=seq_len, dtype="bf16")
    strategy = Strategy(dims=ParallelDims(tp=tp), zero_stage=0, micro_batch=micro_batch, grad_accum=1,
                        sequence_parallel=False)
    cost = CostModel(cluster, train, strategy, model.hidden_size)
    kind = {"embedding": "embedding", "head": "head"}.get(group_name, "transformer")
    group = next(g for g in layer_groups(model, seq_len, train.dtype_bytes, tp) if g.kind == kind)
    passes = compute_passes(group, LayerOption(checkpoint=False, shard_params=False, split=1), cost.context)
    return passes.forward_seconds, passes.backward_seconds


def compare(path: Path, hardware: str, out: Path | None) -> None:
    data = json.loads(path.read_text())
    lines = [f"# {hardware} constants against {data['device']}", "",
             f"Measured with `{data['command']}` (torch {data['torch']}, cuDNN {data['cudnn']}, bf16, "
             f"sequences of {SEQ_LEN} tokens or the model's maximum); priced with `python benchmarks/device_layers.py "
             f"--hardware {hardware}`. Error = predicted / measured - 1 (negative: the preset is too fast).", "",
             "## GEMMs", "", "| m x k x n | measured TFLOP/s | predicted TFLOP/s | error |", "|---|---|---|---|"]
    gemm_errors = []
    for g in data["gemms"]:
        flops = 2 * g["m"] * g["k"] * g["n"]
        predicted = predicted_gemm_seconds(hardware, g["m"], g["k"], g["n"])
        error = predicted / g["seconds"] - 1
        gemm_errors.append(error)
        lines.append(f"| {g['m']} x {g['k']} x {g['n']} | {flops / g['seconds'] / 1e12:.0f} | "
                     f"{flops / predicted / 1e12:.0f} | {error:+.1%} |")
    if "optimizer_seconds_per_param" in data:
        from dsauto.cost.layer import ADAM_BYTES_PER_PARAM
        from dsauto.cost.terms import DeviceModel
        from dsauto.spec.loaders import load_hardware

        measured = data["optimizer_seconds_per_param"]
        predicted = DeviceModel.of(load_hardware(hardware).device, "bf16").memory_seconds(ADAM_BYTES_PER_PARAM)
        lines += ["", f"AdamW update (torch, foreach): measured {measured * 1e12:.1f} ps per parameter, "
                      f"predicted {predicted * 1e12:.1f} ps ({predicted / measured - 1:+.1%})."]
        if "fused_optimizer_seconds_per_param" in data:
            fused = data["fused_optimizer_seconds_per_param"]
            lines.append(f"AdamW update (torch, fused=True): measured {fused * 1e12:.1f} ps per parameter "
                         f"({predicted / fused - 1:+.1%}).")
    rows = [r for r in data["layers"] if not r["checkpoint"]]
    lines += ["", "## Layers (forward + backward, one shard, no recomputation)", "",
              "| model | layer | tp | micro-batch x tokens | measured ms | predicted ms | error |", "|---|---|---|---|---|---|---|"]
    block_errors, edge_errors, points = [], [], []
    for r in rows:
        forward, backward = predicted_layer(hardware, r["model"], r["group"], r["tp"], r["micro_batch"],
                                            r["seq_len"])
        measured = r["forward_seconds"] + r["backward_seconds"]
        error = (forward + backward) / measured - 1
        (edge_errors if r["group"] in ("embedding", "head") else block_errors).append(error)
        points.append((measured, forward + backward, r["group"] in ("embedding", "head")))
        lines.append(f"| {r['model']} | {r['group']} | {r['tp']} | {r['micro_batch']} x {r['seq_len']} | {measured * 1e3:.2f} | "
                     f"{(forward + backward) * 1e3:.2f} | {error:+.1%} |")

    alone = {(r["model"], r["tp"]): r for r in rows if r["micro_batch"] == 1 and r["group"] not in ("embedding", "head")}
    if data.get("stacks"):
        lines += ["", f"## A layer inside a stack of {STACK} (one synchronisation per pass) against the same layer "
                  "timed alone", "", "| model | tp | alone ms | in the stack ms | predicted ms | error vs the stack |",
                  "|---|---|---|---|---|---|"]
        stack_errors = []
        for r in data["stacks"]:
            forward, backward = predicted_layer(hardware, r["model"], alone[(r["model"], r["tp"])]["group"], r["tp"],
                                                1, r["seq_len"])
            single = alone[(r["model"], r["tp"])]
            in_stack = r["forward_seconds"] + r["backward_seconds"]
            error = (forward + backward) / in_stack - 1
            stack_errors.append(error)
            lines.append(f"| {r['model']} | {r['tp']} | {(single['forward_seconds'] + single['backward_seconds']) * 1e3:.2f}"
                         f" | {in_stack * 1e3:.2f} | {(forward + backward) * 1e3:.2f} | {error:+.1%} |")

    graph_errors = []
    if data.get("graphs"):
        stacked = {(r["model"], r["tp"]): r for r in data.get("stacks", [])}
        lines += ["", f"## The stack of {STACK} as one CUDA graph: the GPU's own time, no host", "",
                  "| model | tp | eager in the stack ms | graph replay ms | predicted ms | error vs the graph |",
                  "|---|---|---|---|---|---|"]
        for r in data["graphs"]:
            forward, backward = predicted_layer(hardware, r["model"], alone[(r["model"], r["tp"])]["group"], r["tp"],
                                                1, r["seq_len"])
            eager = stacked.get((r["model"], r["tp"]))
            eager_ms = f"{(eager['forward_seconds'] + eager['backward_seconds']) * 1e3:.2f}" if eager else "-"
            error = (forward + backward) / r["seconds"] - 1
            graph_errors.append(error)
            lines.append(f"| {r['model']} | {r['tp']} | {eager_ms} | {r['seconds'] * 1e3:.2f} | "
                         f"{(forward + backward) * 1e3:.2f} | {error:+.1%} |")

    def summary(errors: list[float]) -> str:
        if not errors:
            return "none"
        return (f"median {statistics.median(errors):+.1%}, median |error| "
                f"{statistics.median(abs(e) for e in errors):.1%}, from {min(errors):+.1%} to {max(errors):+.1%}")

    headline = [f"GEMMs ({len(gemm_errors)}): {summary(gemm_errors)}",
                f"transformer layers ({len(block_errors)}): {summary(block_errors)}",
                f"embedding and head ({len(edge_errors)}): {summary(edge_errors)}"]
    if graph_errors:
        headline.append(f"transformer layers as one CUDA graph, micro-batch 1 ({len(graph_errors)}): "
                        f"{summary(graph_errors)}")
    if data.get("stacks"):
        headline.append(f"transformer layers inside a stack of {STACK}, micro-batch 1 ({len(stack_errors)}): "
                        f"{summary(stack_errors)}")
    print("\n".join(headline))
    median_abs = statistics.median(abs(e) for e in block_errors) if block_errors else float("nan")
    print(f"device_layer_median_error={median_abs:.3f} device_layers={len(block_errors)}")
    if out is not None:
        lines[2:2] = [*(f"- {h}" for h in headline), ""]
        write_report(out, "\n".join(lines) + "\n")
        _plot(points, out.with_suffix(".png"), f"{hardware} roofline vs {data['device']}")
        print(f"wrote {out} and {out.with_suffix('.png')}")


READING = "\n## Reading"
"""The heading from which a results file is written by hand: a rerun keeps that part."""


def write_report(out: Path, text: str) -> None:
    """Writes ``text`` to ``out``, keeping the hand-written part of the file it replaces (from its
    :data:`READING` heading on)."""
    old = out.read_text() if out.exists() else ""
    kept = old[old.find(READING):] if READING in old else ""
    out.write_text(text + kept)


def _plot(points: list[tuple[float, float, bool]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for edge, label, marker in ((False, "transformer layer", "o"), (True, "embedding / head", "s")):
        xs = [m * 1e3 for m, _, e in points if e == edge]
        ys = [p * 1e3 for _, p, e in points if e == edge]
        ax.scatter(xs, ys, label=label, marker=marker, s=18)
    low = min(min(m, p) for m, p, _ in points) * 1e3
    high = max(max(m, p) for m, p, _ in points) * 1e3
    ax.plot([low, high], [low, high], color="grey", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured forward + backward (ms)")
    ax.set_ylabel("predicted (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_device_check(doc: str, name: str, measure, compare, models: Sequence[str], what: str) -> None:
    """The command line of a device check ``benchmarks/{name}.py``: ``--measure FILE`` runs
    ``measure(FILE, models)`` on a GPU; otherwise ``compare(file, hardware, out)`` writes
    benchmarks/results/{name}_{hardware}.md from the measurements in ``--file``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--measure", type=Path, default=None, metavar="FILE", help=f"time {what} on this GPU into FILE")
    parser.add_argument("--models", default=",".join(models), help="models to time (with --measure)")
    parser.add_argument("--file", type=Path, default=RESULTS / f"{name}_h100.json",
                        help="measurements to compare against")
    parser.add_argument("--hardware", default="h100-80gb", help="preset whose constants are checked")
    args = parser.parse_args()
    if args.measure is not None:
        measure(args.measure, args.models.split(","))
        return
    compare(args.file, args.hardware, RESULTS / f"{name}_{args.hardware}.md")


if __name__ == "__main__":
    run_device_check(__doc__, "device_layers", measure, compare, MODELS, "the GEMMs and layers")
