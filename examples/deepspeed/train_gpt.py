"""Train a small GPT with DeepSpeed and a dsauto plan: a DeepSpeed script whose one change is the
``initialize`` call.

    dsauto tune --model gpt-tiny --hardware cpu --nodes 1 --gpus-per-node 2 --engine deepspeed --out out/
    DS_ACCELERATOR=cpu LOCAL_SIZE=2 deepspeed --include localhost:0,1 examples/deepspeed/train_gpt.py \\
        --deepspeed_config out/ds_config.json --steps 20

A pipeline plan (``dsauto tune ... --pp 2``) trains under DeepSpeed's pipeline engine: the script
builds the model as ``LayerSpec``s cut into the plan's stages (``dsauto.deepspeed.pipeline_module``)
and runs ``engine.train_batch``.

The model is built from the plan's model spec (the config's "dsauto" block), or from ``--model``
when the config has no plan, in which case the script is plain DeepSpeed. The data is synthetic
(:mod:`dsauto.models.data`): sequences cycling through a few fixed token patterns, which the model
learns in a few steps, so the printed loss falls.
"""

from __future__ import annotations

import argparse

import deepspeed
import deepspeed.comm as dist

import dsauto.deepspeed
from dsauto.errors import run_script
from dsauto.models import build_model
from dsauto.models.data import synthetic_batch
from dsauto.models.gpt import logits_loss
from dsauto.models.pipeline import pipeline_layer_specs
from dsauto.plan import Plan
from dsauto.spec.loaders import load_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: 0)")
    parser.add_argument("--model", default="gpt-tiny",
                        help="model preset when the config carries no dsauto plan (default: gpt-tiny)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default: the plan's, else 128)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    plan = dsauto.deepspeed.plan_of(args.deepspeed_config)  # under dsauto tune --script: the trial's
    spec = plan.model if plan else load_model(args.model)
    vocab_size = plan.padded_vocab_size if plan else spec.padded_vocab_size(1)

    if plan is not None and plan.pp > 1:
        train_pipeline(args, plan)
        return
    model = build_model(spec, seed=args.seed, vocab_size=vocab_size)
    engine, _, _, _ = dsauto.deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())

    rank = dist.get_rank()
    # Batch shape from the engine, not from --deepspeed_config: under `dsauto tune --script` the
    # engine runs the trial's config and plan instead (dsauto.refine.trial_hook).
    applied = getattr(engine, "dsauto_plan", None)
    seq_len = args.seq_len or (applied.plan.seq_len if applied else 128)
    micro_batch = engine.train_micro_batch_size_per_gpu()
    for step in range(1, args.steps + 1):
        for micro_step in range(engine.gradient_accumulation_steps()):
            tokens, labels = synthetic_batch(vocab_size, micro_batch, seq_len,
                                             step=step * 1000 + micro_step, rank=rank, seed=args.seed)
            loss = engine(tokens.to(engine.device), labels.to(engine.device))
            engine.backward(loss)
            engine.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)  # mean over data-parallel ranks of the last micro-batch's loss
        if rank == 0:
            print(f"step {step} loss {reported.item() / dist.get_world_size():.4f}", flush=True)
    dist.destroy_process_group()


def train_pipeline(args: argparse.Namespace, plan: Plan) -> None:
    """The pipeline plan's training: each rank builds its stage, and the engine runs 1F1B over the
    plan's micro-batches (``train_batch`` reads them from the iterator on the first and last stages)."""
    deepspeed.init_distributed()  # a PipelineModule reads the ranks when it is built
    layers = pipeline_layer_specs(plan.model, plan.padded_vocab_size)
    net = dsauto.deepspeed.pipeline_module(plan, layers, loss_fn=logits_loss, seed_layers=True, base_seed=args.seed)
    engine, _, _, _ = dsauto.deepspeed.initialize(args=args, model=net, model_parameters=net.parameters())
    seq_len = args.seq_len or plan.seq_len
    replica = engine.grid.get_data_parallel_rank()  # the stages of one replica read the same batches

    def batches():
        step = 0
        while True:
            yield synthetic_batch(plan.padded_vocab_size, engine.train_micro_batch_size_per_gpu(), seq_len,
                                  step=step, rank=replica, seed=args.seed)
            step += 1

    data = batches()
    for step in range(1, args.steps + 1):
        loss = engine.train_batch(data)  # the mean over the micro-batches and the replicas
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_script(main, __file__)  # a refusal of the plan's: one line a rank, not a traceback
