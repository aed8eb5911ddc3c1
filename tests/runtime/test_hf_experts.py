"""A plan of a mixture of experts handed a ``transformers`` model: refused where its pricing is not
how transformers runs the experts (Llama 4's every expert on every token; ZeRO-3 gathering a sparse
block whole, which only a plan for Hugging Face's Trainer prices), accepted where it is."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

from dsauto.api import make_plan
from dsauto.errors import DsautoError
from dsauto.runtime.deepspeed import _check_transformers_experts
from dsauto.runtime.layers import find_layers

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from hf_configs import CONFIGS  # tests/ is on sys.path through its conftest

SMALL = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 1024, "pad_token_id": None}


def plan_and_layers(name: str, extra: dict, **pins):
    data = {**json.loads((CONFIGS / f"{name}.json").read_text()), **SMALL, **extra}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(data, "h100-80gb", gpus_per_node=8, global_batch=8, seq_len=256, engine="deepspeed",
                         **pins)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**data))
    return plan, find_layers(model)


def test_llama4s_dense_experts_are_refused():
    plan, layers = plan_and_layers("llama-4-maverick-text", {"intermediate_size_mlp": 512, "num_local_experts": 4,
                                                             "attention_chunk_size": 128})
    with pytest.raises(DsautoError, match=r"computes each of its 4 experts on every token, and the plan prices "
                                          r"top-1 routing"):
        _check_transformers_experts(plan, layers)


def test_zero3_sharded_experts_need_a_plan_that_gathers_them_whole():
    extra = {"moe_intermediate_size": 128, "shared_expert_intermediate_size": 256, "num_experts": 4}
    plan, layers = plan_and_layers("qwen1.5-moe-a2.7b", extra, zero_stage=3)
    sharded = dataclasses.replace(plan, layers=tuple(dataclasses.replace(run, shard_params=True)
                                                     for run in plan.layers))
    with pytest.raises(DsautoError, match="gathered whole .*; re-plan with --for hf"):
        _check_transformers_experts(sharded, layers)
    trainer, _ = plan_and_layers("qwen1.5-moe-a2.7b", extra, zero_stage=3, hf_trainer=True)
    _check_transformers_experts(dataclasses.replace(sharded, experts_gathered_whole=True), layers)
    assert trainer.experts_gathered_whole
