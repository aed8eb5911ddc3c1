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
