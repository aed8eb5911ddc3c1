"""The expert GEMMs of mixtures of experts on a GPU against the preset's price of them.

Megatron-core runs the routed experts of a rank as grouped GEMMs (``--moe-grouped-gemm``): one
kernel multiplies each local expert's tokens by that expert's matrix. dsauto prices them as matrix
multiplies of the experts' FLOPs at the device's GEMM efficiency, the smallest of the width, the
expert's hidden size and the tokens per expert setting the shape
(:func:`dsauto.cost.terms.expert_gemm_seconds`). The H100 constants behind that price were fitted
to published step times of dense models; this benchmark times the experts' GEMMs themselves, on a
GPU, for the expert shapes of the mixture-of-experts families dsauto reads (their Hugging Face
configs in tests/spec/configs), with balanced routing at expert-parallel degrees 1 and 8 (fewer
local experts, more tokens each) and 4096 or 16384 tokens per rank:

- grouped: ``torch._grouped_mm`` over the local experts, the first (gated: twice as wide) and the
  second matrix of the expert MLP, forward and backward (the weights' gradients included);
- dense: the same FLOPs as one GEMM of all the routed tokens by one expert's matrices, the rate
  the shape-free price assumes.

With ``--measure FILE`` (on a GPU) it writes the times to FILE; without, it reads the file, prices
the same shapes with the preset, and writes a table. It also prints the device's
``grouped_gemm_knee_tokens`` that the measured files give (:func:`fit_knee`: grouped over dense time,
against 1 + (knee / tokens per expert)^2, each run's long groups as its own baseline); the H100 and
H200 presets carry the value from the two H100 runs, so their comparison with those runs is in
sample for that one constant.

Run: python benchmarks/device_experts.py --measure benchmarks/results/device_experts_h100.json   (on a GPU)
     python benchmarks/device_experts.py                                                        (anywhere)
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: benchmarks/ is not a package path
from device_layers import _event_seconds, run_device_check, write_report  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
CONFIGS = ROOT / "tests" / "spec" / "configs"
MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3", "olmoe-1b-7b", "qwen1.5-moe-a2.7b")
EXPERT_PARALLEL = (1, 8)
SEQ_LEN = 4096
MICRO_BATCHES = (1, 4)
WEIGHT_BYTES_LIMIT = 16 * 2**30
"""Shapes whose local experts' weights (bf16, with their gradients) exceed this are skipped."""
TOKEN_BANDS = ((0, 512), (512, 1024), (1024, 2**31))
"""Tokens per expert by which the results are summarised."""
ALIGN = 16
"""Rows per group are rounded to this (the grouped kernel's alignment)."""


def load(name: str):
    from dsauto.spec.hf import model_from_hf_config

    return model_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)


def shapes(name: str):
    """(ep, tokens per rank, local experts, tokens per expert, hidden, expert width, gated) of one model."""
    model = load(name)
    width = model.moe_ffn_hidden_size or model.ffn_hidden_size
    gated = model.mlp in ("swiglu", "geglu")
    for ep in EXPERT_PARALLEL:
        if model.num_experts % ep:
            continue
        local = model.num_experts // ep
        weights = 2 * 2 * local * model.hidden_size * width * (3 if gated else 2)
        if weights > WEIGHT_BYTES_LIMIT:
            continue
        for micro_batch in MICRO_BATCHES:
            tokens = micro_batch * SEQ_LEN
            per_expert = tokens * model.moe_top_k * ep // model.num_experts
            per_expert = max(ALIGN, per_expert // ALIGN * ALIGN)
            yield ep, tokens, local, per_expert, model.hidden_size, width, gated


def _pass_seconds(rows: int, k: int, n: int, groups: int, grouped: bool) -> float:
    """Forward and backward of [rows x k] by ``groups`` matrices [k x n] (grouped), or by one."""
    import torch

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if grouped:
        w = (torch.randn(groups, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).requires_grad_()
        offs = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * (rows // groups)

        def forward():
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    else:
        w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).requires_grad_()

        def forward():
            return x @ w.t()
    grad = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)

    def step():
        forward().backward(grad)
        x.grad = w.grad = None
    return _event_seconds(step, warmup=3, repeats=10)


def measure(path: Path, models: list[str]) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("--measure needs a CUDA GPU.")
    data = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": "bf16",
            "command": "python benchmarks/device_experts.py --measure benchmarks/results/" + path.name, "rows": []}
    for name in models:
        for ep, tokens, local, per_expert, hidden, width, gated in shapes(name):
            rows = local * per_expert
            row = {"model": name, "ep": ep, "tokens": tokens, "local_experts": local, "tokens_per_expert": per_expert,
                   "hidden": hidden, "width": width, "gated": gated}
            for kind, grouped in (("grouped", True), ("dense", False)):
                try:
                    first = _pass_seconds(rows, hidden, width * (2 if gated else 1), local, grouped)
                    second = _pass_seconds(rows, width, hidden, local, grouped)
                    row[f"{kind}_seconds"] = first + second
                except (RuntimeError, torch.OutOfMemoryError) as exc:
                    row[f"{kind}_error"] = str(exc).splitlines()[0][:200]
                torch.cuda.empty_cache()
            data["rows"].append(row)
            flops = 3 * 2 * rows * hidden * width * (3 if gated else 2)
            rates = {k: f"{flops / row[f'{k}_seconds'] / 1e12:.0f}" for k in ("grouped", "dense")
                     if f"{k}_seconds" in row}
            print(f"{name} ep{ep} tokens {tokens}: {local} experts x {per_expert} tokens, TFLOP/s {rates}",
                  flush=True)
            path.write_text(json.dumps(data, indent=1) + "\n")


def predicted_seconds(hardware: str, row: dict) -> float:
    """Forward + backward of the local experts' GEMMs as the preset prices them, balanced (the
    busiest rank's load factor divided out: the timed routing is even)."""
    from dsauto.cost.layer import CostModel
    from dsauto.cost.strategy import Strategy
    from dsauto.cost.terms import expert_gemm_seconds, expert_load_factor
    from dsauto.parallel import ParallelDims
    from dsauto.spec.loaders import load_cluster
    from dsauto.spec.model import layer_groups
    from dsauto.spec.training import TrainSpec

    model = load(row["model"])
    micro_batch = row["tokens"] // SEQ_LEN
    cluster = load_cluster(hardware, nodes=1)
    train = TrainSpec(global_batch=micro_batch * row["ep"], seq_len=SEQ_LEN, dtype="bf16")
    strategy = Strategy(dims=ParallelDims(dp=row["ep"], ep=row["ep"]), zero_stage=0, micro_batch=micro_batch,
                        grad_accum=1, sequence_parallel=False, engine="megatron")
    ctx = CostModel(cluster, train, strategy, model.hidden_size).context
    group = next(g for g in layer_groups(model, SEQ_LEN, train.dtype_bytes, 1) if g.num_experts)
    # A group averages its layers: a dense first layer (DeepSeek's) thins its expert FLOPs per token.
    per_layer = 2 * model.moe_top_k * row["hidden"] * row["width"] * (3 if row["gated"] else 2)
    averaged = per_layer / group.expert_matmul_flops_per_token
    return 3 * expert_gemm_seconds(group, ctx) / expert_load_factor(ctx) * averaged


MEASURED_RUNS = ("device_experts_h100.json", "device_experts_h100_run2.json")
"""The H100 runs the presets' ``grouped_gemm_knee_tokens`` comes from."""
LONG_GROUPS = 4096
"""Tokens per expert from which a run's grouped GEMMs are taken as long: its baseline."""


def fit_knee(paths: Sequence[Path]) -> tuple[float, float]:
    """(knee, largest |log error|): the tokens per expert at which grouped GEMMs take twice the dense
    GEMM's time, least squares in log space over every row of the runs in ``paths``, each run's
    grouped over dense time divided by its median over the long groups (the kernel's own offset)."""
    ratios = []
    for path in paths:
        rows = [r for r in json.loads(path.read_text())["rows"] if "grouped_seconds" in r and "dense_seconds" in r]
        long = statistics.median(r["grouped_seconds"] / r["dense_seconds"] for r in rows
                                 if r["tokens_per_expert"] >= LONG_GROUPS)
        ratios += [(r["tokens_per_expert"], r["grouped_seconds"] / r["dense_seconds"] / long) for r in rows]

    def errors(knee: float) -> list[float]:
        return [math.log(ratio) - math.log(1 + (knee / tokens) ** 2) for tokens, ratio in ratios]
    knee = min(range(0, 1024), key=lambda k: sum(e * e for e in errors(k)))
    return float(knee), max(abs(e) for e in errors(knee))


def compare(path: Path, hardware: str, out: Path) -> None:
    from dsauto.spec.loaders import load_hardware

    data = json.loads(path.read_text())
    peak = load_hardware(hardware).device.flops("bf16")
    lines = [f"# Expert GEMMs: the {hardware} preset against {data['device']}", "",
             f"Measured with `{data['command']}` (torch {data['torch']}, bf16, balanced routing, sequences of "
             f"{SEQ_LEN} tokens); priced with `python benchmarks/device_experts.py --hardware {hardware}`. "
             "Forward and backward of both expert matrices; % of the preset's peak; error = predicted / measured "
             "grouped - 1 (negative: the preset is too fast).", "",
             "| model | ep | tokens / rank | local experts x tokens each | hidden x width | grouped % of peak | "
             "dense % of peak | grouped / dense time | predicted % of peak | error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    errors, ratios = [], []
    for row in data["rows"]:
        flops = 3 * 2 * row["local_experts"] * row["tokens_per_expert"] * row["hidden"] * row["width"] * (
            3 if row["gated"] else 2)
        predicted = predicted_seconds(hardware, row)
        grouped, dense = row.get("grouped_seconds"), row.get("dense_seconds")
        share = lambda s: f"{flops / s / peak:.0%}" if s else "-"  # noqa: E731
        error = predicted / grouped - 1 if grouped else None
        if error is not None:
            errors.append(error)
        if grouped and dense:
            ratios.append(grouped / dense)
        lines.append(f"| {row['model']} | {row['ep']} | {row['tokens']} | {row['local_experts']} x "
                     f"{row['tokens_per_expert']} | {row['hidden']} x {row['width']} | {share(grouped)} | "
                     f"{share(dense)} | {grouped / dense if grouped and dense else float('nan'):.2f} | "
                     f"{share(predicted)} | {'-' if error is None else f'{error:+.1%}'} |")
    headline = [f"grouped expert GEMMs ({len(errors)}): predicted / measured - 1 median "
                f"{statistics.median(errors):+.1%}, from {min(errors):+.1%} to {max(errors):+.1%}; grouped over "
                f"dense time median {statistics.median(ratios):.2f}" if errors else "no grouped rows"]
    for low, high in TOKEN_BANDS:
        band = [(predicted_seconds(hardware, r) / r["grouped_seconds"] - 1, r["grouped_seconds"] / r["dense_seconds"])
                for r in data["rows"] if low <= r["tokens_per_expert"] < high and "grouped_seconds" in r
                and "dense_seconds" in r]
        if band:
            headline.append(f"{low} to {high - 1 if high < 2**31 else 'more'} tokens per expert ({len(band)}): error "
                            f"from {min(e for e, _ in band):+.1%} to {max(e for e, _ in band):+.1%}, grouped over "
                            f"dense time {min(r for _, r in band):.2f} to {max(r for _, r in band):.2f}")
    runs = [RESULTS / name for name in MEASURED_RUNS if (RESULTS / name).exists()]
    if runs:
        knee, worst = fit_knee(runs)
        headline.append(f"grouped_gemm_knee_tokens from {', '.join(p.name for p in runs)}: {knee:.0f} (largest "
                        f"error {worst:.0%}); the {hardware} preset holds "
                        f"{load_hardware(hardware).device.grouped_gemm_knee_tokens:.0f}")
    print("\n".join(headline))
    lines[2:2] = [*(f"- {h}" for h in headline), ""]
    write_report(out, "\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    run_device_check(__doc__, "device_experts", measure, compare, MODELS, "the expert GEMMs")
