"""Train a GPT with Megatron-core under a dsauto plan.

An ordinary Megatron-core training loop (GPTModel with the local layer spec, the pipeline schedules of
get_forward_backward_func, Megatron's DDP wrapper and distributed optimizer) plus the dsauto lines,
marked ``# dsauto``. On a machine without CUDA it runs on CPU processes with gloo, through
dsauto.compat.megatron_cpu:

    dsauto tune --model gpt-tiny --hardware cpu --nodes 1 --gpus-per-node 4 --tp 2 --pp 2 --out out/
    torchrun --nproc_per_node 4 examples/megatron/train_gpt.py --plan out/plan.yaml --steps 10

A plan with virtual stages trains with Megatron-core's interleaved 1F1B: each rank builds one model
chunk per virtual stage (``dm.model_chunks``), wraps each in DDP and hands the list to the schedule,
with one data iterator per chunk, as Megatron-LM's training loop does:

    dsauto tune --model gpt-tiny --hardware cpu --nodes 1 --gpus-per-node 2 --pp 2 --vpp 2 --out out/
    torchrun --nproc_per_node 2 examples/megatron/train_gpt.py --plan out/plan.yaml --steps 10

``dsauto tune --trials`` measures candidate plans with this script as it is:

    dsauto tune --model gpt-tiny --hardware cpu --nodes 1 --gpus-per-node 2 --engine megatron \
        --trials 6 --script examples/megatron/train_gpt.py --script-args "--plan unused" --out out/

Each trial launches it under torchrun with ``DSAUTO_TRIAL`` set: ``dm.load_plan`` then returns the
trial's plan (the ``--plan`` file is not read), the optimizer steps are measured where Megatron's
optimizer steps, and the script ends after the trial's steps (dsauto.refine.megatron_trial). For the
measurement to be the plan's, the loop takes the micro-batch, the micro-batches per step and the
sequence length from the plan, and ``--steps`` (default 10) covers the trial's steps.

The last pipeline stage prints ``step N loss X``. The data are random sequences that follow a fixed
rule (each token determines the next), so the loss falls from ln(vocabulary) as the model learns it.
"""

from __future__ import annotations

import argparse
import os
import zlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

import dsauto.megatron as dm  # dsauto
from dsauto.errors import run_script
from dsauto.plan import Plan

# The token rule of the data: next = (A * token + C) mod vocabulary. Each token fixes the next one,
# a rule the model can learn; a random start makes every sequence different.
_A, _C = 5, 3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True, help="plan.yaml, or ds_config.json with its dsauto block")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default: 10)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the weights and the data")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default: 3e-3)")
    return parser.parse_args(argv)


def micro_batch(plan: Plan, seed: int, step: int, index: int) -> torch.Tensor:
    """Micro-batch ``index`` of optimizer step ``step``: ``plan.micro_batch`` sequences of
    ``plan.seq_len + 1`` tokens. A function of its arguments only, so that any parallel layout
    trains on the same global batch (data-parallel rank r takes indices r * grad_accum ...)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{step}/{index}".encode()))
    vocab = plan.model.vocab_size
    tokens = torch.empty(plan.micro_batch, plan.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (plan.micro_batch,), generator=generator)
    for t in range(plan.seq_len):
        tokens[:, t + 1] = (_A * tokens[:, t] + _C) % vocab
    return tokens


def batches(plan: Plan, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches, step after step, as GPTModel inputs."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    positions = torch.arange(plan.seq_len).unsqueeze(0).expand(plan.micro_batch, -1)
    step = 0
    while True:
        for i in range(plan.grad_accum):
            tokens = micro_batch(plan, seed, step, dp_rank * plan.grad_accum + i)
            yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": positions}
        step += 1


def build_model(plan: Plan, on_cpu: bool) -> list[torch.nn.Module]:
    """This rank's part of the GPT, as a list of model chunks: one per virtual pipeline stage when
    the plan interleaves (Megatron-core's interleaved 1F1B), else one; each a tensor-parallel shard."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        **dm.transformer_config_kwargs(plan.model),  # dsauto: the planned model's shape
        use_cpu_initialization=on_cpu,
        # The local spec's DotProductAttention is Megatron-core's own, unfused attention.
        attention_backend=AttnBackend.local,
    )
    config = dm.apply(plan, config)  # dsauto

    spec = get_gpt_layer_local_spec(normalization=config.normalization)

    def chunk(pre_process: bool, post_process: bool, vp_stage: int | None) -> GPTModel:
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            mtp_block_spec=dm.mtp_block_spec(config, spec, vp_stage),  # dsauto: multi-token prediction, if any
            **dm.gpt_model_kwargs(plan),  # dsauto: vocabulary, positions, tied head
            pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
        )

    return dm.model_chunks(plan, chunk)  # dsauto: embedding, head and layers of each chunk


def wrap(plan: Plan, chunks: list[torch.nn.Module],
         **optimizer_args: object) -> tuple[list[torch.nn.Module], object]:
    """Megatron's data-parallel wrapper around each model chunk and one optimizer over all
    (``optimizer_args``: lr, weight_decay ...), configured by the plan and hooked into the schedules
    as Megatron-LM's training loop hooks them (megatron/training/training.py)."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    config = chunks[0].config
    # dsauto. Megatron-FSDP (the plan's ZeRO-2 / 3) needs CUDA; on CPU the distributed optimizer
    # stands in, and dsauto reports what stays unsharded.
    ddp_config = dm.ddp_config(plan, megatron_fsdp=torch.cuda.is_available())
    if ddp_config.use_megatron_fsdp:  # the plan's ZeRO-2 / 3
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import (
            FullyShardedDataParallel as Wrapper,
        )
    else:
        Wrapper = DistributedDataParallel
    # As Megatron-LM: one gradient bucket for every chunk after the first, whose reduction the
    # interleaved schedule overlaps with the other chunks' backward anyway.
    model = [Wrapper(config, ddp_config, chunk, disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(dm.optimizer_config(plan, **optimizer_args), model)  # dsauto
    if ddp_config.overlap_grad_reduce:
        # Reduce gradients once, after each chunk's last micro-batch.
        config.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads  # DP, tied-embedding and SP reductions
    return model, optimizer


def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean next-token loss of the micro-batch. The schedule divides the returned loss by the number
    of micro-batches in place, so the reported value is a copy."""
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    # Every chunk of every stage draws from its own iterator, so all stay on the same micro-batch
    # (the interleaved schedule runs a rank's chunks on different micro-batches in turn).
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, loss_func


def train_step(plan: Plan, model: list[torch.nn.Module], optimizer, data: list[Iterator],
               forward_step_func: Callable = forward_step) -> float | None:
    """One optimizer step over ``plan.grad_accum`` micro-batches (``data``: one iterator per model
    chunk, all yielding the same micro-batches); returns the mean loss over the global batch on the
    last pipeline stage and None elsewhere."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data, model=model,
        num_microbatches=plan.grad_accum, seq_length=plan.seq_len, micro_batch_size=plan.micro_batch,
        forward_only=False)
    optimizer.step()
    if not parallel_state.is_pipeline_last_stage():
        return None
    loss = torch.stack([item["lm loss"] for item in losses]).mean()
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / parallel_state.get_data_parallel_world_size()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from dsauto.compat import megatron_cpu

        shim = megatron_cpu.enable()  # Megatron-core's few CUDA calls, redirected to the CPU
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="gloo" if on_cpu else "nccl")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    plan = dm.load_plan(args.plan)  # dsauto
    dm.initialize_model_parallel(plan)  # dsauto
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    model, optimizer = wrap(plan, build_model(plan, on_cpu), lr=args.lr)
    data = [batches(plan, args.seed) for _ in model]  # each chunk draws every micro-batch it runs
    log = (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
           and parallel_state.get_data_parallel_rank() == 0)
    for step in range(1, args.steps + 1):
        loss = train_step(plan, model, optimizer, data)
        if log:
            print(f"step {step} loss {loss:.4f}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if on_cpu:
        shim.disable()


if __name__ == "__main__":
    run_script(main, __file__)  # a refusal of the plan's: one line a rank, not a traceback
