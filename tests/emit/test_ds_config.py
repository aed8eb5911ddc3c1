"""The DeepSpeed config: DeepSpeed's own parser accepts it on dp ranks, and the plan rides along."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from dsauto.emit.ds_config import ds_config, validate_ds_config, write_ds_config
from dsauto.errors import DsautoError, DsautoWarning
from dsauto.plan import Plan
from dsauto.plan_io import read_plan


def test_deepspeed_accepts_every_emitted_config(plan):
    validate_ds_config(ds_config(plan), plan.dp)


def test_batch_keys_satisfy_the_batch_equation(plan):
    config = ds_config(plan)
    assert config["train_micro_batch_size_per_gpu"] == plan.micro_batch
    assert config["gradient_accumulation_steps"] == plan.grad_accum
    assert config["train_batch_size"] == plan.micro_batch * plan.grad_accum * plan.dp


def test_deepspeed_checks_the_batch_against_dp_ranks(zero3_plan):
    config = ds_config(zero3_plan)
    off_by_one = dict(config, train_batch_size=config["train_batch_size"] + 1)
    with pytest.raises(DsautoError, match=r"17 != 2 \* 4 \* 2"):
        validate_ds_config(off_by_one, zero3_plan.dp)
    # The same config read as if on one rank fails the equation: DeepSpeed really multiplies by dp.
    with pytest.raises(DsautoError, match=r"16 != 2 \* 4 \* 1"):
        validate_ds_config(config, 1)


def test_deepspeed_rejects_unknown_section_keys(zero3_plan):
    config = copy.deepcopy(ds_config(zero3_plan))
    config["zero_optimization"]["stage3_prefetch_bucket_bytes"] = 1
    with pytest.raises(DsautoError) as info:
        validate_ds_config(config, zero3_plan.dp)
    message = str(info.value)
    assert "stage3_prefetch_bucket_bytes" in message and "\n" not in message
    assert message.startswith("DeepSpeed rejects the config") and message.endswith(".")


def test_a_top_level_key_deepspeed_never_reads_is_named(zero3_plan):
    """DeepSpeed's parser leaves unknown top-level keys unused without a word (a misspelt
    gradient_clipping turns clipping off); the validation names them, and only them."""
    import warnings

    config = copy.deepcopy(ds_config(zero3_plan))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DsautoWarning)
        validate_ds_config(config, zero3_plan.dp)  # dsauto's own keys and every emitted one are read
    config["gradient_clip"] = config.pop("gradient_clipping", 1.0)
    with pytest.warns(DsautoWarning, match=r"reads no top-level key 'gradient_clip', which it leaves unused: check "
                                           r"its spelling\."):
        validate_ds_config(config, zero3_plan.dp)


def test_what_dsauto_writes_raises_no_warning_of_its_own(zero3_plan):
    """DeepSpeed reads sequence_parallel_size where no mpu is given (Hugging Face's zero.Init), so a
    Ulysses config is not told to check its spelling; and a ZeRO-3 plan whose layers all stay
    resident prefetches nothing, its stage3_max_live_parameters the 1 DeepSpeed takes at least, which
    the unpriced-settings check reads as the plan's own."""
    import warnings

    from dsauto.engines.deepspeed import unpriced_config_settings

    ulysses = replace(zero3_plan, dp=1, cp=2, global_batch=zero3_plan.global_batch // 2)
    resident = replace(zero3_plan, prefetch_bucket_bytes=0,
                       layers=tuple(replace(run, shard_params=False) for run in zero3_plan.layers))
    for plan in (ulysses, resident):
        config = ds_config(plan)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DsautoWarning)
            validate_ds_config(config, plan.dp)
        assert unpriced_config_settings(config, plan) == []
    assert ds_config(ulysses)["sequence_parallel_size"] == 2
    assert ds_config(resident)["zero_optimization"]["stage3_max_live_parameters"] == 1


@pytest.mark.parametrize("edit, said", [
    (lambda c: c["optimizer"]["params"].update(weight_deacy=0.1),
     r"optimizer\.params 'weight_deacy' is no parameter of AdamW, which DeepSpeed builds for optimizer 'AdamW'"),
    (lambda c: c["optimizer"].update(type="AdamWW"), r"optimizer\.type 'AdamWW' is none of DeepSpeed's optimizers"),
    (lambda c: c["optimizer"]["params"].update(torch_adam=False, fused=None),
     r"'fused' is no parameter of FusedAdam"),  # torch's argument, where DeepSpeed builds its own Adam
    (lambda c: c.update(scheduler={"type": "WarmupLR", "params": {"warmup_num_step": 10}}),
     r"scheduler\.params 'warmup_num_step' is no parameter of WarmupLR, .* warmup_num_steps"),
    (lambda c: c.update(scheduler={"type": "WarmupLinear", "params": {}}), r"scheduler\.type 'WarmupLinear' is none of"),
    (lambda c: c["optimizer"]["params"].update(max_grad_norm=1.0),
     r"optimizer\.params max_grad_norm is refused by deepspeed\.initialize, which clips gradients by the top-level "
     r"gradient_clipping"),
])
def test_what_deepspeed_parses_but_cannot_build_is_refused(zero3_plan, edit, said):
    """DeepSpeed's parser does not look inside the optimizer and scheduler sections; deepspeed.initialize
    then fails on a type it has no class for or a parameter the class does not take. validate says so
    before the run; what dsauto writes, and torch's own optimizers and schedulers, pass."""
    config = copy.deepcopy(ds_config(zero3_plan))
    edit(config)
    with pytest.raises(DsautoError, match=said):
        validate_ds_config(config, zero3_plan.dp)
    config = copy.deepcopy(ds_config(zero3_plan))
    # Adam without adam_w_mode is torch's Adam, whose own parameters pass
    config["optimizer"] = {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False,
                                                      "decoupled_weight_decay": False, "lr": 1e-3}}
    validate_ds_config(config, zero3_plan.dp)
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    config["scheduler"] = {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}
    validate_ds_config(config, zero3_plan.dp)


def test_validation_leaves_deepspeed_unpatched(zero3_plan):
    validate_ds_config(ds_config(zero3_plan), zero3_plan.dp)
    import deepspeed.comm
    import deepspeed.runtime.config

    assert deepspeed.runtime.config.dist is deepspeed.comm


def test_pipeline_with_zero2_is_refused(make_plan, layer_runs, pipeline_plan):
    model = pipeline_plan.model
    plan = make_plan(model, dp=2, tp=1, pp=2, zero_stage=2, stage_layers=(3, 3),
                     layers=layer_runs(model, (3, 3), resident=range(model.num_layers + 2)))
    with pytest.raises(DsautoError, match=r"pipeline engine refuses ZeRO stage 2 .*\(pp=2\)"):
        validate_ds_config(ds_config(plan), plan.dp)


def test_precision_blocks(zero3_plan, pipeline_plan):
    assert ds_config(zero3_plan)["bf16"] == {"enabled": True} and "fp16" not in ds_config(zero3_plan)
    fp16 = ds_config(pipeline_plan)["fp16"]
    assert fp16["enabled"] is True and fp16["loss_scale"] == 0  # dynamic loss scaling
    fp32 = ds_config(replace(zero3_plan, dtype="fp32"))
    assert "bf16" not in fp32 and "fp16" not in fp32


def test_zero3_section_counts_elements(zero3_plan):
    zero = ds_config(zero3_plan)["zero_optimization"]
    assert zero["stage"] == 3 and zero["overlap_comm"] and zero["contiguous_gradients"]
    # bf16: two bytes per element.
    assert zero["reduce_bucket_size"] == zero3_plan.reduce_bucket_bytes // 2
    assert zero["stage3_prefetch_bucket_size"] == zero3_plan.prefetch_bucket_bytes // 2
    assert {"stage3_param_persistence_threshold", "stage3_max_live_parameters"} <= set(zero)
    assert "allgather_bucket_size" not in zero
    assert zero["sub_group_size"] == 10**9  # the update's sub-groups, written out as priced


def test_zero1_section_and_pipeline_section(pipeline_plan):
    config = ds_config(pipeline_plan)
    zero = config["zero_optimization"]
    assert zero["stage"] == 1
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == pipeline_plan.reduce_bucket_bytes // 2
    assert not any(key.startswith("stage3_") for key in zero)
    # DeepSpeed's uniform interval checkpointing stays off: the hook checkpoints the chosen layers.
    assert config["pipeline"] == {"activation_checkpoint_interval": 0}


def test_zero0_section_is_the_stage_alone(zero3_plan):
    plan = replace(zero3_plan, zero_stage=0,
                   layers=tuple(replace(run, shard_params=False) for run in zero3_plan.layers))
    config = ds_config(plan)
    assert config["zero_optimization"] == {"stage": 0}
    validate_ds_config(config, plan.dp)


def test_optimizer_is_torch_adamw(plan):
    optimizer = ds_config(plan)["optimizer"]
    assert optimizer["type"] == "AdamW" and optimizer["params"]["torch_adam"] is True


def test_fixed_keys(plan):
    config = ds_config(plan)
    assert config["gradient_clipping"] == 1.0
    assert config["wall_clock_breakdown"] is False
    assert config["steps_per_print"] > 0


def test_plan_block_round_trips(plan, tmp_path):
    config = ds_config(plan)
    assert Plan.from_dict(config["dsauto"]) == plan
    path = write_ds_config(plan, tmp_path / "ds_config.json")
    assert json.loads(path.read_text()) == config
    assert read_plan(path) == plan


def test_unknown_dtype_is_a_user_error(zero3_plan):
    with pytest.raises(DsautoError, match="'float16' is not one of bf16, fp16, fp32"):
        ds_config(replace(zero3_plan, dtype="float16"))
