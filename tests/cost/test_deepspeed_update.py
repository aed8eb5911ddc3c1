"""DeepSpeed's ZeRO optimizer update (dsauto.cost.step.optimizer_step_bytes): the flat gradient copy
and its fp32 cast, and ZeRO-3's sub-groups, against hand-computed values and against the peak of
real DeepSpeed engines on two CPU ranks (benchmarks/deepspeed_update.py)."""

from __future__ import annotations

import dataclasses

import pytest

from dsauto.cost.step import optimizer_step_bytes
from dsauto.cost.strategy import Strategy
from dsauto.engines.deepspeed import SUB_GROUP_SIZE
from dsauto.parallel import ParallelDims
from tests.benchmark_modules import load

GiB = 2**30


def strategy(zero: int, dp: int = 8) -> Strategy:
    return Strategy(dims=ParallelDims(dp=dp, tp=1, pp=1), zero_stage=zero, micro_batch=1, grad_accum=1,
                    sequence_parallel=False)


def test_16_bit_gradients_are_flattened_and_cast_so_both_copies_are_alive():
    elements = 1e8  # the rank's partition
    fp32 = optimizer_step_bytes(strategy(2), 0.0, 4 * elements, 12 * elements, 0, False)
    bf16 = optimizer_step_bytes(strategy(2), 0.0, 2 * elements, 12 * elements, 0, False, grads_in_16_bits=True)
    assert fp32 == 4 * elements + 12 * elements + 4 * elements  # the cast returns the flat fp32 copy itself
    assert bf16 == 2 * elements + 12 * elements + (2 + 4) * elements


def test_zero3_casts_one_sub_group_at_a_time():
    # Llama 3 70B's partition over 8 ranks, 8.8e9 elements: one 1e9-element sub-group's copies (plus
    # at most one parameter's partition less one element), not the whole partition's 53 GiB.
    elements, largest = 70e9 / 8, 4 * (8192 * 28672) / 8
    step = optimizer_step_bytes(strategy(3), 2 * elements, 2 * elements, 12 * elements, 0, False, largest, True)
    sub = SUB_GROUP_SIZE + largest / 4 - 1
    assert step == pytest.approx(16 * elements + 6 * sub)
    assert 6 * sub < 6 * GiB < 6 * 4 * elements / 4
    # A partition smaller than a sub-group is cast whole.
    small = optimizer_step_bytes(strategy(3), 0.0, 0.0, 12 * 1e8, 0, False, largest, True)
    assert small == (12 + 6) * 1e8


@pytest.mark.slow
def test_the_update_peaks_where_real_deepspeed_engines_peak():
    bench = load("deepspeed_update")
    cases = tuple(c for c in bench.CASES if c.dtype == "bf16")
    measured = bench.measure(cases)
    for case in cases:
        predicted, update = bench.predicted_bytes(case), measured[case.name]["update"]
        # Never under (what rounds below a KiB is DeepSpeed's scalars); over only by the sub-group
        # bound's one parameter's partition (3 MiB of 72 here).
        assert update - 2**10 <= predicted <= update * 1.05, (case, predicted, measured)
        if case.sub_group_size is None:
            assert predicted == pytest.approx(update, rel=1e-3), case
        if case.sequence_parallel > 1:  # DeepSpeed-Ulysses: what backward holds more
            plain = measured[dataclasses.replace(case, sequence_parallel=1).name]["backward"]
            more = measured[case.name]["backward"] - plain
            priced = bench.predicted_ulysses_bytes(case)
            if case.zero_stage in (1, 2):  # one or two reductions' copies alive, by gloo's threads: two priced
                assert more <= priced * 1.01 and priced <= 2 * more * 1.01, (case, priced, more)
            else:
                assert priced == pytest.approx(more, rel=0.01), case


def test_without_zero_16_bit_training_casts_every_gradient_at_the_update():
    # FP16_UnfusedOptimizer: 16-bit parameters and gradients, 12 bytes of state, 4-byte copies.
    assert optimizer_step_bytes(strategy(0), 2e8, 2e8, 12e8, 0, False, grads_in_16_bits=True) == 20e8
    assert optimizer_step_bytes(strategy(0), 4e8, 4e8, 8e8, 0, False) == 0.0  # fp32: in place


def test_a_bf16_pipeline_without_zero_runs_bf16_optimizer():
    from dsauto.cost.layer import CostModel
    from dsauto.cost.step import predict_step
    from dsauto.cost.strategy import LayerOption
    from dsauto.plan import deepspeed_bf16_optimizer
    from dsauto.spec.loaders import load_cluster
    from dsauto.spec.model import ModelSpec, layer_groups
    from dsauto.spec.training import TrainSpec

    assert deepspeed_bf16_optimizer("deepspeed", 0, 2, "bf16")
    assert not any((deepspeed_bf16_optimizer("deepspeed", 1, 2, "bf16"), deepspeed_bf16_optimizer("deepspeed", 0, 1, "bf16"),
                    deepspeed_bf16_optimizer("deepspeed", 0, 2, "fp16"), deepspeed_bf16_optimizer("megatron", 0, 2, "bf16")))
    model = ModelSpec(name="m", architecture="decoder", num_layers=4, hidden_size=256, num_attention_heads=4,
                      ffn_hidden_size=1024, vocab_size=4096, max_position_embeddings=256, dropout=False)
    cpu = load_cluster("cpu", nodes=1, gpus_per_node=4)
    train = TrainSpec(global_batch=8, seq_len=256, dtype="bf16")
    block = layer_groups(model, 256, 2)[1]
    option = LayerOption(checkpoint=False, shard_params=False, split=1)
    for dp in (1, 2):
        s = Strategy(dims=ParallelDims(dp=dp, tp=1, pp=2), zero_stage=0, micro_batch=1, grad_accum=8 // dp,
                     sequence_parallel=False)
        layer = CostModel(cpu, train, s, model.hidden_size).layer(block, option)
        # fp32 main weights and moments of the rank's 1/dp partition, and the whole 16-bit accumulator
        assert layer.optimizer_bytes == pytest.approx(block.params * (12 / dp + 2))
        assert layer.grads_bytes == pytest.approx(block.params * 2)
        step = predict_step(model, cpu, train, s, [2, 2], [option] * 6)
        for stage in step.stages:
            # the update: parameters, .grad, the accumulator and the state, and the fp32 cast of the
            # partition of the accumulator
            update = stage.params_bytes + stage.grads_bytes + stage.optimizer_bytes \
                + 4 * (stage.optimizer_bytes - stage.grads_bytes) / 12
            assert stage.peak_bytes >= update - 2


def test_zero3_keeps_its_bucket_in_fp32_under_ulysses():
    from dsauto.cost.step import held_bucket_bytes

    ulysses = Strategy(dims=ParallelDims(dp=1, tp=1, pp=1, cp=2), zero_stage=3, micro_batch=1, grad_accum=1,
                       sequence_parallel=False)
    assert held_bucket_bytes(ulysses, 2 * 2**20, 2) == 4 * 2**20  # bf16 gradients, an fp32 bucket
    assert held_bucket_bytes(ulysses, 4 * 2**20, 4) == 4 * 2**20
    assert held_bucket_bytes(strategy(3), 2 * 2**20, 2) == 2 * 2**20  # without Ulysses: the training dtype
    zero2 = Strategy(dims=ParallelDims(dp=1, tp=1, pp=1, cp=2), zero_stage=2, micro_batch=1, grad_accum=1,
                     sequence_parallel=False)
    assert held_bucket_bytes(zero2, 2 * 2**20, 2) == 2 * 2**20  # ZeRO 1-2's buckets: the training dtype


def test_the_description_names_the_wrapper_that_holds_more():
    from dsauto.api import make_plan
    from dsauto.describe import describe_plan

    def described(**pins) -> str:
        return describe_plan(make_plan("bert-large", "a100-80gb", nodes=1, engine="deepspeed", global_batch=64,
                                       seq_len=512, **pins))

    assert "with its FP16_UnfusedOptimizer (fp32 copies of the gradients at the update)" in described(zero_stage=0, pp=1)
    assert "with its BF16_Optimizer (a 16-bit gradient accumulator, counted with the optimizer state)" in described(
        zero_stage=0, pp=8)
    assert "Optimizer" not in described(zero_stage=1, pp=1)


def test_one_replica_still_flattens_and_casts():
    # A pipeline's ZeRO-1 over one data-parallel rank: the partition is every gradient.
    one = Strategy(dims=ParallelDims(dp=1, tp=1, pp=2), zero_stage=1, micro_batch=1, grad_accum=4,
                   sequence_parallel=False)
    assert optimizer_step_bytes(one, 2e8, 2e8, 12e8, 0, False, grads_in_16_bits=True) == (2 + 2 + 12 + 6) * 1e8


def test_ulysses_casts_where_a_bucket_is_reduced():
    from dsauto.cost.step import deepspeed_moment_peak, ulysses_cast_bytes

    MiB = 2**20

    def ulysses(zero: int, offload: str = "none") -> Strategy:
        return Strategy(dims=ParallelDims(dp=1, tp=1, pp=1, cp=2), zero_stage=zero, micro_batch=1, grad_accum=1,
                        sequence_parallel=False, offload=offload)

    bucket = 4 * MiB
    assert ulysses_cast_bytes(ulysses(2), bucket, 64 * MiB, True) == 2 * 2 * bucket  # two buckets in flight
    assert ulysses_cast_bytes(ulysses(2), bucket, 64 * MiB, True, largest_grad=16 * MiB) == 2 * (bucket + 16 * MiB)
    assert ulysses_cast_bytes(ulysses(2), bucket, 64 * MiB, False) == 0.0  # fp32 gradients: no cast
    assert ulysses_cast_bytes(ulysses(0), bucket, 64 * MiB, True) == 2 * 64 * MiB
    assert ulysses_cast_bytes(ulysses(0), bucket, 4e9, True) == 2 * 2 * 5e8  # one 5e8-element bucket at a time

    def peak(zero: int, layers, offload: str = "none", cp: bool = True) -> float:
        s = ulysses(zero, offload) if cp else Strategy(dims=ParallelDims(dp=2, tp=1, pp=1), zero_stage=zero,
                                                        micro_batch=1, grad_accum=1, sequence_parallel=False,
                                                        offload=offload)
        return deepspeed_moment_peak(s, 10 * MiB, 32 * MiB, 0.0, 100 * MiB, 0.0, layers, bucket, 0.0, 64 * MiB,
                                     0.0, 0.0, 0.0, False, grads_in_16_bits=True)

    # The first layer in backward, before a bucket's worth of gradients: nothing reduced, no cast.
    assert peak(2, [(100 * MiB, 0.0)]) == peak(2, [(100 * MiB, 0.0)], cp=False)
    # Once a bucket's worth came after the layer, its reduction's copies are alive too.
    assert peak(2, [(100 * MiB, 8 * MiB)]) == peak(2, [(100 * MiB, 8 * MiB)], cp=False) + 4 * bucket
    # ZeRO-Offload casts the same way.
    assert peak(2, [(100 * MiB, 8 * MiB)], "optimizer") == peak(2, [(100 * MiB, 8 * MiB)], "optimizer", cp=False) \
        + 4 * bucket
