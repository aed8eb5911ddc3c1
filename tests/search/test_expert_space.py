"""Expert degrees in the search: dense models enumerate none, mixtures of experts enumerate ep
(dividing the experts) and etp (1 or tp) for Megatron-core, with Megatron's folding and
sequence-parallel rules, and DeepSpeed-MoE's ep only when pinned (it needs the model built from
DeepSpeed's MoE layers); pins that cannot hold are one sentence."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from dsauto.search.space import Constraints, explain_empty_space, strategies
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.hf import model_from_hf_config
from dsauto.spec.loaders import load_hardware, load_model
from dsauto.spec.training import TrainSpec

CONFIGS = Path(__file__).parents[1] / "spec" / "configs"


def hf(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)


def space(model, nodes=2, pins=None):
    pins = pins or Constraints()
    cluster = ClusterSpec(load_hardware("h100-80gb"), nodes=nodes, gpus_per_node=8)
    train = TrainSpec(global_batch=64, seq_len=4096, dtype="bf16")
    return strategies(model, cluster, train, pins), cluster, train


def test_dense_models_enumerate_no_expert_degrees():
    built, _, _ = space(load_model("llama3-8b"))
    assert built and all(s.dims.ep == s.dims.etp == 1 for s in built)


def test_moe_models_enumerate_ep_and_etp_for_megatron_only():
    built, _, _ = space(hf("mixtral-8x7b"))
    megatron = [s for s in built if s.engine == "megatron"]
    assert {s.dims.ep for s in megatron} == {1, 2, 4, 8}
    assert all(s.dims.etp in (1, s.tp) for s in megatron)
    assert all(s.dims.stage_ranks % (s.dims.ep * s.dims.etp) == 0 for s in megatron)
    assert all(s.sequence_parallel for s in megatron if s.tp > 1)  # Megatron's MoE under TP needs SP
    assert all(s.dims.ep == s.dims.etp == 1 for s in built if s.engine == "deepspeed")
    # Megatron-FSDP shards the experts over the expert data-parallel group; DeepSpeed-MoE refuses ZeRO-3
    assert any(s.dims.ep > 1 and s.zero_stage == 3 for s in megatron)
    assert not any(s.dims.ep > 1 and s.zero_stage == 3 for s in built if s.engine == "deepspeed")


def test_the_search_tries_recomputing_the_experts_activation_on_megatron_core():
    built, _, _ = space(hf("mixtral-8x7b"))
    megatron = {s.recompute_modules for s in built if s.engine == "megatron"}
    assert megatron == {(), ("moe_act",)}  # flash attention: nothing else is worth recomputing
    assert {s.recompute_modules for s in built if s.engine == "deepspeed"} == {()}
    dense, _, _ = space(load_model("llama3-8b"))
    assert {s.recompute_modules for s in dense} == {()}


def test_pins_reach_the_expert_degrees():
    built, _, _ = space(hf("mixtral-8x7b"), pins=Constraints(ep=4, etp=1))
    assert built and {(s.dims.ep, s.dims.etp, s.engine) for s in built} == {(4, 1, "megatron"), (4, 1, "deepspeed")}
    # DeepSpeed-MoE: no expert tensor parallelism, and its MoE layers refuse ZeRO-3
    assert not any(s.zero_stage == 3 for s in built if s.engine == "deepspeed")
    built, _, _ = space(hf("mixtral-8x7b"), pins=Constraints(ep=2, etp=2))
    assert built and {s.engine for s in built} == {"megatron"}


@pytest.mark.parametrize("name, pins, message", [
    ("llama3-8b", Constraints(ep=2), r"--ep 2 --etp 1 split experts, and .* is not a mixture of experts"),
    ("mixtral-8x7b", Constraints(ep=3), r"--ep 3 does not divide the 8 experts"),
    ("mixtral-8x7b", Constraints(ep=8, pp=4), r"--ep 8 x --etp 1 = 8 expert ranks do not divide the \d+ ranks of a "
                                               r"pipeline stage \(\d+ devices / pp 4\)"),
])
def test_impossible_expert_pins_are_one_sentence(name, pins, message):
    model = hf(name) if name.startswith("mixtral") else load_model(name)
    built, cluster, train = space(model, pins=pins)
    assert not built
    with pytest.raises(Exception, match=message):
        raise explain_empty_space(model, cluster, train, pins)
