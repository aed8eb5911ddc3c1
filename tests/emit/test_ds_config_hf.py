"""ds_config.json in Hugging Face's convention (``dsauto tune --for hf``): "auto" where
TrainingArguments own the value, the plan's values where the plan decides, checked by DeepSpeed's
parser with the plan's values in place of "auto"."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dsauto.cli import main
from dsauto.emit.ds_config import AUTO, ds_config, resolve_auto, validate_ds_config
from dsauto.errors import DsautoError


@pytest.fixture
def hf_plan(zero3_plan):
    """The ZeRO-3 plan without its head's loss chunks, which a transformers model cannot take."""
    return replace(zero3_plan, layers=tuple(replace(run, split=1) for run in zero3_plan.layers))


def test_hf_config_keeps_the_plans_values(hf_plan):
    zero3_plan = hf_plan
    plain, hf = ds_config(zero3_plan), ds_config(zero3_plan, target="hf")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        assert hf[key] == AUTO
    assert {hf["optimizer"]["params"][k] for k in ("lr", "betas", "eps", "weight_decay")} == {AUTO}
    assert hf["optimizer"]["params"]["torch_adam"] is True and "scheduler" not in hf
    assert hf["bf16"] == plain["bf16"] == {"enabled": True} and hf["fp16"] == {"enabled": False}
    zero = dict(hf["zero_optimization"])
    assert zero.pop("stage3_gather_16bit_weights_on_model_save") is True  # whole weights at save_model
    assert zero == plain["zero_optimization"]  # stage, buckets, prefetch, persistence: the plan's
    assert hf["dsauto"] == plain["dsauto"]


def test_auto_values_validate_as_the_plans(hf_plan):
    zero3_plan = hf_plan
    hf = ds_config(zero3_plan, target="hf")
    resolved = resolve_auto(hf)
    assert resolved["train_micro_batch_size_per_gpu"] == zero3_plan.micro_batch
    assert resolved["train_batch_size"] == zero3_plan.global_batch
    assert resolved["optimizer"] == ds_config(zero3_plan)["optimizer"]
    validate_ds_config(hf, zero3_plan.dp)


def test_what_hf_cannot_run_is_not_written_for_it(zero3_plan, hf_plan):
    """A plan made for deepspeed.initialize may do what a transformers model under Hugging Face's
    Trainer cannot: run on Megatron-core, split operators (the fixture's head loss chunks), run
    DeepSpeed-Ulysses or recompute the attention core; each is refused in one sentence."""
    core_attn = replace(hf_plan, layers=tuple(replace(run, recompute_modules=("core_attn",)) if run.group == "decoder"
                                              and not run.checkpoint else run for run in hf_plan.layers))
    for plan, said in ((replace(hf_plan, engine="megatron"), "its engine megatron: Hugging Face's Trainer and "
                                                             "accelerate run DeepSpeed"),
                       (zero3_plan, "its operators split in up to 4 slices: dsauto's hook splits no operator"),
                       (replace(hf_plan, dp=1, cp=2, global_batch=hf_plan.global_batch // 2),
                        "its cp 2: a transformers decoder layer has no DistributedAttention"),
                       (core_attn, "its recomputation of core_attn: a transformers decoder layer has no attention "
                                   "core")):
        with pytest.raises(DsautoError, match=rf"Hugging Face's Trainer and accelerate cannot run this plan, {said}.*"
                                              rf"re-plan with --for hf \(hf_trainer=True\)\.$"):
            ds_config(plan, target="hf")


def test_tune_for_hf_writes_the_hf_convention(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["tune", "--model", "gpt-tiny", "--hardware", "cpu", "--nodes", "1", "--gpus-per-node", "2",
                 "--for", "hf", "--out", str(out)]) == 0
    config = json.loads((out / "ds_config.json").read_text())
    assert config["train_micro_batch_size_per_gpu"] == AUTO
    assert config["dsauto"]["engine"] == "deepspeed"  # --for hf plans for DeepSpeed
    assert main(["validate", str(out / "ds_config.json")]) == 0
    assert main(["tune", "--model", "gpt-tiny", "--hardware", "cpu", "--for", "trainer", "--out", str(out)]) == 2
