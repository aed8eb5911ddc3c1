"""DeepSpeed-Ulysses: what the DeepSpeed hook does for a plan whose cp is greater than 1.

Under DeepSpeed a plan's cp is Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed
Ulysses"): each of cp consecutive ranks holds 1/cp of every sequence, and around attention four
all-to-alls trade the sequence shard for 1/cp of the heads over the whole sequence and back. The
config key ``sequence_parallel_size`` alone does not do this in DeepSpeed 0.19.8; the engine needs:

1. the sequence-parallel groups, passed as its ``mpu``: DeepSpeed's own
   ``deepspeed.runtime.sequence_parallel.parallel_state_sp`` (cp consecutive ranks per group, the
   sequence-data-parallel group over all dp x cp ranks, over which ZeRO partitions and reduces and
   DeepSpeed divides the summed gradients by dp only: deepspeed/runtime/zero/stage_1_and_2.py,
   ``average_tensor``; engine.py, ``allreduce_bucket``);
2. the model's attention wrapped in ``deepspeed.sequence.layer.DistributedAttention`` over that
   group. :func:`wrap_attention` wraps every module named ``core_attention`` of the plan's blocks
   (the reference model's :class:`dsauto.models.gpt.CoreAttention`): one that takes queries, keys
   and values laid out (batch, sequence, heads, head dim) and returns the output in that layout;
   a block that already holds a ``DistributedAttention`` over a group of cp ranks is left as is.

What stays the training script's: each rank feeds its own shard of every sequence
(:func:`sequence_shard`), and, because DeepSpeed sums the gradients of the cp ranks of a replica,
each rank's loss is the mean over its shard divided by cp (:func:`shard_loss`), so that the step is
that of the mean loss over the whole sequences. Positions must be those of the whole sequence:
rotary embeddings applied inside the wrapped attention are; learned position tables indexed by the
shard's own positions are not, and a model with them is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsauto.errors import DsautoError
from dsauto.plan import Plan
from dsauto.runtime.layers import ModelLayers

CORE_ATTENTION = "core_attention"
"""Name of the submodule of a transformer block that :func:`wrap_attention` wraps."""


class UlyssesAttention(nn.Module):
    """``DistributedAttention`` called as the core attention it replaces: ``(q, k, v) -> out``, all
    laid out (batch, sequence shard, heads, head dim); the all-to-alls scatter the heads (dim 2) and
    gather the sequence (dim 1)."""

    def __init__(self, core: nn.Module, group: Any):
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.distributed = DistributedAttention(core, group, scatter_idx=2, gather_idx=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.distributed(q, k, v, 0)  # batch_dim_idx 0: batch-first tensors


def sequence_parallel_mpu(plan: Plan, mpu: Any = None) -> Any:
    """The ``mpu`` to pass to ``deepspeed.initialize``: ``mpu`` when the caller gave one with the plan's
    sequence-parallel degree, else DeepSpeed's ``parallel_state_sp`` with its groups built for cp
    (the process group is started first, as ``deepspeed.initialize`` would)."""
    if mpu is not None:
        size = mpu.get_sequence_parallel_world_size() if hasattr(mpu, "get_sequence_parallel_world_size") else 1
        if size != plan.cp:
            raise DsautoError(f"The plan runs DeepSpeed-Ulysses over cp={plan.cp} ranks but the mpu passed to "
                              f"deepspeed.initialize has sequence-parallel size {size}; leave mpu out (dsauto "
                              f"builds DeepSpeed's parallel_state_sp groups) or re-plan with --cp {size}.")
        return mpu
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    dist.init_distributed()
    if dist.get_world_size() != plan.world_size:
        raise DsautoError(f"The plan is for {plan.world_size} ranks ({plan.dims.product_text()}) but "
                          f"{dist.get_world_size()} were launched; launch {plan.world_size} or re-plan.")
    if getattr(parallel_state_sp, "_SEQUENCE_PARALLEL_GROUP", None) is None:
        parallel_state_sp.initialize_sequence_parallel(plan.cp)
    elif parallel_state_sp.get_sequence_parallel_world_size() != plan.cp:
        raise DsautoError(f"DeepSpeed's sequence-parallel groups already exist with size "
                          f"{parallel_state_sp.get_sequence_parallel_world_size()}, not the plan's cp={plan.cp}; "
                          f"train one plan per process.")
    return parallel_state_sp


def wrap_attention(layers: ModelLayers, plan: Plan, mpu: Any) -> int:
    """Wraps the core attention of every transformer block in ``DistributedAttention`` over the
    sequence-parallel group of ``mpu`` (see the module doc); returns how many it wrapped. Refuses a
    model it cannot run under Ulysses, naming why."""
    from deepspeed.sequence.layer import DistributedAttention

    embedding = layers.embedding
    if embedding is not None and getattr(embedding, "positions", None) is not None:
        raise DsautoError("This model adds learned position embeddings by the position within its input, which "
                          "under DeepSpeed-Ulysses is a shard of the sequence; re-plan with --cp 1, or use a "
                          "model with rotary positions.")
    cores = []  # every block is checked before any is changed
    for index in range(1, layers.num_layers + 1):
        block = layers.block(index)
        existing = [m for m in block.modules() if isinstance(m, DistributedAttention)]
        if existing:
            sizes = {torch.distributed.get_world_size(m.spg) for m in existing}
            if sizes != {plan.cp}:
                raise DsautoError(f"Transformer layer {index} runs DistributedAttention over {sorted(sizes)} "
                                  f"ranks but the plan's cp is {plan.cp}; re-plan with --cp {min(sizes)}.")
            continue
        core = getattr(block, CORE_ATTENTION, None)
        if not isinstance(core, nn.Module):
            raise DsautoError(f"The plan runs DeepSpeed-Ulysses (cp={plan.cp}), but transformer layer {index} "
                              f"({type(block).__name__}) has neither a DistributedAttention nor a "
                              f"'{CORE_ATTENTION}' submodule taking (batch, sequence, heads, head dim) queries, "
                              f"keys and values; wrap its attention in deepspeed.sequence.layer.DistributedAttention, "
                              f"or re-plan with --cp 1.")
        if getattr(core, "sinks", None) is not None:
            raise DsautoError(f"The plan runs DeepSpeed-Ulysses (cp={plan.cp}), which splits the attention heads "
                              f"over its ranks, but transformer layer {index} has a learned sink per head "
                              f"(gpt-oss) that dsauto does not split; re-plan with --cp 1.")
        cores.append((block, core))
    for block, core in cores:
        setattr(block, CORE_ATTENTION, UlyssesAttention(core, mpu.get_sequence_parallel_group()))
    return len(cores)


def sequence_shard(tensor: torch.Tensor, plan: Plan, rank: int, dim: int = 1) -> torch.Tensor:
    """This sequence-parallel rank's (``rank``, 0..cp-1) contiguous 1/cp of ``tensor`` along its
    sequence dimension ``dim`` (tokens and labels: batch first, dim 1)."""
    length = tensor.shape[dim]
    if length % plan.cp:
        raise DsautoError(f"A sequence of {length} tokens does not split into cp={plan.cp} equal shards; "
                          f"train on sequences of a multiple of {plan.cp} tokens.")
    return tensor.narrow(dim, rank * (length // plan.cp), length // plan.cp)


def shard_loss(loss: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The loss a sequence-parallel rank back-propagates: its shard's mean over cp (DeepSpeed sums
    the cp ranks' gradients and averages over dp only)."""
    return loss / plan.cp
