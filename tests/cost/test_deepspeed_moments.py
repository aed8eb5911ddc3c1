"""DeepSpeed's memory moment by moment (ZeRO 0-2): the terms against hand-computed values, and the
whole prediction against peaks measured tensor by tensor on two CPU ranks (DeepSpeed 0.19.8)."""

from __future__ import annotations

import pytest

from dsauto.cost.step import (
    deepspeed_moment_peak,
    deepspeed_pipeline_applies,
    deepspeed_pipeline_moment_peak,
    deepspeed_moments_apply,
    mlp_backward_bytes,
    offload_staging_bytes,
    optimizer_step_bytes,
    predict_step,
    stage_constant_bytes,
)
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec

MiB = 2**20


def strategy(zero: int, accum: int = 1, pp: int = 1, offload: str = "none") -> Strategy:
    return Strategy(dims=ParallelDims(dp=2, tp=1, pp=pp), zero_stage=zero, micro_batch=1, grad_accum=accum,
                    sequence_parallel=False, offload=offload)


def test_the_moments_apply_to_zero_0_to_2_on_one_stage():
    assert deepspeed_moments_apply(strategy(0)) and deepspeed_moments_apply(strategy(0, pp=2))
    assert deepspeed_moments_apply(strategy(1)) and deepspeed_moments_apply(strategy(2, accum=4))
    assert not deepspeed_moments_apply(strategy(1, pp=2))  # the pipeline engine reduces after the flush
    assert deepspeed_moments_apply(strategy(2, offload="optimizer"))
    assert not deepspeed_moments_apply(strategy(3))


def test_offload_keeps_no_gradient_on_the_device_but_both_buckets_and_a_staging_buffer():
    # Measured on two CPU ranks (bench-gpt of benchmarks/accuracy.py, ZeRO-1 and -2 offloaded, one
    # micro-batch): the parameters, two 16 MiB buckets, the 4 MiB staging buffer, the activations.
    assert offload_staging_bytes(strategy(2, offload="optimizer"), 4 * MiB, 8 * MiB) == (4 * MiB, 4 * MiB)
    assert offload_staging_bytes(strategy(2, accum=2, offload="optimizer"), 4 * MiB, 8 * MiB) == (4 * MiB, 12 * MiB)
    assert offload_staging_bytes(strategy(1, accum=2, offload="optimizer"), 4 * MiB, 8 * MiB) == (4 * MiB, 4 * MiB)
    assert offload_staging_bytes(strategy(1), 4 * MiB, 8 * MiB) == (0.0, 0.0)
    for zero in (1, 2):
        peak = deepspeed_moment_peak(
            strategy(zero, offload="optimizer"), params=16 * MiB, grads=16 * MiB, optim=0.0, activation=10 * MiB,
            head_transient=2 * MiB, layers=[(10 * MiB, 0.0)], bucket=16 * MiB, awaiting_grad=0.0,
            local_grads=16 * MiB, embedding_grad=4 * MiB, tied_grad=0.0, backward_working=1 * MiB,
            single_tensor=True, staging=4 * MiB)
        assert peak == (16 + 4 + 32 + 10 + 1) * MiB


def test_the_mlp_backward_holds_the_inner_gradients_and_the_output_weight_gradient():
    gelu = ModelSpec(name="g", architecture="decoder", num_layers=2, hidden_size=256, num_attention_heads=4,
                     ffn_hidden_size=1024, vocab_size=4096, max_position_embeddings=256)
    swiglu = ModelSpec(name="s", architecture="decoder", num_layers=2, hidden_size=192, num_attention_heads=6,
                       ffn_hidden_size=512, vocab_size=2048, max_position_embeddings=256, mlp="swiglu",
                       norm="rmsnorm", position_embedding="rope")
    # 512 tokens: the 512 x 1024 gradient of the GeLU output and the 1024 x 256 fc2 weight gradient
    assert mlp_backward_bytes(gelu, 512, 1, 4) == (512 * 1024 + 1024 * 256) * 4 == 3 * MiB
    # gated: the gate's and the up projection's gradients at once, 2 x 1 MiB, and the 512 x 192 weight's
    assert mlp_backward_bytes(swiglu, 512, 1, 4) == (2 * 512 * 512 + 512 * 192) * 4
    assert mlp_backward_bytes(gelu, 512, 2, 4) == 1.5 * MiB  # tensor parallelism splits both


# One stage of two transformer layers (in backward order: the last first) on 2 ranks, in MiB:
# parameters 10, optimizer 20, kept activations 30 (the last layer's backward holds 35 of them with
# its transient, the first 25), the loss 12 more, 8 MiB of gradients (the layers after the last: 1,
# after the first: 4), the embedding's 2, a layer's backward 3 more, 4 MiB buckets.
LAYERS = [(35 * MiB, 1 * MiB), (25 * MiB, 4 * MiB)]


def peak(zero: int, accum: int, grads: float, tied: float = 0.0) -> float:
    return deepspeed_moment_peak(strategy(zero, accum), 10 * MiB, grads, 20 * MiB, 30 * MiB, 12 * MiB, LAYERS,
                                 4 * MiB, tied, 8 * MiB, 2 * MiB, tied, 3 * MiB, single_tensor=True)


def test_without_zero_the_peak_is_the_loss_a_layer_with_the_gradients_after_it_or_the_flat_copy():
    # loss 30 + 12; the last layer 35 + 3 + 1 of gradients; after backward twice the 8 of gradients
    assert peak(0, 1, 8 * MiB) == 30 * MiB + max(42, 39, 16) * MiB
    # accumulating: every moment of the second micro-batch holds all 8 of them
    assert peak(0, 2, 8 * MiB) == 30 * MiB + max(42 + 8, 35 + 3 + 8, 16) * MiB


def test_zero1_holds_both_buckets_from_the_first_hook_and_the_accumulated_gradients_later():
    # one micro-batch: the last layer's backward holds 35 + 3 and the two 4 MiB buckets; its
    # gradients went to the buckets; the 4 MiB partition once 4 < the gradients after a layer
    assert peak(1, 1, 8 * MiB) == 30 * MiB + max(42, 35 + 3 + 8, 25 + 3 + 8, 8 + 2 + 4) * MiB
    # accumulating: the loss of the second micro-batch with the 8 accumulated in .grad and the buckets
    assert peak(1, 4, 8 * MiB) == 30 * MiB + max(42 + 8 + 8, 35 + 3 + 8 + 8) * MiB


def test_zero2_holds_its_partition_once_a_bucket_was_reduced_and_the_accumulated_one_later():
    # the first layer's backward comes after 4 MiB of gradients, not more than a bucket: no partition
    assert peak(2, 1, 4 * MiB) == 30 * MiB + max(42, 35 + 3 + 8, 25 + 3 + 8, 8 + 2 + 4) * MiB
    # accumulating: the accumulated 4 MiB partition at every moment, and the new one at the embedding
    assert peak(2, 4, 4 * MiB) == 30 * MiB + max(42 + 4, 35 + 3 + 8 + 4, 8 + 2 + 4 + 4) * MiB


def test_a_tied_table_waits_through_backward_and_is_summed_at_the_embedding():
    # 6 MiB table: held by every layer's backward, and three copies at the embedding's backward
    assert peak(2, 1, 4 * MiB, tied=6 * MiB) == 30 * MiB + max(42, 35 + 3 + 8 + 6, 8 + 2 + 12 + 4) * MiB


def test_the_update_is_a_moment_of_its_own():
    update = optimizer_step_bytes(strategy(1), 10 * MiB, 8 * MiB, 60 * MiB, 4 * MiB, True)
    assert update == (10 + 4 + 60 + 60 / 3) * MiB  # ZeRO-1 reduced into its partition, copied flat in fp32
    small = deepspeed_moment_peak(strategy(1), 10 * MiB, 8 * MiB, 60 * MiB, 0.0, 0.0, [], 4 * MiB, 0.0, 8 * MiB,
                                  0.0, 0.0, 0.0, single_tensor=True)
    assert small == update


def test_the_search_counts_what_every_moment_holds_beyond_the_layer_columns():
    bucket, grads = 4 * MiB, 8 * MiB
    assert stage_constant_bytes(strategy(1, accum=4), bucket, grads) == 2 * bucket  # buckets at the loss
    assert stage_constant_bytes(strategy(2, accum=4), bucket, grads) == 0  # the partition, in its column
    # a step's only micro-batch reaches its loss before any gradient exists
    assert stage_constant_bytes(strategy(1), bucket, grads) == -grads
    assert stage_constant_bytes(strategy(2), bucket, grads) == -grads
    assert stage_constant_bytes(strategy(1, accum=4, pp=2), bucket, grads) == 2 * bucket


# A 17M-parameter GPT (16 MiB tied embedding) on two CPU ranks in fp32, micro-batches of 128 tokens.
# Peaks measured tensor by tensor (dsauto.profile.memory's counter, every live tensor at the peak
# listed): all at the embedding's backward, with the flat parameters (64.4 MiB), the fp32 partition
# and its two moments (96.5), the two 16 MiB buckets and three copies of the table's gradient, plus
# ZeRO-1's accumulated gradients (64.4), ZeRO-2's accumulated and new partitions (2 x 32.3), or
# without accumulation the one partition (32.3).
WIDE = ModelSpec(name="wide", architecture="decoder", num_layers=4, hidden_size=512, num_attention_heads=8,
                 ffn_hidden_size=2048, vocab_size=8192, max_position_embeddings=128, dropout=False)


@pytest.mark.parametrize("zero, mb, accum, measured_mib", [
    (1, 1, 8, 305.25), (2, 1, 8, 305.46), (1, 2, 1, 273.18), (2, 2, 1, 273.18)])
def test_the_peaks_of_zero_1_and_2_match_the_measured_ones(zero, mb, accum, measured_mib):
    cpu = load_cluster("cpu", nodes=1, gpus_per_node=2)
    s = Strategy(dims=ParallelDims(dp=2, tp=1, pp=1), zero_stage=zero, micro_batch=mb, grad_accum=accum,
                 sequence_parallel=False)
    options = [LayerOption(checkpoint=False, shard_params=False, split=1)] * (WIDE.num_layers + 2)
    predicted = predict_step(WIDE, cpu, TrainSpec(2 * mb * accum, 128, "fp32"), s, [WIDE.num_layers], options)
    assert predicted.prediction.peak_memory_bytes / MiB == pytest.approx(measured_mib, rel=0.002)


def pipeline(zero: int, accum: int) -> Strategy:
    return Strategy(dims=ParallelDims(dp=1, tp=1, pp=2), zero_stage=zero, micro_batch=1, grad_accum=accum,
                    sequence_parallel=False)


def test_the_pipeline_engine_keeps_its_buffers_and_the_last_logits():
    assert deepspeed_pipeline_applies(pipeline(0, 1)) and deepspeed_pipeline_applies(pipeline(1, 4))
    assert not deepspeed_pipeline_applies(strategy(0)) and not deepspeed_pipeline_applies(strategy(0, pp=2))
    common = dict(params=6 * MiB, grads=6 * MiB, optim=12 * MiB, activation=10 * MiB, head_transient=6 * MiB,
                  layers=[(10 * MiB, 0.0)], bucket=16 * MiB, boundary=1 * MiB, logits=2 * MiB,
                  backward_working=1 * MiB)
    # Last stage, one micro-batch: the loss (10 + 6) over the received buffer, the received copy
    # and one slot of logits.
    assert deepspeed_pipeline_moment_peak(pipeline(0, 1), 1, 1, **common) == (6 + 12 + 2 + 2 + 16) * MiB
    # Two micro-batches: both slots keep logits and received copies, and the second loss has the gradients.
    assert deepspeed_pipeline_moment_peak(pipeline(0, 2), 1, 1, **common) == (6 + 12 + 3 + 4 + 22) * MiB
    # First stage, two in flight: the other's activations and output, its own output, the gradient buffer.
    assert deepspeed_pipeline_moment_peak(pipeline(0, 2), 0, 2, **common) == (6 + 12 + 1 + 11 + 1 + 11) * MiB
    # ZeRO-1 (no overlap_comm under the pipeline engine): one bucket from the first gradient hook
    # on, a second with the gradients at the reduction after the flush.
    assert deepspeed_pipeline_moment_peak(pipeline(1, 2), 0, 2, **common) == (6 + 12 + 1 + 11 + 1 + 11 + 16) * MiB
    assert deepspeed_pipeline_moment_peak(pipeline(1, 1), 0, 1, **dict(common, activation=0.0, layers=[])) \
        == (6 + 12 + 1 + 6 + 32) * MiB
