"""The DeepSpeed keys of a config against its own plan: stage, dtype, batch keys and degrees."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from dsauto.emit.ds_config import ds_config
from dsauto.engines.deepspeed import config_contradictions, config_dtype, unpriced_config_settings
from dsauto.errors import DsautoWarning
from dsauto.refine.space import options_of, strategy_of
from dsauto.runtime.deepspeed import check_config
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec


@pytest.fixture(scope="module")
def plan():
    planner = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(8, 64, "fp32"))
    return planner.search()[0]


def test_a_written_config_agrees_with_its_plan(plan):
    assert config_contradictions(ds_config(plan), plan) == []


@pytest.mark.parametrize("change, phrase", [
    (lambda c: c["zero_optimization"].update(stage=3), "zero_optimization.stage is 3 but the plan was made for ZeRO stage"),
    (lambda c: c["zero_optimization"].update(stage="x"), "zero_optimization.stage is 'x'"),
    (lambda c: c.update(zero_optimization=5), "zero_optimization.stage is 5"),
    (lambda c: c.update(bf16={"enabled": True}), "the config trains in bf16 (its bf16 / fp16 sections) but the plan in fp32"),
    (lambda c: c.update(bf16={"enabled": True}, fp16={"enabled": True}), "trains in both bf16 and fp16"),
    (lambda c: c.update(train_batch_size=16), "train_batch_size is 16 but the plan's global_batch is 8"),
    (lambda c: c.update(train_micro_batch_size_per_gpu=7), "train_micro_batch_size_per_gpu is 7"),
    (lambda c: c.update(gradient_accumulation_steps=99), "gradient_accumulation_steps is 99"),
    (lambda c: c.update(tensor_parallel={"autotp_size": 2}), "tensor_parallel.autotp_size is 2 but the plan's tp is 1"),
])
def test_each_contradiction_is_named(plan, change, phrase):
    config = copy.deepcopy(ds_config(plan))
    change(config)
    assert any(phrase in p for p in config_contradictions(config, plan)), config_contradictions(config, plan)


def test_hugging_face_auto_values_agree_with_anything(plan):
    config = copy.deepcopy(ds_config(plan))
    config.update(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", bf16={"enabled": "auto"})
    assert config_contradictions(config, plan) == []
    assert config_dtype(config) is None


def test_the_hook_leaves_the_batch_keys_to_the_engine(plan):
    config = copy.deepcopy(ds_config(plan))
    config.update(train_batch_size=16)
    assert config_contradictions(config, plan, batch=False) == []


@pytest.fixture(scope="module")
def zero1_plan():
    planner = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(8, 64, "bf16"))
    plan = planner.search()[0]
    return planner.build_plan(dataclasses.replace(strategy_of(plan), zero_stage=1, engine="deepspeed"),
                              plan.stage_layers, options_of(plan))


def test_a_written_config_has_no_unpriced_settings(zero1_plan):
    assert unpriced_config_settings(ds_config(zero1_plan), zero1_plan) == []


@pytest.mark.parametrize("change, phrase", [
    (lambda z, c: z.update(overlap_comm=False), "zero_optimization.overlap_comm is false"),
    (lambda z, c: z.pop("overlap_comm"), "missing, which DeepSpeed reads as false under ZeRO stage 1"),
    (lambda z, c: z.update(zero_quantized_weights=True), "ZeRO++'s qwZ"),
    (lambda z, c: z.update(zero_quantized_gradients=True), "ZeRO++'s qgZ"),
    (lambda z, c: z.update(use_multi_rank_bucket_allreduce=False), "reduced to its owner, one reduce a rank"),
    (lambda z, c: c.update(communication_data_type="fp32"), "reduced in 4 bytes an element where the plan's bf16"),
    (lambda z, c: z.update(reduce_bucket_size=1000), "zero_optimization.reduce_bucket_size is 1000, where the plan "
                                                     "is priced with"),
    (lambda z, c: z.update(allgather_bucket_size=z["allgather_bucket_size"] * 2), "allgather_bucket_size is"),
])
def test_each_unpriced_setting_is_named_and_the_hook_warns(zero1_plan, change, phrase):
    config = copy.deepcopy(ds_config(zero1_plan))
    change(config["zero_optimization"], config)
    found = unpriced_config_settings(config, zero1_plan)
    assert len(found) == 1 and phrase in found[0], found
    assert config_contradictions(config, zero1_plan) == []  # a warning, not a refusal
    with pytest.warns(DsautoWarning, match="the step will differ from the plan's") as caught:
        check_config(zero1_plan, config)
    assert phrase in str(caught[0].message) and "restore the values dsauto wrote" in str(caught[0].message)


def test_hugging_face_auto_overlap_is_not_named(zero1_plan):
    config = copy.deepcopy(ds_config(zero1_plan))
    config["zero_optimization"]["overlap_comm"] = "auto"
    assert unpriced_config_settings(config, zero1_plan) == []
