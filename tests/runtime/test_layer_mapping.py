"""Mapping a plan's flat layers onto a model, and refusing plans that do not match it, before any
engine exists."""

from __future__ import annotations

import dataclasses

import deepspeed
import pytest
from torch import nn

import dsauto.deepspeed
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.emit.ds_config import ds_config
from dsauto.errors import DsautoError
from dsauto.models import build_model
from dsauto.parallel import ParallelDims
from dsauto.plan import LayerChoice
from dsauto.runtime.layers import check_plan_matches, find_layers
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec

SHARD = LayerOption(checkpoint=False, shard_params=True, split=1)


@pytest.fixture
def spec():
    return load_model("gpt-tiny")


@pytest.fixture
def plan(spec):
    planner = Planner(spec, load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(4, 64, "fp32"))
    strategy = Strategy(dims=ParallelDims(dp=2, tp=1, pp=1), zero_stage=3, micro_batch=2, grad_accum=1, sequence_parallel=False)
    return planner.build_plan(strategy, [4], [SHARD] * 6)


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if the hook reaches deepspeed.initialize: every refusal below must come first."""
    def reached(**kwargs):
        raise AssertionError("deepspeed.initialize was called")
    monkeypatch.setattr(deepspeed, "initialize", reached)


def test_reference_model_layers(spec):
    model = build_model(spec)
    layers = find_layers(model)
    assert layers.blocks is model.layers and layers.head is model.head and layers.num_layers == 4
    by_layer = layers.parameters_by_layer()
    assert len(by_layer) == 6
    # The tied LM head weight is the embedding's (layer 0), as the cost model counts it.
    assert any(p is model.head.lm_head.weight for p in by_layer[0])
    assert not any(p is model.head.lm_head.weight for p in by_layer[5])
    assert sum(p.numel() for ps in by_layer for p in ps) == sum(p.numel() for p in model.parameters())


class OtherNames(nn.Module):
    """A model with its own attribute names: the hook finds the blocks and the embedding itself."""

    def __init__(self, blocks: int):
        super().__init__()
        self.wte = nn.Embedding(100, 8)
        self.h = nn.ModuleList(nn.Linear(8, 8) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(8)


def test_other_names_are_detected():
    model = OtherNames(3)
    layers = find_layers(model)
    assert layers.blocks is model.h and layers.blocks_name == "h"
    by_layer = layers.parameters_by_layer()
    assert by_layer[0] == [model.wte.weight] and by_layer[4] == list(model.ln_f.parameters())


def test_wrong_layer_count_is_refused_before_the_engine(spec, plan, no_engine):
    model = build_model(dataclasses.replace(spec, num_layers=3))
    message = r"for 4 transformer layers \(gpt-tiny\) but the model's layers holds 3 blocks"
    with pytest.raises(DsautoError, match=message):
        dsauto.deepspeed.initialize(model=model, config=ds_config(plan))


def test_wrong_shape_is_refused(spec, plan, no_engine):
    model = build_model(dataclasses.replace(spec, hidden_size=256))
    with pytest.raises(DsautoError, match="hidden_size is 256 but the plan was made for 128"):
        dsauto.deepspeed.initialize(model=model, config=ds_config(plan))


class Unspecified(nn.Module):
    """gpt-tiny's layout without a spec: an embedding, four blocks and a head of width ``hidden``."""

    def __init__(self, hidden: int, spec):
        super().__init__()
        self.embedding = nn.Embedding(spec.vocab_size, hidden)
        self.layers = nn.ModuleList(build_model(dataclasses.replace(spec, hidden_size=hidden,
                                                                    ffn_hidden_size=4 * hidden)).layers)
        self.head = nn.Linear(hidden, spec.vocab_size)


def test_a_model_nothing_describes_must_hold_the_plans_block_parameters(spec, plan):
    """A model with no spec and no config is checked by its blocks' parameters: gpt-tiny's blocks
    built apart match its plan; the same blocks eight times as wide (the plan's memory and time
    mean nothing for them) are refused with both counts."""
    check_plan_matches(plan, find_layers(Unspecified(spec.hidden_size, spec)))
    with pytest.raises(DsautoError, match=r"The model's 4 transformer blocks hold [\d,]+ parameters but the plan was "
                                          r"made for [\d,]+ \(gpt-tiny\), so its memory and time are not this model's"):
        check_plan_matches(plan, find_layers(Unspecified(8 * spec.hidden_size, spec)))


def test_unknown_layer_names_are_refused(spec, plan, no_engine):
    runs = list(plan.layers)
    runs[1] = dataclasses.replace(runs[1], group="moe")
    with pytest.raises(DsautoError, match="names layers 1..4 'moe', but layer 1 of this model is its 'decoder'"):
        dsauto.deepspeed.initialize(model=build_model(spec),
                                    config=ds_config(dataclasses.replace(plan, layers=tuple(runs))))


def test_model_without_embedding_is_refused(plan, no_engine):
    class NoEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    with pytest.raises(DsautoError, match="no 'embedding' module and no nn.Embedding"):
        check_plan_matches(plan, find_layers(NoEmbedding()))
    with pytest.raises(DsautoError, match="no nn.ModuleList of identical blocks"):
        find_layers(nn.Sequential(nn.Linear(2, 2)))


def test_config_contradicting_the_plan_is_refused(spec, plan, no_engine):
    config = ds_config(plan)
    config["zero_optimization"]["stage"] = 2
    with pytest.raises(DsautoError, match="zero_optimization.stage is 2 but .* ZeRO stage 3"):
        dsauto.deepspeed.initialize(model=build_model(spec), config=config)


def test_tensor_parallel_plan_is_refused(spec, no_engine):
    planner = Planner(spec, load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(4, 64, "fp32"))
    strategy = Strategy(dims=ParallelDims(dp=1, tp=2, pp=1), zero_stage=0, micro_batch=2, grad_accum=2, sequence_parallel=False)
    plan = planner.build_plan(strategy, [4], [LayerOption(False, False, 1)] * 6)
    with pytest.raises(DsautoError, match="this plan has tp=2; run it with the Megatron-core plugin"):
        dsauto.deepspeed.initialize(model=build_model(spec), config=ds_config(plan))


def test_pipeline_plan_needs_the_pipeline_module_cut_for_it(spec, no_engine):
    planner = Planner(spec, load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(4, 64, "fp32"))
    strategy = Strategy(dims=ParallelDims(dp=1, tp=1, pp=2), zero_stage=0, micro_batch=2, grad_accum=2,
                        sequence_parallel=False)
    plan = planner.build_plan(strategy, [3, 1], [LayerOption(False, False, 1)] * 6)
    with pytest.raises(DsautoError, match=r"2 pipeline stages of \[3, 1\].*dsauto.deepspeed.pipeline_module"):
        dsauto.deepspeed.initialize(model=build_model(spec), config=ds_config(plan))


def test_plan_runs_must_name_layers_in_place(plan):
    # A head run labelled as the embedding is caught even when the counts match.
    runs = list(plan.layers)
    runs[-1] = LayerChoice(5, 5, "embedding", 0, False, True, 1)
    with pytest.raises(DsautoError, match="layer 5 of this model is its 'head'"):
        check_plan_matches(dataclasses.replace(plan, layers=tuple(runs)),
                           find_layers(build_model(load_model("gpt-tiny"))))


def test_unchunkable_head_is_refused_before_anything_is_split(spec, no_engine):
    planner = Planner(spec, load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(4, 64, "fp32"))
    strategy = Strategy(dims=ParallelDims(dp=2, tp=1, pp=1), zero_stage=3, micro_batch=2, grad_accum=1, sequence_parallel=False)
    split = LayerOption(checkpoint=False, shard_params=True, split=2)
    plan = planner.build_plan(strategy, [4], [SHARD, split, split, split, split, split])
    model = build_model(spec)
    model.head = nn.Linear(128, 1024)  # a head without hidden() / lm_head
    with pytest.raises(DsautoError, match="Linear has no hidden"):
        dsauto.deepspeed.initialize(model=model, config=ds_config(plan))
    assert type(model.layers[0].mlp_in) is nn.Linear  # the blocks were left as they were
