"""DeepSpeed-MoE plans: the config names each MoE layer's ``deepspeed.moe.layer.MoE`` settings, the
hook refuses MoE layers that disagree with the plan, and the step harness trains a plan with ep=2
(DeepSpeed-MoE, all-to-all over gloo) and one with ep=1 (the reference's own MoE layers) on 2 CPU
ranks, within the predicted memory."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.emit.ds_config import ds_config, validate_ds_config
from dsauto.engines.deepspeed import MOE_KEY
from dsauto.errors import DsautoError
from dsauto.models import build_model
from dsauto.parallel import ParallelDims
from dsauto.plan import Plan
from dsauto.profile.launch import free_port
from dsauto.runtime.deepspeed import check_moe_layers
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec
from guarded_run import guarded_run  # tests/ is on sys.path through its conftest

MOE = ModelSpec(name="moe-tiny", architecture="decoder", num_layers=3, hidden_size=64, num_attention_heads=4,
                ffn_hidden_size=128, vocab_size=100, max_position_embeddings=64, mlp="swiglu", norm="rmsnorm",
                position_embedding="rope", linear_bias=False, dropout=False, tied_embeddings=False,
                num_experts=4, moe_top_k=2, moe_ffn_hidden_size=48, shared_expert_ffn_hidden_size=32,
                moe_first_dense_layers=1)


def make_plan(ep: int, zero_stage: int) -> Plan:
    planner = Planner(MOE, load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(global_batch=4, seq_len=32, dtype="fp32"))
    strategy = Strategy(dims=ParallelDims(dp=2, tp=1, pp=1, ep=ep), zero_stage=zero_stage, micro_batch=2,
                        grad_accum=1, sequence_parallel=False)
    return planner.build_plan(strategy, [MOE.num_layers], [LayerOption(checkpoint=False, shard_params=False, split=1)] * 5)


def test_config_names_the_deepspeed_moe_layers():
    config = ds_config(make_plan(ep=2, zero_stage=1))
    validate_ds_config(config, dp=2)  # DeepSpeed's own parser takes the key beside the plan
    assert config[MOE_KEY]["layers"] == [
        {"layer": 2, "ep_size": 2, "num_experts": 4, "k": 2, "capacity_factor": 1.0},
        {"layer": 3, "ep_size": 2, "num_experts": 4, "k": 2, "capacity_factor": 1.0}]



def test_the_hf_convention_carries_no_deepspeed_moe_block():
    # A transformers model's experts are its own modules: nothing under the Trainer reads the block.
    config = ds_config(make_plan(ep=1, zero_stage=1), target="hf")
    assert MOE_KEY not in config and MOE_KEY in ds_config(make_plan(ep=1, zero_stage=1))


def test_hook_refuses_moe_layers_that_disagree_with_the_plan():
    plan = make_plan(ep=2, zero_stage=1)
    with pytest.raises(DsautoError, match=r"layer 0 has ep_size=1 but the plan's expert-parallel degree is ep=2"):
        check_moe_layers(plan, build_model(MOE, deepspeed_ep=1))
    with pytest.raises(DsautoError, match=r"ep=2 ranks, but the model has no deepspeed.moe.layer.MoE layers"):
        check_moe_layers(plan, build_model(MOE))
    wider = dataclasses.replace(MOE, num_experts=8)
    with pytest.raises(DsautoError, match=r"layer 0 has 8 experts but the plan's model has 4"):
        check_moe_layers(make_plan(ep=1, zero_stage=1), build_model(wider, deepspeed_ep=1))
    check_moe_layers(make_plan(ep=1, zero_stage=1), build_model(MOE))  # every expert local: nothing to check


def test_moe_plans_train_on_two_ranks(tmp_path):
    plans = [make_plan(ep=2, zero_stage=0), make_plan(ep=1, zero_stage=2)]
    plans_file, out = tmp_path / "plans.json", tmp_path / "measured.json"
    plans_file.write_text(json.dumps([p.to_dict() for p in plans]))
    port = free_port()
    result = guarded_run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
         "-m", "dsauto.profile.steps", "--plans", str(plans_file), "--out", str(out), "--steps", "2", "--warmup", "1"],
        {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, port)
    assert result.returncode == 0 and out.exists(), result.stdout[-4000:] + result.stderr[-4000:]
    measured = json.loads(out.read_text())
    assert len(measured) == 2 and all(math.isfinite(loss) for m in measured for loss in m["losses"])
    # Tensor bytes are deterministic: with ep=2 each rank holds (and its Adam updates) half the
    # experts, as priced; measured 2.9 MiB against 2.7 predicted, and 35.0 against 34.6 for ZeRO-2
    # (its two 16 MiB gradient buckets).
    for plan, m in zip(plans, measured):
        predicted = plan.prediction.peak_memory_bytes
        assert abs(predicted - m["peak_bytes"]) / m["peak_bytes"] < 0.10, (plan.ep, predicted, m)



def test_a_model_nothing_describes_holds_its_ranks_share_of_the_experts():
    """Without a spec or config the hook checks the blocks' parameters; a rank's DeepSpeed-MoE
    layers hold 1/ep of the routed experts, as the plan with ep=2 asks the model to be built."""
    from dsauto.runtime.layers import check_plan_matches, find_layers

    model = build_model(MOE, deepspeed_ep=2)
    vars(model).pop("spec", None)  # a model of the user's own, described by nothing
    assert getattr(model, "spec", None) is None
    check_plan_matches(make_plan(ep=2, zero_stage=1), find_layers(model))
    with pytest.raises(DsautoError, match=r"transformer blocks hold [\d,]+ parameters but the plan was made for"):
        check_plan_matches(make_plan(ep=1, zero_stage=1), find_layers(model))
