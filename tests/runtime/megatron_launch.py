"""Plans for the Megatron-core runtime tests, and the launcher of their CPU worker processes.

A plain module, not a conftest: the Megatron test files import it (pytest puts this folder on
sys.path), and the folder's conftest stays free for the other runtime tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.emit.ds_config import write_ds_config
from dsauto.parallel import ParallelDims
from dsauto.plan import Plan
from dsauto.plan_io import write_plan_yaml
from dsauto.profile.launch import free_port
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec

WORKER = Path(__file__).resolve().parent / "megatron_worker.py"

# A GPT small enough to train several layouts on 2 CPU cores in seconds: GeLU, LayerNorm, learned
# positions, a tied head (which pipeline stages keep in sync), no dropout (so runs are comparable).
# Its vocabulary is already a multiple of 128 x 2, so tp 1 and tp 2 pad it to the same 512.
TINY = ModelSpec(name="gpt-test", architecture="decoder", num_layers=4, hidden_size=64,
                 num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                 max_position_embeddings=64, dropout=False)

SEQ_LEN = 64
MICRO_BATCH = 2
GLOBAL_MICRO_BATCHES = 4
"""Every plan trains on the same global batch: 4 micro-batches of 2 sequences, split over dp."""


def make_plan(*, tp: int = 1, pp: int = 1, dp: int = 1, zero_stage: int = 0,
              stage_layers: tuple[int, ...] | None = None, checkpoint: Collection[int] = (),
              split: Mapping[int, int] | None = None, resident: Collection[int] = (),
              flash_attention: bool = False, sequence_parallel: bool = True,
              virtual_stages: int = 1, model: ModelSpec = TINY,
              recompute_modules: tuple[str, ...] = (), chunk_layout: tuple[int, ...] | None = None) -> Plan:
    """A plan for an explicit assignment, priced by dsauto's own planner (Planner.build_plan).

    ``checkpoint``, ``split`` and ``resident`` use the plan's flat layer numbering (0 = embedding,
    1..L transformer layers, L+1 head). ``flash_attention`` is off by default: the worker's
    Megatron-core attention is unfused, and a flash plan adds selective recomputation.
    ``virtual_stages`` > 1 interleaves the pipeline (model chunks per rank; the 4 global
    micro-batches must then be a multiple of pp). ``recompute_modules``: selective recomputation of
    these modules in every transformer layer. ``chunk_layout``: the layers of each model chunk, in
    chunk order, where they split a rank's otherwise than evenly.
    """
    stage_layers = stage_layers or tuple([model.num_layers // pp] * pp)
    grad_accum = GLOBAL_MICRO_BATCHES // dp
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=tp * pp * dp)
    train = TrainSpec(global_batch=MICRO_BATCH * GLOBAL_MICRO_BATCHES, seq_len=SEQ_LEN, dtype="fp32",
                      flash_attention=flash_attention)
    strategy = Strategy(dims=ParallelDims(dp=dp, tp=tp, pp=pp), zero_stage=zero_stage, micro_batch=MICRO_BATCH,
                        grad_accum=grad_accum, sequence_parallel=sequence_parallel and tp > 1, engine="megatron",
                        virtual_stages=virtual_stages, chunk_layout=chunk_layout,
                        recompute_modules=recompute_modules)
    split = split or {}
    options = [LayerOption(checkpoint=layer in checkpoint,
                           shard_params=zero_stage == 3 and layer not in resident,
                           split=split.get(layer, 1),
                           recompute_modules=recompute_modules if 1 <= layer <= model.num_layers else ())
               for layer in range(model.num_layers + 2)]
    return Planner(model, cluster, train).build_plan(strategy, stage_layers, options)


def launch(nproc: int, runs: Mapping[str, dict], folder: Path, *, steps: int = 4, seed: int = 7,
           lr: float = 3e-3, timeout_seconds: int = 300, worker: Path = WORKER) -> dict[str, dict]:
    """Runs the worker on ``nproc`` CPU ranks over ``runs`` (name -> {"plan": Plan, ...}); returns
    its results by run name. Plans travel as files read back by dsauto.megatron.load_plan: plan.yaml,
    or ds_config.json for DeepSpeed runs.

    The ranks are started directly with the environment torchrun would give them (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT ...): torchrun's agent adds seconds per launch on this 2-core machine."""
    folder.mkdir(parents=True, exist_ok=True)
    specs = []
    for name, spec in runs.items():
        write = write_ds_config if spec.get("engine") == "deepspeed" else write_plan_yaml
        path = write(spec["plan"], folder / (f"{name}.json" if write is write_ds_config else f"{name}.yaml"))
        specs.append({**spec, "name": name, "plan": str(path)})
    job, out = folder / "job.json", folder / "results.json"
    job.write_text(json.dumps({"seed": seed, "steps": steps, "lr": lr, "runs": specs}))
    port = free_port()
    logs = [folder / f"rank{rank}.log" for rank in range(nproc)]
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
        with logs[rank].open("w") as log:
            procs.append(subprocess.Popen([sys.executable, str(worker), str(job), str(out)],
                                          stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        codes = [proc.wait(timeout=timeout_seconds) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tails = "\n".join(f"--- rank {rank}\n{log.read_text()[-4000:]}" for rank, log in enumerate(logs))
    codes = [0 if rank and _aborted_at_teardown(code, logs[rank]) and codes[0] == 0 and out.exists() else code
             for rank, code in enumerate(codes)]
    assert codes == [0] * nproc, f"worker exit codes {codes}\n{tails}"
    results = json.loads(out.read_text())
    failed = {name: r["traceback"] for name, r in results.items() if "traceback" in r}
    assert not failed, "\n".join(f"{name}:\n{tb}" for name, tb in failed.items())
    return results


TEARDOWN_ABORT = "terminate called without an active exception"
"""What a rank prints when a C++ thread is still joinable as the process exits (std::terminate).
Seen once, under load, in a DeepSpeed worker's teardown after rank 0 had written the results."""


def _aborted_at_teardown(code: int, log: Path) -> bool:
    """Whether a rank other than 0 aborted (SIGABRT) with :data:`TEARDOWN_ABORT` as its last words. Only
    after rank 0 exited cleanly with the results written: rank 0 then passed every collective of the
    job with it, so the rank aborted in its teardown, not in the work the test checks."""
    lines = log.read_text().strip().splitlines()
    return code == -6 and bool(lines) and lines[-1].strip() == TEARDOWN_ABORT


def run_deepspeed_jobs(run: Callable[[dict, int, int, float], dict]) -> None:
    """The main of a DeepSpeed worker launched by :func:`launch` (``worker.py JOB.json OUT.json``):
    joins the gloo group, calls ``run(spec, seed, steps, lr)`` for each run of the job (a failure is
    kept as its traceback, for the test to report) and has rank 0 write the results."""
    import deepspeed
    import deepspeed.comm as dist
    import torch

    job_path, out_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")  # before any PipelineModule, which reads the ranks
    results = {}
    for spec in job["runs"]:
        try:
            results[spec["name"]] = run(spec, job["seed"], job["steps"], job["lr"])
        except Exception:
            results[spec["name"]] = {"traceback": traceback.format_exc()}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
