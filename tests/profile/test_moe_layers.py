"""The profiler measures a mixture of experts' MoE layer (router, the tokens' dispatch to their
experts, the experts) as its own group beside the dense layer, and the cost model prices the
transformer stack with those measurements, averaged by the layers' shares."""

from __future__ import annotations

import pytest
import torch

from dsauto.cost.layer import CostModel
from dsauto.cost.measured import transformer_layer_estimate
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.profile.layers import layer_groups_of, profile_layers
from dsauto.profile.store import Profile
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import TrainSpec

MOE = ModelSpec(name="moe-tiny", architecture="decoder", num_layers=4, hidden_size=64, num_attention_heads=4,
                ffn_hidden_size=128, vocab_size=100, max_position_embeddings=32, mlp="swiglu", norm="rmsnorm",
                position_embedding="rope", linear_bias=False, dropout=False, tied_embeddings=False,
                num_experts=4, moe_top_k=2, moe_ffn_hidden_size=48, moe_first_dense_layers=1)
SEQ = 32


@pytest.fixture(scope="module")
def profile() -> Profile:
    layers = profile_layers(MOE, SEQ, (1, 2), (1,), torch.float32, torch.device("cpu"), warmup=1, repeats=1)
    return Profile(model=MOE, device="cpu", dtype="fp32", seq_len=SEQ, threads=1, versions={"torch": "2"},
                   layers=layers, optimizer_seconds_per_param=1e-9)


def test_the_moe_layer_is_measured_beside_the_dense_one(profile):
    assert {m.group for m in profile.layers} == {"embedding", "decoder", "decoder-moe", "head"}
    assert layer_groups_of(MOE, 2) == ("embedding", "block", "head")  # the MoE layer is built whole: tp 1
    dense, moe = (profile.measurement(g, 1, 2, False) for g in ("decoder", "decoder-moe"))
    # its parameters: attention, norms, router and 4 experts of width 48 (SwiGLU) against a 128-wide MLP
    assert moe.params_bytes - dense.params_bytes == 4 * (4 * 64 + 4 * 3 * 64 * 48 - 3 * 64 * 128)
    assert moe.activation_bytes > dense.activation_bytes  # top-2 copies of each token through 48-wide experts


def test_the_cost_model_averages_the_measured_layers(profile):
    block = layer_groups(MOE, SEQ, 4)[1]
    dense, moe = (profile.estimate(g, 1, 2, False) for g in ("decoder", "decoder-moe"))
    averaged = transformer_layer_estimate(profile, block, 1, 2, False)
    assert averaged.forward_seconds == pytest.approx(0.25 * dense.forward_seconds + 0.75 * moe.forward_seconds)
    assert averaged.activation_bytes == pytest.approx(0.25 * dense.activation_bytes + 0.75 * moe.activation_bytes)
    assert transformer_layer_estimate(profile, block, 2, 2, False) is None  # not measured at tp 2: analytic
    cost = CostModel(load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(global_batch=4, seq_len=SEQ, dtype="fp32"),
                     Strategy(dims=ParallelDims(dp=2, tp=1, pp=1, ep=2), zero_stage=1, micro_batch=2, grad_accum=1,
                              sequence_parallel=False), MOE.hidden_size, profile=profile)
    assert cost.layer(block, LayerOption(checkpoint=False, shard_params=False, split=1)).measured
