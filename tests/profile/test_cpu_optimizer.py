"""The host optimizer's measured rate: taken by the profiler, read back by the cost model of an
offloaded plan."""

from __future__ import annotations

import dataclasses

import pytest

from dsauto.cost.layer import CostModel
from dsauto.cost.offload import offloaded_step_seconds
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.profile.cpu_optimizer import DEEPSPEED_CPU_ADAM, TORCH_ADAMW, cpu_adam_built, measure_cpu_optimizer
from dsauto.profile.store import Profile
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.model import layer_groups
from dsauto.spec.training import TrainSpec


def test_the_host_update_is_timed_with_the_optimizer_that_is_there():
    seconds, name = measure_cpu_optimizer(2**16, warmup=1, repeats=3)
    assert seconds > 0
    assert name == (DEEPSPEED_CPU_ADAM if cpu_adam_built() else TORCH_ADAMW)
    # Megatron-core's hybrid optimizer runs torch's fused AdamW on the host, whatever DeepSpeed has built
    assert measure_cpu_optimizer(2**16, warmup=1, repeats=3, engine="megatron")[1] == TORCH_ADAMW == \
        "torch AdamW (fused)"


def test_an_offloaded_plan_is_priced_with_the_profiles_host_rate():
    model = load_model("gpt-tiny")
    train = TrainSpec(global_batch=8, seq_len=64, dtype="fp32")
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=2)
    profile = Profile(model=model, device="cpu", dtype="fp32", seq_len=64, threads=1, versions={"torch": "2.0"},
                      layers=(), optimizer_seconds_per_param=2e-9, cpu_optimizer_seconds_per_param=5e-8,
                      cpu_optimizer=TORCH_ADAMW)
    offloaded = Strategy(ParallelDims(dp=2), zero_stage=2, micro_batch=1, grad_accum=4, sequence_parallel=False,
                         offload="optimizer")
    block = next(g for g in layer_groups(model, 64, 4, 1) if g.kind == "transformer")
    option = LayerOption(checkpoint=False, shard_params=False, split=1)
    owned = block.params / 2
    measured = CostModel(cluster, train, offloaded, model.hidden_size, profile).layer(block, option)
    assert measured.optimizer_seconds == pytest.approx(offloaded_step_seconds(owned, 4, "deepspeed", cluster, 5e-8))
    # (the fp32 gradients down, 5e-8 s a parameter on the host, the parameters up)
    assert measured.optimizer_seconds > owned * 5e-8
    # without the host rate, the host's DRAM bandwidth bounds it; on the device, the device's rate
    unmeasured = dataclasses.replace(profile, cpu_optimizer_seconds_per_param=0.0)
    bound = CostModel(cluster, train, offloaded, model.hidden_size, unmeasured).layer(block, option)
    assert bound.optimizer_seconds == pytest.approx(offloaded_step_seconds(owned, 4, "deepspeed", cluster))
    on_device = dataclasses.replace(offloaded, offload="none")
    assert CostModel(cluster, train, on_device, model.hidden_size, profile).layer(
        block, option).optimizer_seconds == pytest.approx(owned * 2e-9)
