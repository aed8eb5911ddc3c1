"""Token dropping (Megatron-core's --moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity):
each expert takes at most the factor times its mean share of a rank's routed tokens, and filled to
capacity exactly that, so the busiest expert-parallel rank's load is priced as the lesser of the factor
and dropless routing's imbalance, or the factor itself; pinned, emitted, read back and refused in one
sentence."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from dsauto.api import make_plan
from dsauto.cost.layer import CostModel
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import EXPERT_LOAD_IMBALANCE, expert_load_factor
from dsauto.describe import describe_plan
from dsauto.emit.megatron import megatron_args
from dsauto.engines.megatron_args import parse_megatron_args
from dsauto.errors import DsautoError
from dsauto.parallel import ParallelDims
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import TrainSpec

MODEL = ModelSpec(name="moe-capacity", architecture="decoder", num_layers=4, hidden_size=256, num_attention_heads=4,
                  ffn_hidden_size=1024, vocab_size=4096, max_position_embeddings=256, dropout=False, mlp="swiglu",
                  norm="rmsnorm", linear_bias=False, position_embedding="rope", num_experts=8, moe_top_k=2,
                  moe_ffn_hidden_size=128)
TRAIN = TrainSpec(global_batch=16, seq_len=256, dtype="bf16", flash_attention=True)


def cost(ep: int = 2, factor: float | None = None, padded: bool = False, balanced: bool = False):
    dims = ParallelDims(dp=2, ep=ep)
    strategy = Strategy(dims=dims, zero_stage=1, micro_batch=2, grad_accum=4, sequence_parallel=False,
                        engine="megatron",
                        expert_capacity_factor=factor, expert_pad_to_capacity=padded, expert_load_balanced=balanced)
    model = CostModel(load_cluster("h100-80gb", nodes=1, gpus_per_node=2), TRAIN, strategy, MODEL.hidden_size)
    return model, model.layer(layer_groups(MODEL, TRAIN.seq_len, 2)[1], LayerOption(False, False, 1))


@pytest.mark.parametrize("ep, factor, padded, balanced, load", [
    (2, None, False, False, EXPERT_LOAD_IMBALANCE),  # dropless
    (2, 1.0, False, False, 1.0),  # an expert drops what exceeds its mean share
    (2, 1.25, False, False, EXPERT_LOAD_IMBALANCE),  # a capacity above the busiest rank's load drops nothing
    (2, 1.25, True, False, 1.25),  # filled to capacity: every rank takes the factor
    (2, 1.25, False, True, 1.0),  # forced balance stays balanced
    (1, 1.5, True, False, 1.5),  # one expert rank runs every expert filled to capacity
    (1, 0.5, False, False, 0.5),  # and without padding at most the capacity of each expert
])
def test_the_busiest_ranks_load_under_a_capacity(ep, factor, padded, balanced, load):
    model, _ = cost(ep, factor, padded, balanced)
    assert expert_load_factor(model.context) == pytest.approx(load)


def test_the_experts_gemms_activations_and_exchange_follow_the_load():
    _, dropless = cost()
    _, capped = cost(factor=1.0)
    _, filled = cost(factor=1.5, padded=True)
    assert capped.forward_seconds < dropless.forward_seconds < filled.forward_seconds
    assert capped.activation_bytes < dropless.activation_bytes < filled.activation_bytes


def test_pinned_capacity_is_emitted_read_back_and_said():
    pins = dict(nodes=1, gpus_per_node=8, engine="megatron", tp=1, pp=1, zero_stage=1, ep=4, global_batch=16,
                seq_len=256)
    dropless = make_plan(MODEL, "h100-80gb", **pins)
    filled = make_plan(MODEL, "h100-80gb", **pins, expert_capacity_factor=1.5, expert_pad_to_capacity=True)
    assert filled.prediction.step_seconds > dropless.prediction.step_seconds
    flags = megatron_args(filled)
    assert "--moe-expert-capacity-factor 1.5" in flags and "--moe-pad-expert-input-to-capacity" in flags
    assert not any("capacity" in line for line in megatron_args(dropless) if not line.startswith("#"))
    read = parse_megatron_args(shlex.split(" ".join(line for line in flags if not line.startswith("#"))),
                               "train.sh", MODEL)
    assert (read.pins["expert_capacity_factor"], read.pins["expert_pad_to_capacity"]) == (1.5, True)
    assert "capacity 1.5x an expert's mean tokens, each filled to it" in describe_plan(filled)


def test_capacities_that_cannot_run_are_refused_in_one_sentence():
    with pytest.raises(DsautoError, match="no --moe-expert-capacity-factor sets one"):
        make_plan(MODEL, "h100-80gb", gpus_per_node=8, engine="megatron", expert_pad_to_capacity=True)
    with pytest.raises(DsautoError, match="the model has no experts"):
        make_plan(dataclasses.replace(MODEL, num_experts=0, moe_top_k=0, moe_ffn_hidden_size=0), "h100-80gb",
                  gpus_per_node=8, engine="megatron", expert_capacity_factor=1.0)
    with pytest.raises(DsautoError, match="under DeepEP's dispatcher; leave it out, or dispatch with alltoall"):
        make_plan(MODEL, "h100-80gb", gpus_per_node=8, engine="megatron", ep=4, expert_capacity_factor=1.0,
                  expert_pad_to_capacity=True, expert_dispatcher="deepep")
    with pytest.raises(DsautoError, match=r"past all of a rank's tokens \(a factor over experts / top-k = 4\)"):
        make_plan(MODEL, "h100-80gb", gpus_per_node=8, engine="megatron", ep=4, expert_capacity_factor=5.0,
                  expert_pad_to_capacity=True)
    launch = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
              "--micro-batch-size 1 --global-batch-size 8 --vocab-size 4096 ")
    with pytest.raises(DsautoError, match="without a positive --moe-expert-capacity-factor, which Megatron-core "
                                          "refuses"):
        parse_megatron_args(shlex.split(launch + "--num-experts 8 --moe-pad-expert-input-to-capacity"), "train.sh")
    # a dense model's launch ignores the experts' options, as Megatron-core does
    dense = parse_megatron_args(shlex.split(launch + "--moe-expert-capacity-factor 1.0"), "train.sh")
    assert "expert_capacity_factor" not in dense.pins
    with pytest.raises(DsautoError, match="--moe-expert-capacity-factor 0, which drops every token"):
        parse_megatron_args(shlex.split("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
                                        "--max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 8 "
                                        "--vocab-size 4096 "
                                        "--num-experts 8 --moe-expert-capacity-factor 0"), "train.sh")
