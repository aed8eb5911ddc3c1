"""What a DeepSpeed ZeRO-3 rank holds at each moment of a step, beyond its layers' own columns.

DeepSpeed 0.19.8, deepspeed/runtime/zero/. Held for the whole run, from the engine's start: the
parameter partitions (``ds_tensor``, flattened by ``_create_fp16_partitions_with_defragmentation``),
the fp32 master partition and the two Adam moments, the gradient partitions
(``grad_partitions_flat_buffer``) and one ``reduce_bucket_size`` buffer that the reduction hooks
copy gradients into (``ipg_buckets``; ``DeepSpeedZeroOptimizer_Stage3.__init__``): the layers'
params, grads and optimizer columns, and :func:`dsauto.cost.step.stage_constant_bytes`. Besides,
at the moments of a step:

- the parameters the coordinator holds gathered (:func:`gathered_params_bytes`), at every moment of
  forward and backward;
- the loss: the head's transient (logits, log-softmax and their gradients), before any weight
  gradient exists, or the head's weight's backward (:func:`head_moment_bytes`), on top of every
  kept activation;
- a layer's backward: its transient (a recomputed layer's activations), the gradients inside its
  backward (:func:`layer_backward_bytes`) and the weight gradient autograd has made and the
  reduction hook has not copied into the bucket yet; the head has freed what it kept by then;
- after backward, the optimizer update (:func:`dsauto.cost.step.optimizer_step_bytes`).

Measured tensor by tensor on two CPU ranks (the ZeRO-3 rows of benchmarks/results/accuracy.md;
DeepSpeed 0.19.8, torch 2.13): the peaks are the loss, the head's backward of a chunked loss or a
recomputed layer's backward, with the gathered parameters above.
"""

from __future__ import annotations

from collections.abc import Sequence

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import local_params
from dsauto.spec.model import LayerGroup


def zero3_moments_apply(strategy: Strategy) -> bool:
    """Whether :func:`zero3_moment_peak` prices the strategy: DeepSpeed ZeRO-3 with data
    parallelism on one pipeline stage, nothing offloaded (offload keeps the partitions and the
    gradients on the host; DeepSpeed pipelines run ZeRO 0-1 only)."""
    return (strategy.engine == "deepspeed" and strategy.zero_stage == 3 and strategy.dims.replicas > 1
            and strategy.pp == 1 and strategy.offload == "none")


def sharded_param_bytes(groups: Sequence[LayerGroup], options: Sequence[LayerOption], layers: Sequence[int],
                        tp: int, dtype_bytes: int) -> float:
    """Parameter bytes of the flat ``layers`` (``groups``: their descriptors, in order) that ZeRO-3
    keeps sharded: everything the coordinator could gather during a step (a tied LM head's weight
    is the embedding's table, counted there)."""
    return sum(local_params(group, tp) * dtype_bytes
               for group, layer in zip(groups, layers) if options[layer].shard_params)


def gathered_params_bytes(sharded_bytes: float, prefetch_bucket_bytes: float) -> float:
    """Gathered (full) copies of sharded parameters that a ZeRO-3 rank holds at once during forward
    and backward, under the emitted ``stage3_prefetch_bucket_size`` (``prefetch_bucket_bytes``),
    ``stage3_max_live_parameters`` of twice that and ``stage3_max_reuse_distance`` 0
    (dsauto.emit.ds_config): the bound, or every sharded parameter when they are fewer.

    From the second forward on, ``PartitionedParameterCoordinator.fetch_sub_module``
    (deepspeed/runtime/zero/partitioned_param_coordinator.py) follows the module trace it recorded:
    after gathering a module's own parameters, it gathers the next ones of the trace ahead, at most
    ``stage3_prefetch_bucket_size`` elements per module fetch (modules without parameters fetch
    too), while the gathered elements (``__n_available_params``) stay below
    ``stage3_max_live_parameters``. ``release_sub_module`` frees a module's parameters after use,
    except those whose next use the prefetcher has already passed (``__params_to_release``): a
    tied embedding table stays gathered from the head's forward to its backward. So the gathered
    bytes climb to the bound and stay there, less only when fewer parameters are sharded.
    Measured at the peaks (forward and backward of the head, backward of a recomputed block): 8.00
    MiB of a bound of 8 MiB with every group sharded, and 4.25 MiB, the sharded embedding table and
    positions, under a bound of 8 MiB when the blocks are resident (benchmarks/results/accuracy.md,
    bench-gpt). The prefetch loop stops only after the parameter that reaches the bound, so the
    bound can be passed by part of one parameter where the trace's parameters do not add up to it.
    """
    return min(sharded_bytes, 2.0 * prefetch_bucket_bytes)


def regathered_head_bytes(head: LayerGroup, option: LayerOption, table_sharded: bool, tp: int,
                          dtype_bytes: int) -> float:
    """A second gathered copy of the LM head's weight at the loss of a head that computes its loss in
    chunks (``option.split`` > 1, dsauto.runtime.split.chunked_cross_entropy) when that weight is
    sharded (``table_sharded``: the head's own matrix, or the embedding's table for a tied head).

    Each chunk's forward is recomputed in backward under checkpointing; the coordinator releases the
    weight after the recomputation (``release_sub_module``), and the head's matrix multiply, which
    ZeRO-3 routes through ``LinearFunctionForZeroStage3`` (deepspeed/runtime/zero/linear.py), gathers
    it again in its backward (``weight.all_gather()`` when ``ds_status`` is NOT_AVAILABLE) while the
    copy the recomputation saved is still alive. Measured: two 4 MiB copies of bench-gpt's tied
    table at the peak of its plan with the loss in 2 chunks (benchmarks/results/accuracy.md)."""
    if option.split <= 1 or not table_sharded:
        return 0.0
    return head.largest_op_params / tp * dtype_bytes


def head_backward_bytes(head: LayerGroup, option: LayerOption, tokens: int, tp: int, dtype_bytes: int) -> float:
    """The LM head's backward for one loss chunk (``option.split`` chunks, 1: the whole
    micro-batch of ``tokens``), which ZeRO-3 runs through ``LinearFunctionForZeroStage3.backward``
    (deepspeed/runtime/zero/linear.py): the chunk's logits gradient and the weight gradient it
    makes; with chunks, also the weight gradient of the chunks after it, which autograd holds to add
    this one to (a weight used k times gets one gradient, the sum, before its hook runs), so two
    weight gradients at once. Measured on two CPU ranks with the loss in 2 chunks: 2 x 4 MiB weight
    gradients beside a 2 MiB chunk of logits gradient (bench-gpt, micro-batch 1), and 2 x 1.5 MiB
    beside 1 MiB (bench-llama; benchmarks/results/accuracy.md)."""
    vocab = head.largest_op_params / head.gemm_dim  # the LM head is vocabulary x hidden
    logits_grad = tokens * vocab / tp * dtype_bytes / option.split
    weight_grad = head.largest_op_params / tp * dtype_bytes
    return logits_grad + (2 if option.split > 1 else 1) * weight_grad


def head_moment_bytes(own_transient: float, head: LayerGroup, option: LayerOption, table_sharded: bool,
                      tokens: int, tp: int, dtype_bytes: int, dynamic: float) -> float:
    """The head's moment under ZeRO-3, beyond the gathered parameters: the larger of its loss
    (``own_transient``: the head's transient without its gathered unit) and its weight's backward
    (:func:`head_backward_bytes`), with the second copy of a chunked sharded weight
    (:func:`regathered_head_bytes`); ``dynamic``: the activation-memory calibration."""
    backward = head_backward_bytes(head, option, tokens, tp, dtype_bytes)
    regathered = regathered_head_bytes(head, option, table_sharded, tp, dtype_bytes)
    return max(own_transient, dynamic * backward) + dynamic * regathered


def layer_backward_bytes(tokens: int, hidden_size: int, ffn_hidden_size: int, tp: int, dtype_bytes: int) -> float:
    """Gradients autograd holds inside a transformer layer's backward, beside its activations (or
    their recomputation): the gradient that arrived at the layer's output (``tokens x hidden``)
    and the one the MLP's output projection passes back to its input, the layer's widest activation
    (``tokens x ffn / tp``). Measured at a recomputed block's backward (micro-batch 8 x 256 tokens,
    fp32, bench-gpt): 2 MiB and 8 MiB beside the 30 MiB recomputed (benchmarks/results/accuracy.md)."""
    return tokens * (hidden_size + ffn_hidden_size / tp) * dtype_bytes


def zero3_moment_peak(params: float, grads: float, optim: float, bucket: float, gathered: float,
                      activation: float, head_activation: float, head_transient: float, body_transient: float,
                      awaiting_grad: float, stepping: float) -> float:
    """Peak bytes of a ZeRO-3 rank over the moments of a step (see the module doc): ``params``,
    ``grads`` and ``optim`` (the layers' columns), the reduction ``bucket`` and the ``gathered``
    parameters at every moment of forward and backward, the kept ``activation``; then the larger
    of the loss (``head_transient``) and a layer's backward (``body_transient`` and the weight
    gradient awaiting its hook, ``awaiting_grad``: ``DeepSpeedZeroOptimizer_Stage3.
    reduce_partition_and_remove_grads`` copies it into the bucket and frees it), by when the head's
    backward has freed what it kept (``head_activation``); or the optimizer update (``stepping``,
    :func:`dsauto.cost.step.optimizer_step_bytes`), when the activations are gone."""
    held = params + grads + optim + bucket + gathered + activation
    return max(held + max(head_transient, body_transient + awaiting_grad - head_activation), stepping)
