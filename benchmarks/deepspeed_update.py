"""The memory of DeepSpeed's ZeRO optimizer update, measured tensor by tensor, against the cost model.

ZeRO 1-3 hand torch's AdamW a flat fp32 partition and, as its gradient, the partition's gradients
flattened and cast to fp32 (dsauto.cost.step.optimizer_step_bytes): with 16-bit gradients both the
flat 16-bit copy and its fp32 cast are alive at once, and ZeRO-3 does it one ``sub_group_size``
sub-group at a time. This measures the peak of live tensor bytes during ``engine.step()`` on 2 CPU
ranks (gloo, DeepSpeed's CPU accelerator, the emitted optimizer: torch's fused AdamW) for a model
of eight 1024 x 1024 linear layers without biases and one token a step, so that the update is
the step's peak, in fp32 and bf16, under ZeRO-1, -2 and -3, and under ZeRO-3 with sub-groups of
2**20 elements (two layers' partitions), and under DeepSpeed-Ulysses (ZeRO-3 over one
sequence-parallel group of both ranks, whose reduction bucket is fp32); and prices each with
``optimizer_step_bytes`` from the model's parameter count. Under DeepSpeed-Ulysses it also
compares what backward's peak gains over the same case without it (each reduction's fp32 copy)
with what the cost model adds. Without ZeRO, bf16 runs DeepSpeed's FP16_UnfusedOptimizer, which casts every
gradient to fp32 at once. Results: benchmarks/results/deepspeed_update.md.

Run: python benchmarks/deepspeed_update.py      (launches 2 DeepSpeed ranks itself; about a minute)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HIDDEN, LAYERS, DP = 1024, 8, 2
BUCKET_ELEMENTS = 2**20
"""``reduce_bucket_size``: ZeRO-3 keeps one bucket of it through the update."""
MiB = 2**20
RESULTS = Path(__file__).resolve().parent / "results" / "deepspeed_update.md"


@dataclass(frozen=True)
class Case:
    zero_stage: int
    dtype: str  # "fp32" or "bf16"
    sub_group_size: int | None = None  # None: DeepSpeed's default, larger than this model
    sequence_parallel: int = 1  # DeepSpeed-Ulysses' degree: the ranks are then one sequence-parallel group

    @property
    def name(self) -> str:
        sub = f" sub-group {self.sub_group_size}" if self.sub_group_size else ""
        ulysses = f" ulysses {self.sequence_parallel}" if self.sequence_parallel > 1 else ""
        return f"zero{self.zero_stage} {self.dtype}{sub}{ulysses}"

    def config(self) -> dict:
        zero = {"stage": self.zero_stage, "overlap_comm": True, "contiguous_gradients": True,
                "reduce_bucket_size": BUCKET_ELEMENTS, "stage3_param_persistence_threshold": 0}
        if self.sub_group_size:
            zero["sub_group_size"] = self.sub_group_size
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}},
                  "zero_optimization": zero}
        if self.dtype == "bf16":
            config["bf16"] = {"enabled": True}
        if self.sequence_parallel > 1:
            config["sequence_parallel_size"] = self.sequence_parallel
        return config


CASES = (*(Case(zero, dtype) for zero in range(4) for dtype in ("fp32", "bf16")),
         Case(3, "fp32", 2**20), Case(3, "bf16", 2**20), Case(0, "bf16", sequence_parallel=DP),
         Case(1, "bf16", sequence_parallel=DP), Case(2, "bf16", sequence_parallel=DP),
         Case(3, "bf16", sequence_parallel=DP))


def priced_as(case: Case):
    """(the case's strategy as the cost model takes it, its gradients' bytes per element)."""
    from dsauto.cost.strategy import Strategy
    from dsauto.parallel import ParallelDims

    sp = case.sequence_parallel  # DeepSpeed's ZeRO partitions over the sequence-data-parallel ranks
    strategy = Strategy(dims=ParallelDims(dp=DP // sp, tp=1, pp=1, cp=sp), zero_stage=case.zero_stage,
                        micro_batch=1, grad_accum=1, sequence_parallel=False)
    return strategy, 2 if case.dtype == "bf16" else 4


def predicted_bytes(case: Case) -> float:
    """The update's peak as the cost model prices it, from the model's shape alone."""
    from dsauto.cost.step import held_bucket_bytes, optimizer_step_bytes
    from dsauto.engines.deepspeed import SUB_GROUP_SIZE

    strategy, width = priced_as(case)
    elements = HIDDEN * HIDDEN * LAYERS
    shards = DP if case.zero_stage == 3 else 1
    params, grads = elements * width / shards, elements * width / (DP if case.zero_stage >= 2 else 1)
    optim = elements * (12 if case.zero_stage or case.dtype == "bf16" else 8) / (DP if case.zero_stage else 1)
    largest = 4 * HIDDEN * HIDDEN / DP  # one layer's fp32 partition
    bucket = held_bucket_bytes(strategy, BUCKET_ELEMENTS * width, width)
    step = optimizer_step_bytes(strategy, params, grads, optim, bucket, single_tensor=True,
                                largest_main_param_bytes=largest, grads_in_16_bits=case.dtype == "bf16",
                                sub_group_size=case.sub_group_size or SUB_GROUP_SIZE)
    # 0: the update holds no more than the model state, which every moment of the step holds.
    return max(step, params + grads + optim)


def predicted_ulysses_bytes(case: Case) -> float:
    """What the cost model adds to backward's peak under DeepSpeed-Ulysses: the fp32 copy a reduction
    holds (ZeRO 0-2, ``dsauto.cost.step.ulysses_cast_bytes``) or ZeRO-3's bucket, fp32 in place of
    the training dtype (``held_bucket_bytes``)."""
    from dsauto.cost.step import held_bucket_bytes, ulysses_cast_bytes

    strategy, width = priced_as(case)
    bucket, local_grads = BUCKET_ELEMENTS * width, HIDDEN * HIDDEN * LAYERS * width
    if case.zero_stage == 3:
        return held_bucket_bytes(strategy, bucket, width) - bucket
    return ulysses_cast_bytes(strategy, bucket, local_grads, width == 2)


def sequence_groups(size: int):
    """DeepSpeed-Ulysses' groups over ``size`` ranks, as dsauto's hook builds them
    (dsauto.runtime.ulysses: DeepSpeed's ``parallel_state_sp`` as the mpu, whose sequence-data-parallel
    group ZeRO partitions over), or None for ``size`` 1."""
    if size <= 1:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    if getattr(parallel_state_sp, "_SEQUENCE_PARALLEL_GROUP", None) is None:
        parallel_state_sp.initialize_sequence_parallel(size)
    return parallel_state_sp


def settle() -> None:
    """Lets gloo's worker threads drop the tensors of the collectives that finished: a reduced copy
    is freed when the thread that ran its all-reduce lets go of it, which on CPU ranks can come after
    the collective returns (on a GPU the caching allocator frees it on its stream instead)."""
    import deepspeed.comm as dist

    dist.barrier()
    time.sleep(0.2)


def worker(cases_path: str, out_path: str) -> None:
    """One rank: trains each case two steps and records the peaks of live tensor bytes in the second
    step's backward and update (every tensor counted from before the model is built)."""
    import deepspeed
    import deepspeed.comm as dist
    import torch

    import dsauto.deepspeed
    from dsauto.profile.memory import MemoryTracker

    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for raw in json.loads(Path(cases_path).read_text()):
        case = Case(**raw)
        torch.manual_seed(0)
        with MemoryTracker() as tracker:
            model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS)])
            engine, *_ = dsauto.deepspeed.initialize(model=model, config=case.config(),
                                                     model_parameters=model.parameters(),
                                                     mpu=sequence_groups(case.sequence_parallel))
            dtype = torch.bfloat16 if case.dtype == "bf16" else torch.float32
            for step in range(2):
                loss = engine(torch.randn(1, HIDDEN, dtype=dtype)).float().pow(2).mean()
                with tracker.region(f"backward {step}"):
                    engine.backward(loss)
                settle()
                with tracker.region(f"update {step}"):
                    engine.step()
                settle()
        results[case.name] = {"backward": tracker.peak_bytes("backward 1"), "update": tracker.peak_bytes("update 1")}
        engine.destroy()
        del engine, model
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure(cases: tuple[Case, ...] = CASES, timeout: float = 900) -> dict[str, dict[str, float]]:
    """Launches :func:`worker` on 2 ranks under dsauto's launch guard; rank 0's peaks by case name
    ({"backward": bytes, "update": bytes})."""
    from dsauto.profile.launch import free_port, launch, stop

    with tempfile.TemporaryDirectory() as tmp:
        cases_file, out = Path(tmp) / "cases.json", Path(tmp) / "out.json"
        cases_file.write_text(json.dumps([asdict(c) for c in cases]))
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                              os.environ.get("PYTHONPATH", "")])}
        port = free_port()
        process = launch([sys.executable, "-m", "deepspeed.launcher.runner", "--include", "localhost:0,1",
                          "--master_port", str(port), __file__, "--worker", str(cases_file), str(out)],
                         env, port, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(process)
            raise
        if process.returncode != 0 or not out.exists():
            raise RuntimeError(f"the ranks failed (exit {process.returncode}): {stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("CASES", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the launcher's
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    import deepspeed
    import torch

    measured = measure()
    rows, errors = [], []
    for case in CASES:
        predicted, got = predicted_bytes(case), measured[case.name]["update"]
        errors.append((predicted - got) / got)
        rows.append(f"| {case.name} | {predicted / MiB:.1f} MiB | {got / MiB:.1f} MiB | {errors[-1]:+.1%} |")
    ulysses = []
    for case in (c for c in CASES if c.sequence_parallel > 1):
        plain = dataclasses.replace(case, sequence_parallel=1).name
        more = measured[case.name]["backward"] - measured[plain]["backward"]
        ulysses.append(f"| zero{case.zero_stage} {case.dtype} | {predicted_ulysses_bytes(case) / MiB:.1f} MiB | "
                       f"{more / MiB:.1f} MiB |")
    under = max([0.0] + [-e for e in errors])
    summary = f"max_memory_error={max(abs(e) for e in errors):.3f} max_under_prediction={under:.3f} plans={len(CASES)}"
    RESULTS.write_text("\n".join([
        "# DeepSpeed's ZeRO optimizer update: predicted vs measured memory",
        "",
        "Command: `python benchmarks/deepspeed_update.py` (2 CPU ranks, gloo; DeepSpeed "
        f"{deepspeed.__version__}, torch {torch.__version__}, Python {platform.python_version()}).",
        "",
        f"Model: {LAYERS} linear layers of {HIDDEN} x {HIDDEN} without biases ({LAYERS * HIDDEN * HIDDEN / 1e6:.1f}M "
        f"parameters), one token a step, so that the update is the step's peak; reduce_bucket_size "
        f"{BUCKET_ELEMENTS} elements. Measured: the peak of live tensor bytes on rank 0 during the second "
        "step's `engine.step()` (dsauto.profile.memory.MemoryTracker, every tensor counted from before the "
        "model was built). Predicted: `dsauto.cost.step.optimizer_step_bytes` from the parameter count "
        "(with the case's sub_group_size where it sets one), or the model state where it prices no update "
        "of its own (fp32 without ZeRO: torch's fused AdamW updates in place).",
        "",
        "| case | predicted | measured | error |",
        "|---|---|---|---|",
        *rows,
        "",
        f"`{summary}`",
        "",
        "## Backward under DeepSpeed-Ulysses",
        "",
        f"What the second step's backward peaks above the same case without Ulysses (sequence-parallel size "
        f"{DP}, the groups built as dsauto's hook builds them: DeepSpeed's `parallel_state_sp` as the mpu), "
        "against what the cost model adds: the fp32 copy each reduction casts into (ZeRO 0-2; under ZeRO-1/2 "
        "two buckets' copies, the two overlap_comm keeps in flight, of which one or two are alive at the peak "
        "from run to run on CPU ranks, by when gloo's threads free them), ZeRO-3's bucket in fp32.",
        "",
        "| case | priced | measured |",
        "|---|---|---|",
        *ulysses,
        "",
    ]))
    print(summary)


if __name__ == "__main__":
    main()
