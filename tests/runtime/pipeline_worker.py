"""One rank of the DeepSpeed pipeline test: a pp=2 plan trained through dsauto.deepspeed.pipeline_module
and dsauto.deepspeed.initialize, as a DeepSpeed pipeline script writes it.

Launched on 2 CPU processes (gloo) by tests/runtime/test_deepspeed_pipeline.py through megatron_launch.launch::

    pipeline_worker.py JOB.json OUT.json

JOB.json holds ``seed``, ``steps``, ``lr`` and ``runs``, each {"name", "plan": a ds_config.json}. Every
rank builds only its stage (LayerSpecs, each seeded by its list index: ``seed_layers``); the engine
runs ``train_batch`` over the plan's micro-batches. Rank 0 also trains the same layers in one process
without DeepSpeed (the same seeds, batches and optimizer, no clipping) and reports both loss curves,
along with what each rank built: its stage, the list indices of its blocks, which of them run under
activation checkpointing, and DeepSpeed's stage boundaries.
"""

from __future__ import annotations

import functools
import json

import torch
from megatron_launch import run_deepspeed_jobs
from torch import nn

import dsauto.deepspeed
from dsauto.models.data import synthetic_batch
from dsauto.models.gpt import Block, logits_loss
from dsauto.models.pipeline import pipeline_layer_specs
from dsauto.runtime.checkpointing import is_checkpointed
from dsauto.runtime.deepspeed import plan_from_config

BASE_SEED = 1234


def layer_specs(plan) -> list:
    return pipeline_layer_specs(plan.model, plan.padded_vocab_size)


def batches(plan, seed: int):
    """Every micro-batch of every step, in order (dp = 1: one stream)."""
    step = 0
    while True:
        yield synthetic_batch(plan.model.vocab_size, plan.micro_batch, plan.seq_len, step, 0, seed=seed)
        step += 1


def reference(plan, seed: int, steps: int, lr: float) -> list[float]:
    """The same layers in one process: each built after seeding with its list index, as DeepSpeed's
    ``seed_layers`` does (a tied table once, where it first occurs: DeepSpeed broadcasts the first
    stage's copy to the others); the mean loss of each step's micro-batches."""
    from deepspeed.pipe import TiedLayerSpec
    from deepspeed.runtime.utils import set_random_seed

    tied: dict[str, nn.Module] = {}
    calls = []
    for index, spec in enumerate(layer_specs(plan)):
        set_random_seed(BASE_SEED + index)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
            module = tied[spec.key]
            calls.append(module if spec.forward_fn is None else functools.partial(spec.forward_fn, module))
        else:
            calls.append(spec.build())
    net = nn.ModuleList({id(m): m for m in [*calls, *tied.values()] if isinstance(m, nn.Module)}.values())

    def forward(x: torch.Tensor) -> torch.Tensor:
        for call in calls:
            x = call(x)
        return x

    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    data, losses = batches(plan, seed), []
    for _ in range(steps):
        total = 0.0
        for _ in range(plan.grad_accum):
            tokens, labels = next(data)
            loss = logits_loss(forward(tokens), labels)
            (loss / plan.grad_accum).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / plan.grad_accum)
    return losses


def run(spec: dict, seed: int, steps: int, lr: float) -> dict:
    import deepspeed.comm as dist

    with open(spec["plan"]) as f:
        config = json.load(f)
    config.pop("optimizer")  # the client optimizer below: plain SGD, as in the reference
    config["zero_allow_untested_optimizer"] = True  # SGD under ZeRO-1
    # No clipping: in fp32 without ZeRO, DeepSpeed's pipeline engine clips by the first stage's
    # gradient norm, not the whole model's (clip_grad_norm_ in deepspeed/runtime/utils.py counts the
    # parameters of model-parallel rank 0 only, and the pipeline grid's model-parallel group spans
    # the stages).
    config["gradient_clipping"] = 0.0
    plan = plan_from_config(config)
    net = dsauto.deepspeed.pipeline_module(spec["plan"], layer_specs(plan), loss_fn=logits_loss,
                                           seed_layers=True, base_seed=BASE_SEED)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    engine, *_ = dsauto.deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    data = batches(plan, seed)
    losses = [float(engine.train_batch(data)) for _ in range(steps)]
    layout = engine.dsauto_plan
    blocks = sorted(int(name) for name, m in engine.module.named_children() if isinstance(m, Block))
    checkpointed = sorted(int(name) for name, m in engine.module.named_children()
                          if isinstance(m, Block) and is_checkpointed(m))
    built = {"stage": layout.stage, "blocks": blocks, "checkpointed_blocks": checkpointed,
             "checkpointed_layers": list(layout.checkpointed)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, built)
    out = {"losses": losses, "parts": list(layout.parts), "ranks": every,
           "engine_parts": list(engine.module.parts)}
    if dist.get_rank() == 0:
        out["reference"] = reference(plan, seed, steps, lr)
    return out


if __name__ == "__main__":
    run_deepspeed_jobs(run)
