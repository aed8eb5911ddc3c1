"""What Megatron-core's MLP activations keep, as the cost model prices it
(dsauto.spec.model.megatron_activation_widths): Megatron-LM and dsauto's plugin fuse SwiGLU alone
(bias_activation_fusion), and MLP.forward's unfused ``glu`` keeps the activation's output and the linear
half plus ``glu_linear_offset`` besides the first matrix's output and the product. Measured on two CPU
ranks: benchmarks/megatron_memory.py, the geglu plans."""

from __future__ import annotations

import dataclasses

import pytest

from dsauto.cost.layer import CostModel
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import TrainSpec

H, F, FS = 256, 1024, 256
DENSE = ModelSpec(name="glu-bench", architecture="decoder", num_layers=4, hidden_size=H, num_attention_heads=4,
                  ffn_hidden_size=F, vocab_size=4096, max_position_embeddings=256, dropout=False, norm="rmsnorm",
                  linear_bias=False, position_embedding="rope")
TRAIN = TrainSpec(global_batch=16, seq_len=256, dtype="bf16", flash_attention=True)
TOKENS = 2 * 256


def layer(model: ModelSpec, engine: str, modules: tuple[str, ...] = (), tp: int = 1):
    """A transformer layer of ``model`` on a bf16 plan of ``engine`` (micro-batch 2 x 256)."""
    dims = ParallelDims(dp=2, tp=tp)
    strategy = Strategy(dims=dims, zero_stage=1, micro_batch=2, grad_accum=4, sequence_parallel=False,
                        engine=engine, recompute_modules=modules)
    cost = CostModel(load_cluster("h100-80gb", nodes=1, gpus_per_node=dims.world_size), TRAIN, strategy, H)
    group = layer_groups(model, TRAIN.seq_len, TRAIN.dtype_bytes, tp)[1]
    return cost.layer(group, LayerOption(False, False, 1, recompute_modules=modules))


@pytest.mark.parametrize("mlp, extra_widths", [("swiglu", 0), ("geglu", 2), ("gelu", 0), ("relu2", 0), ("relu", -1)])
def test_megatron_core_mlp_activations_keep_what_they_run_with(mlp, extra_widths):
    """A gated GeLU keeps two widths more, unfused; a ReLU keeps its output alone (torch's relu backward
    reads its result), one width fewer than the input and output the count gives a non-gated activation."""
    model = dataclasses.replace(DENSE, mlp=mlp)
    for tp in (1, 2):  # split like the MLP's other activations
        # DeepSpeed's count is Hugging Face's modeling code's: its RMSNorms in fp32, a gated MLP's
        # activation output kept (LayerGroup.unfused_extra_bytes_per_token).
        group = layer_groups(model, TRAIN.seq_len, TRAIN.dtype_bytes, tp)[1]
        unfused = TOKENS * (group.unfused_extra_bytes_per_token + group.unfused_extra_tp_bytes_per_token / tp)
        assert (layer(model, "megatron", tp=tp).activation_bytes - layer(model, "deepspeed", tp=tp).activation_bytes
                == pytest.approx(TOKENS * extra_widths * F * 2 / tp - unfused))


def test_recomputing_the_mlp_frees_what_the_unfused_unit_keeps():
    model = dataclasses.replace(DENSE, mlp="geglu")
    kept, recomputed = layer(model, "megatron"), layer(model, "megatron", ("mlp",))
    assert kept.activation_bytes - recomputed.activation_bytes == pytest.approx(TOKENS * 5 * F * 2)


def test_the_shared_experts_unfused_unit_is_priced_and_freed_alike():
    moe = dataclasses.replace(DENSE, mlp="geglu", num_experts=4, moe_top_k=2, moe_ffn_hidden_size=128,
                              shared_expert_ffn_hidden_size=FS)
    group = layer_groups(moe, TRAIN.seq_len, TRAIN.dtype_bytes)[1]
    assert group.megatron_shared_expert_extra_bytes_per_token == 2 * FS * 2
    kept, shared = layer(moe, "megatron"), layer(moe, "megatron", ("shared_experts",))
    assert kept.activation_bytes - shared.activation_bytes == pytest.approx(TOKENS * 5 * FS * 2)


# Peaks of live tensor bytes measured by benchmarks/megatron_memory.py (Megatron-core 0.16.1, bf16,
# two CPU ranks, the alltoall dispatcher; benchmarks/results/megatron_memory.md), largest rank.
MEASURED = {
    "dp2 ep2 zero1 no-recompute": 115_926_602,
    "dp2 ep2 zero1 recompute-moe": 99_296_320,
    "dp2 ep2 zero1 recompute-all": 81_601_832,
    "dp2 ep2 zero1 geglu no-recompute": 146_907_234,
    "dp2 ep2 zero1 swiglu shared no-recompute": 159_715_910,
    # every expert filled to its capacity (--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity):
    # the busiest rank received exactly the mean routed copies, which the plan prices (dropless: 1.127x)
    "dp2 ep2 zero1 capacity1-padded no-recompute": 114_066_336,
    "dp2 zero1 geglu no-recompute": 120_160_796,
    "dp2 zero1 geglu recompute-mlp": 99_189_276,
}


@pytest.mark.parametrize("label", sorted(MEASURED))
def test_the_moe_and_gated_plans_peak_within_1_percent_of_megatron_cores(label):
    from benchmark_modules import load

    bench = load("megatron_memory")
    [case] = [case for case in bench.CASES if case.label() == label]
    predicted = bench.build_plan(case).prediction.peak_memory_bytes
    assert abs(predicted - MEASURED[label]) / MEASURED[label] <= 0.01
