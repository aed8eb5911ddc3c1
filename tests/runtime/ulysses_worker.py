"""One rank of the DeepSpeed-Ulysses test: a cp=2 plan trained through dsauto.deepspeed.initialize.

Launched on 2 CPU processes (gloo) by tests/runtime/test_ulysses.py through megatron_launch.launch::

    ulysses_worker.py JOB.json OUT.json

JOB.json holds ``seed``, ``steps``, ``lr`` and ``runs``, each {"name", "plan": a ds_config.json}.
Every rank sees the same global batch and trains on its half of each sequence; the loss it
back-propagates is its shard's mean over cp (dsauto.runtime.ulysses.shard_loss). Rank 0 also
trains the same network in one process without DeepSpeed (the same optimizer, clipping and
batches: the sp=1 reference) and writes both loss curves, the updated weights' largest difference,
and what DeepSpeed reported of its groups.
"""

from __future__ import annotations

import json

import torch
from megatron_launch import run_deepspeed_jobs

import dsauto.deepspeed
from dsauto.emit.ds_config import GRADIENT_CLIPPING
from dsauto.models import build_model
from dsauto.models.data import synthetic_batch
from dsauto.runtime.deepspeed import plan_from_config
from dsauto.runtime.ulysses import UlyssesAttention, sequence_shard, shard_loss


def reference(plan, seed: int, steps: int, lr: float) -> tuple[list[float], torch.nn.Module]:
    """The sp=1 run: the whole sequences in one process."""
    model = build_model(plan.model, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        tokens, labels = synthetic_batch(model.spec.vocab_size, plan.micro_batch, plan.seq_len, step, 0, seed=seed)
        loss = model(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRADIENT_CLIPPING)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def run(spec: dict, seed: int, steps: int, lr: float) -> dict:
    import deepspeed.comm as dist

    with open(spec["plan"]) as f:
        config = json.load(f)
    config.pop("optimizer")  # the client optimizer below: plain SGD, so that a gradient scale shows
    config["zero_allow_untested_optimizer"] = True  # SGD under ZeRO-1
    plan = plan_from_config(config)
    model = build_model(plan.model, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    engine, *_ = dsauto.deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    rank = dist.get_rank()  # dp = 1: the sequence-parallel rank
    losses = []
    for step in range(steps):
        tokens, labels = synthetic_batch(model.spec.vocab_size, plan.micro_batch, plan.seq_len, step, 0, seed=seed)
        loss = engine(sequence_shard(tokens, plan, rank), sequence_shard(labels, plan, rank))
        engine.backward(shard_loss(loss, plan))
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / plan.cp)
    out = {"losses": losses, "sequence_parallel_size": engine.sequence_parallel_size,
           "seq_dp_world_size": engine.seq_dp_world_size,
           "wrapped": sum(isinstance(m, UlyssesAttention) for m in engine.module.modules())}
    if rank == 0:
        out["reference"], plain = reference(plan, seed, steps, lr)
        out["weight_difference"] = max((a.detach() - b.detach()).abs().max().item()
                                       for a, b in zip(engine.module.parameters(), plain.parameters()))
    return out


if __name__ == "__main__":
    run_deepspeed_jobs(run)
