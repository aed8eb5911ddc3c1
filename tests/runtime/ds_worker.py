"""One rank of the DeepSpeed hook tests: trains every case of a cases file and records what it saw.

Launched by tests/runtime/test_deepspeed.py on 2 ranks (gloo, CPU accelerator)::

    DS_ACCELERATOR=cpu LOCAL_SIZE=2 deepspeed --include localhost:0,1 tests/runtime/ds_worker.py \
        --cases cases.json --out results.json

A case is ``{"name", "config", "plan", "api", "optimizer", "steps", "seed", "seq_len",
"vocab_size"}``: ``config`` is a DeepSpeed config (with or without a ``"dsauto"`` block), ``api``
is ``"dsauto"`` (dsauto.deepspeed.initialize) or ``"deepspeed"`` (deepspeed.initialize),
``optimizer`` is ``"config"`` or ``"client"`` (a torch.optim.AdamW built before initialize over
``model.parameters()``). Rank 0 writes, per case, the data-parallel mean loss of every step, which
layers the hook checkpointed, split and recomputed selectively, and, under ZeRO-3, the parameter and
optimizer elements rank 0 holds. A case with ``"measure": true`` also records the tensor bytes the
last step's first forward leaves alive (what backward keeps, dsauto.profile.memory.MemoryTracker)
and the parameter elements ZeRO-3 all-gathers in each step.
"""

from __future__ import annotations

import argparse
import json
import traceback
from typing import Any

import deepspeed
import deepspeed.comm as dist
import torch

import dsauto.deepspeed
from dsauto.emit.ds_config import PLAN_KEY
from dsauto.models import build_model
from dsauto.models.data import synthetic_batch
from dsauto.plan import Plan
from dsauto.profile.memory import MemoryTracker
from dsauto.runtime.checkpointing import is_checkpointed
from dsauto.spec.model import ModelSpec


def run_case(case: dict[str, Any], spec: ModelSpec, rank: int) -> dict[str, Any]:
    config = case["config"]
    model = build_model(spec, seed=case["seed"], vocab_size=case["vocab_size"])
    optimizer = None
    if case["optimizer"] == "client":
        params = config["optimizer"]["params"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=tuple(params["betas"]),
                                      eps=params["eps"], weight_decay=params["weight_decay"])
        config = {k: v for k, v in config.items() if k != "optimizer"}
    initialize = dsauto.deepspeed.initialize if case["api"] == "dsauto" else deepspeed.initialize
    engine, *_ = initialize(model=model, optimizer=optimizer, config=config)
    micro, seq_len, vocab = config["train_micro_batch_size_per_gpu"], case["seq_len"], case["vocab_size"]
    losses, kept_bytes, gathered = [], None, GatheredElements() if case.get("measure") else None
    for step in range(case["steps"]):
        if gathered is not None:
            gathered.per_step.append(0)
        for micro_step in range(engine.gradient_accumulation_steps()):
            tokens, labels = synthetic_batch(vocab, micro, seq_len, step * 100 + micro_step, rank,
                                             seed=case["seed"])
            if case.get("measure") and step == case["steps"] - 1 and micro_step == 0:
                with MemoryTracker() as forward:
                    loss = engine(tokens, labels)
                kept_bytes = forward.final_bytes()  # allocated in forward and alive: what backward keeps
            else:
                loss = engine(tokens, labels)
            engine.backward(loss)
            engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    applied = getattr(engine, "dsauto_plan", None)
    result: dict[str, Any] = {
        "losses": losses,
        "hook": applied is not None,
        "forward_patched": any("forward" in vars(m) for m in engine.module.modules()),
        "checkpointed": [i + 1 for i, block in enumerate(engine.module.layers) if is_checkpointed(block)],
        "splits": applied.splits if applied else {},
        # the parameters splitting replaced are let go once the engine is built (not held for the run)
        "replacements_kept": len(applied.replacements) if applied else 0,
        "recomputed": {str(k): list(v) for k, v in applied.recomputed.items()} if applied else {},
        "kept_bytes": kept_bytes,
        "gathered_per_step": gathered.stop() if gathered is not None else None,
        # Where DeepSpeed's ZeRO optimizer keeps its state (stage_1_and_2.py's cpu_offload, stage3.py's
        # offload_optimizer / offload_param): on the CPU accelerator every device is the host, so the
        # engine's own flags are what tells an offloaded run apart.
        "optimizer_offloaded": bool(getattr(engine.optimizer, "cpu_offload", False)
                                    or getattr(engine.optimizer, "offload_optimizer", False)),
        "params_offloaded": bool(getattr(engine.optimizer, "offload_param", False)),
    }
    if engine.zero_optimization_stage() == 3:
        result.update(zero3_holdings(engine))
    engine.destroy()
    return result


class GatheredElements:
    """Counts the elements ZeRO-3 all-gathers (every parameter fetch goes through
    ``deepspeed.comm.allgather_fn``: deepspeed/runtime/zero/partition_parameters.py, _dist_allgather_fn)."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self.original = dist.allgather_fn

        def counted(output_tensor, input_tensor, *args, **kwargs):
            if self.per_step:
                self.per_step[-1] += output_tensor.numel()
            return self.original(output_tensor, input_tensor, *args, **kwargs)

        dist.allgather_fn = counted

    def stop(self) -> list[int]:
        dist.allgather_fn = self.original
        return self.per_step


def zero3_holdings(engine: Any) -> dict[str, Any]:
    """Elements this rank holds after the last step: gathered parameters per flat layer, the ZeRO
    partitions, and the fp32 optimizer partition."""
    applied = getattr(engine, "dsauto_plan", None)
    layers = applied.layers.parameters_by_layer() if applied else [list(engine.module.parameters())]
    return {
        "gathered_per_layer": [sum(p.data.numel() for p in params) for params in layers],
        "full_per_layer": [sum(p.ds_numel for p in params) for params in layers],
        "resident_layers": list(applied.resident) if applied else [],
        "optimizer_partition": sum(t.numel() for t in engine.optimizer.fp32_partitioned_groups_flat),
        "total_params": sum(p.ds_numel for p in engine.module.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    with open(args.cases) as f:
        cases = json.load(f)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for case in cases:
        block = case["config"].get(PLAN_KEY) or case["plan"]
        spec = Plan.from_dict(block).model
        try:
            results[case["name"]] = run_case(case, spec, rank)
        except Exception as exc:  # recorded for the test to show, then the next case runs
            results[case["name"]] = {"error": f"{type(exc).__name__}: {exc}",
                                     "traceback": traceback.format_exc()}
        dist.barrier()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
