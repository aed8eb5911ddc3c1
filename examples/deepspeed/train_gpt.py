"""Train a small GPT with DeepSpeed and a dsauto plan: a DeepSpeed script whose one change is the
``initialize`` call.

    dsauto tune --model gpt-tiny --hardware cpu --nodes 1 --gpus-per-node 2 --out out/
    DS_ACCELERATOR=cpu LOCAL_SIZE=2 deepspeed --include localhost:0,1 examples/deepspeed/train_gpt.py \\
        --deepspeed_config out/ds_config.json --steps 20

The model is built from the plan's model spec (the config's "dsauto" block), or from ``--model``
when the config has no plan, in which case the script is plain DeepSpeed. The data is synthetic
(:mod:`dsauto.models.data`): sequences cycling through a few fixed token patterns, which the model
learns in a few steps, so the printed loss falls.
"""

from __future__ import annotations

import argparse
import json

import deepspeed
import deepspeed.comm as dist

import dsauto.deepspeed
from dsauto.emit.ds_config import PLAN_KEY
from dsauto.models import build_model
from dsauto.models.data import synthetic_batch
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
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    plan = Plan.from_dict(config[PLAN_KEY]) if PLAN_KEY in config else None
    spec = plan.model if plan else load_model(args.model)
    vocab_size = plan.padded_vocab_size if plan else spec.padded_vocab_size(1)

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


if __name__ == "__main__":
    main()
