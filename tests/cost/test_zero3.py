"""DeepSpeed ZeRO-3's moments (dsauto.cost.zero3), against hand-computed values."""

from __future__ import annotations

import pytest

from dsauto.cost.step import predict_step, prefetch_bytes
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.zero3 import (
    gathered_params_bytes,
    head_backward_bytes,
    layer_backward_bytes,
    regathered_head_bytes,
    sharded_param_bytes,
    zero3_moment_peak,
)
from dsauto.parallel import ParallelDims
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import TrainSpec

MiB = 2**20
# bench-gpt of benchmarks/accuracy.py: hidden 256, FFN 1024, vocabulary 4096 (tied), 4 blocks, fp32.
GPT = ModelSpec(name="bench-gpt", architecture="decoder", num_layers=4, hidden_size=256, num_attention_heads=4,
                ffn_hidden_size=1024, vocab_size=4096, max_position_embeddings=256, dropout=False)
SHARD = LayerOption(checkpoint=False, shard_params=True, split=1)
KEEP = LayerOption(checkpoint=False, shard_params=False, split=1)


def groups():
    embedding, block, head = layer_groups(GPT, 256, 4)
    return embedding, block, head


def test_the_gathered_parameters_are_the_bound_or_every_sharded_parameter():
    # Every group sharded: 17 MiB of parameters, a 4 MiB prefetch bucket (the table): the bound,
    # 2 x 4 MiB (measured 8.00 MiB at the peak).
    assert gathered_params_bytes(17 * MiB, 4 * MiB) == 8 * MiB
    # Blocks resident: the table and the positions, 4.25 MiB, under the same bound (measured 4.25).
    assert gathered_params_bytes(4.25 * MiB, 4 * MiB) == 4.25 * MiB


def test_sharded_bytes_count_the_sharded_layers_once_each():
    embedding, block, head = groups()
    flat = [embedding, block, block, block, block, head]
    mixed = [SHARD, KEEP, KEEP, KEEP, KEEP, SHARD]
    # the tied head holds only its norm (512); the table (4096 x 256) and positions (256 x 256)
    assert sharded_param_bytes(flat, mixed, range(6), 1, 4) == (4096 * 256 + 256 * 256 + 512) * 4
    assert sharded_param_bytes(flat, [KEEP] * 6, range(6), 1, 4) == 0


def test_a_chunked_sharded_head_gathers_its_weight_twice():
    _, _, head = groups()
    chunked = LayerOption(checkpoint=False, shard_params=True, split=2)
    assert regathered_head_bytes(head, chunked, table_sharded=True, tp=1, dtype_bytes=4) == 4 * MiB
    assert regathered_head_bytes(head, chunked, table_sharded=False, tp=1, dtype_bytes=4) == 0
    assert regathered_head_bytes(head, SHARD, table_sharded=True, tp=1, dtype_bytes=4) == 0


def test_the_head_backward_holds_the_chunks_logits_gradient_and_weight_gradients():
    _, _, head = groups()
    # micro-batch 1 x 256 tokens: logits 256 x 4096 x 4 B = 4 MiB, the weight 4096 x 256 x 4 B = 4 MiB
    assert head_backward_bytes(head, SHARD, 256, 1, 4) == 4 * MiB + 4 * MiB
    # in 2 chunks: half the logits' gradient, and the weight gradient of the later chunk held too
    chunked = LayerOption(checkpoint=False, shard_params=True, split=2)
    assert head_backward_bytes(head, chunked, 256, 1, 4) == 2 * MiB + 2 * 4 * MiB


def test_the_peak_is_the_larger_moment_or_the_update():
    # held: 10 + 2 + 6 + 16 + 8 + 30 = 72; the loss 20 against a backward of 12 + awaiting 4, by
    # when the head's 3 kept bytes are freed
    moments = dict(params=10, grads=2, optim=6, bucket=16, gathered=8, activation=30, head_activation=3)
    assert zero3_moment_peak(**moments, head_transient=20, body_transient=12, awaiting_grad=4, stepping=50) == 92
    assert zero3_moment_peak(**moments, head_transient=10, body_transient=12, awaiting_grad=4, stepping=50) == 85
    assert zero3_moment_peak(**moments, head_transient=10, body_transient=12, awaiting_grad=4, stepping=100) == 100


def test_a_layers_backward_holds_the_gradient_it_received_and_its_widest_one():
    # micro-batch 8 x 256 tokens of bench-gpt in fp32: 2 MiB arriving, 8 MiB for the MLP's input
    assert layer_backward_bytes(2048, 256, 1024, 1, 4) == 10 * MiB
    assert layer_backward_bytes(2048, 256, 1024, 2, 4) == 6 * MiB  # the FFN split over tp ranks


def test_a_larger_prefetch_bucket_holds_twice_the_extra_until_every_parameter_is_gathered():
    cpu = load_cluster("cpu", nodes=1, gpus_per_node=2)
    train = TrainSpec(global_batch=4, seq_len=256, dtype="fp32")
    strategy = Strategy(dims=ParallelDims(dp=2), zero_stage=3, micro_batch=2, grad_accum=1, sequence_parallel=False)
    options = [SHARD] * (GPT.num_layers + 2)
    default = prefetch_bytes(layer_groups(GPT, 256, 4), 1, 4, options, GPT.num_layers)
    assert default == 4 * MiB  # the tied table, the largest unit

    def peak(prefetch: int) -> int:
        return predict_step(GPT, cpu, train, strategy, [GPT.num_layers], options,
                            prefetch_bucket=prefetch).prediction.peak_memory_bytes

    assert peak(5 * MiB) - peak(default) == pytest.approx(2 * MiB, abs=1)
    # every sharded parameter (about 17 MiB) is gathered once the bound passes them
    assert peak(64 * MiB) == peak(32 * MiB)
