"""One rank of tests/runtime/test_megatron_dist_opt.py: Megatron-core's partial distributed optimizer
on CPU processes with gloo, launched like megatron_worker.py (whose model, initialisation and
training step it reuses): ``megatron_dist_opt_worker.py JOB.json OUT.json``.

Each run trains the GPT of examples/megatron/train_gpt.py under one plan through the dsauto plugin
(``dm.initialize_model_parallel``, ``dm.ddp_config`` via the example's ``wrap``) and reports, per
rank, the bytes of the optimizer state its optimizer holds after the first step (Adam's moments; in
fp32 the distributed optimizer's main parameters are views of the model's), the sizes of the
distributed optimizer's process groups and the losses of the last stage.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

import dsauto.megatron as dm
from megatron_worker import load_example, seeded_chunks, serve


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the tensors in the optimizer's state (of every optimizer it chains)."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(value.nbytes for inner in chained for state in inner.optimizer.state.values()
               for value in state.values() if torch.is_tensor(value) and value.dim() > 0)


def run(example, job: dict, spec: dict) -> dict:
    from megatron.core import parallel_state

    plan = dm.load_plan(spec["plan"])
    chunks = seeded_chunks(example, plan, job["seed"])
    model, optimizer = example.wrap(plan, chunks, lr=job["lr"], weight_decay=0.0)
    data = [example.batches(plan, job["seed"]) for _ in model]
    losses, state_bytes = [], None
    for _ in range(job["steps"]):
        losses.append(example.train_step(plan, model, optimizer, data))
        state_bytes = state_bytes or optimizer_state_bytes(optimizer)
    instance = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    across = (parallel_state.get_inter_distributed_optimizer_instance_group()
              if plan.dist_opt_instances > 1 else None)
    mine = {
        "losses": losses if parallel_state.is_pipeline_last_stage() else None,
        "optimizer_state_bytes": state_bytes,
        "params": sum(p.numel() for chunk in chunks for p in chunk.parameters()),
        "instance_ranks": dist.get_process_group_ranks(instance),
        "across_ranks": dist.get_process_group_ranks(across) if across is not None else None,
        "ddp_instances": model[0].ddp_config.num_distributed_optimizer_instances,
    }
    ranks: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(ranks, mine)
    parallel_state.destroy_model_parallel()
    return {"losses": next(r["losses"] for r in ranks if r["losses"] is not None), "ranks": ranks}


def main() -> None:
    example = load_example()
    serve(lambda job, spec: run(example, job, spec))


if __name__ == "__main__":
    main()
