"""Megatron-core's precision-aware optimizer (``--precision-aware-optimizer``): Adam's moments in a
lower dtype and the fp32 main weights kept as remainders, priced, written, read back and refused
where Megatron-core does not run it."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from dsauto.api import make_plan
from dsauto.cli import main
from dsauto.describe import describe_plan
from dsauto.emit.megatron import megatron_args
from dsauto.errors import DsautoError
from dsauto.plan_io import read_plan, write_plan_yaml

PINS = dict(nodes=1, global_batch=64, seq_len=4096, engine="megatron", tp=1, pp=1, zero_stage=1, micro_batch=1,
            checkpoint=True)


def _plan(moments: str | None):
    return make_plan("llama3-8b", "h100-80gb", precision_aware_optimizer=moments, **PINS)


def test_bf16_moments_halve_the_optimizer_shard_and_change_nothing_else():
    standard, bf16 = _plan(None), _plan("bf16")
    assert bf16.precision_aware_optimizer == "bf16" and standard.precision_aware_optimizer is None
    old, new = standard.stages[0], bf16.stages[0]
    assert new.optimizer_bytes == pytest.approx(old.optimizer_bytes * 6 / 12, rel=1e-6)
    assert (new.params_bytes, new.grads_bytes, new.activation_bytes) == (
        old.params_bytes, old.grads_bytes, old.activation_bytes)
    assert bf16.prediction.peak_memory_bytes < standard.prediction.peak_memory_bytes
    assert bf16.prediction.step_seconds <= standard.prediction.step_seconds  # a lighter update


def test_the_plan_writes_megatron_lms_flags_and_reads_back(tmp_path):
    plan = _plan("fp8")
    args = megatron_args(plan)
    for flag in ("--use-distributed-optimizer", "--use-precision-aware-optimizer", "--exp-avg-dtype fp8",
                 "--exp-avg-sq-dtype fp8"):
        assert flag in args
    assert "--use-precision-aware-optimizer" not in megatron_args(_plan(None))
    assert read_plan(write_plan_yaml(plan, tmp_path / "plan.yaml")) == plan
    assert "Adam moments in fp8 (precision-aware optimizer)" in describe_plan(plan)


def test_the_runtime_builds_transformer_engines_optimizer_or_says_what_it_needs():
    from dsauto.runtime.megatron import optimizer_config

    plan = _plan("bf16")
    if importlib.util.find_spec("transformer_engine") is None:  # as on the CPU test machines
        with pytest.raises(DsautoError, match="needs Transformer Engine"):
            optimizer_config(plan)
    else:
        import torch

        config = optimizer_config(plan)
        assert config.use_precision_aware_optimizer and config.exp_avg_dtype == torch.bfloat16


def test_a_plan_outside_what_megatron_core_runs_is_invalid():
    plan = _plan("bf16")
    with pytest.raises(ValueError, match="precision_aware_optimizer"):
        dataclasses.replace(plan, zero_stage=0)
    with pytest.raises(ValueError, match="precision_aware_optimizer"):
        dataclasses.replace(plan, precision_aware_optimizer="int4")


@pytest.mark.parametrize("extra, message", [
    (["--engine", "deepspeed"], "is Megatron-core's"),
    (["--zero-stage", "3"], "ZeRO stage 1, not stage 3"),
    (["--dtype", "fp16"], "under bf16, not fp16"),
    (["--offload", "optimizer"], "keeps them on the host"),
])
def test_the_command_line_refuses_it_where_megatron_core_does_not_run_it(capsys, extra, message):
    engine = [] if "--engine" in extra else ["--engine", "megatron"]
    code = main(["plan", "--model", "llama3-8b", "--hardware", "h100-80gb", "--global-batch", "64",
                 "--precision-aware-optimizer", "bf16", *engine, *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "--precision-aware-optimizer bf16 cannot run" in err
    assert err.count("\n") == 1  # one sentence, no traceback


def test_the_search_never_picks_it_unpinned():
    plan = make_plan("llama3-8b", "h100-80gb", nodes=1, global_batch=64, seq_len=4096, engine="megatron")
    assert plan.precision_aware_optimizer is None


@pytest.mark.parametrize("moments, fp8_recipe, extra_per_param", [
    (None, None, 4),  # Megatron-core's optimizer: an fp32 copy of each 16-bit gradient
    ("bf16", None, 0),  # FusedAdam takes the gradient shard as it is (decoupled_grad)
    ("fp32", None, 0),
    ("fp16", None, 8),  # fp32 copies of both moments for the parameter group
    ("fp8", None, 8),
    ("bf16", "tensorwise", 4),  # FP8 current scaling: Megatron-core's own fp32 main weights and copies
])
def test_the_update_copies_what_the_optimizer_makes(moments, fp8_recipe, extra_per_param):
    from dsauto.cost.step import optimizer_step_bytes
    from dsauto.cost.strategy import Strategy
    from dsauto.cost.terms import state_bytes_per_param
    from dsauto.parallel import ParallelDims

    strategy = Strategy(dims=ParallelDims(dp=2), zero_stage=1, micro_batch=1, grad_accum=1, sequence_parallel=False,
                        engine="megatron", precision_aware_optimizer=moments, fp8=fp8_recipe is not None,
                        fp8_recipe=fp8_recipe or "delayed")
    per_param = state_bytes_per_param("megatron", 2, True, 1, moments, fp8_recipe == "tensorwise")[1]
    main = 1000.0
    optim = per_param * main
    step = optimizer_step_bytes(strategy, 10.0, 20.0, optim, 0, False, 0.0, True, per_param)
    assert step == (10 + 20 + optim + extra_per_param * main if extra_per_param else 0.0)
