"""DeepSpeed ZeRO over a Megatron-core tensor-parallel model, told the layout by dsauto's mpu.

The DeepSpeed runs train the same GPT, weights and batches as a Megatron-core run of the same plan
in the same launch (itself checked against TP=1 in test_megatron_plugin.py); the losses must agree to the
tolerance explained there. Gradient clipping at 1.0 is active in some of the compared steps (the
gradient norm exceeds 1), so the norm DeepSpeed sums over the mpu's model-parallel group, counting
replicated parameters on TP rank 0 only, shapes the updates being compared.
"""

from __future__ import annotations

import pytest
from megatron_launch import launch, make_plan

pytest.importorskip("megatron.core")
pytest.importorskip("deepspeed")

from dsauto.errors import DsautoError
from dsauto.runtime.mpu import MegatronCoreMpu

RTOL = 1e-5  # as in test_megatron_plugin.py

# What DeepSpeed 0.19 calls on an mpu (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py,
# runtime/utils.py, runtime/engine.py, utils/bwc.py, utils/groups.py).
CALLED = [
    "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
    "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_src_rank",
    "get_pipeline_model_parallel_group", "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size", "get_data_parallel_group", "get_data_parallel_rank",
    "get_data_parallel_world_size", "get_data_parallel_group_ranks",
]
# What DeepSpeed probes for with hasattr and would then treat as DeepSpeed-Ulysses sequence
# parallelism (dividing its data-parallel world by it): Megatron's sequence parallelism is not that.
ABSENT = ["get_sequence_parallel_world_size", "get_sequence_parallel_group", "initialize_sequence_parallel",
          "get_sequence_data_parallel_world_size"]


def test_the_adapter_answers_what_deepspeed_calls_and_nothing_it_would_misread():
    assert all(callable(getattr(MegatronCoreMpu, name, None)) for name in CALLED)
    assert not any(hasattr(MegatronCoreMpu, name) for name in ABSENT)


def test_the_adapter_needs_the_model_parallel_groups():
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        pytest.skip("another test initialised Megatron-core's groups in this process")
    with pytest.raises(DsautoError, match="call initialize_model_parallel"):
        MegatronCoreMpu()


def test_deepspeed_zero_trains_a_tensor_parallel_megatron_model(tmp_path):
    # DeepSpeed does not all-reduce the sequence-parallel norm gradients (see dsauto/runtime/mpu.py).
    plans = {stage: make_plan(tp=2, zero_stage=stage, sequence_parallel=False) for stage in (1, 2)}
    results = launch(2, {
        "megatron": {"plan": plans[1]},
        "zero1": {"plan": plans[1], "engine": "deepspeed"},
        "zero2": {"plan": plans[2], "engine": "deepspeed"},
    }, tmp_path, steps=5)
    megatron = results["megatron"]["losses"]
    assert megatron[-1] < megatron[0]
    for stage in (1, 2):
        run = results[f"zero{stage}"]
        assert (run["zero_stage"], run["tp_world_size"], run["dp_world_size"]) == (stage, 2, 1)
        assert max(run["grad_norms"][:-1]) > 1.0  # clipping shaped an update whose effect is compared
        assert run["losses"] == pytest.approx(megatron, rel=RTOL)


@pytest.mark.slow
def test_deepspeed_zero_partitions_over_the_data_parallel_ranks_only(tmp_path):
    # 4 ranks: tp 2 x dp 2. ZeRO-2 shards over the mpu's data-parallel group of 2, not over all 4.
    # The Megatron run of the same layout uses its distributed optimizer (ZeRO-1): Megatron-FSDP,
    # its ZeRO-2, needs CUDA. Sharding changes where the optimizer runs, not the arithmetic.
    plan = make_plan(tp=2, dp=2, zero_stage=2, sequence_parallel=False)
    megatron = make_plan(tp=2, dp=2, zero_stage=1, sequence_parallel=False)
    results = launch(4, {"megatron": {"plan": megatron}, "zero2": {"plan": plan, "engine": "deepspeed"}},
                     tmp_path, steps=5)
    run = results["zero2"]
    assert (run["tp_world_size"], run["dp_world_size"]) == (2, 2)
    assert run["losses"] == pytest.approx(results["megatron"]["losses"], rel=RTOL)
