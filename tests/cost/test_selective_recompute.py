"""Selective recomputation priced per module against hand-computed counts (Korthikanti et al. 2022)."""

import dataclasses

import pytest

from dsauto.cost.layer import CostModel
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import selective_recompute_flops_per_token, selective_recompute_seconds
from dsauto.parallel import ParallelDims
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.loaders import load_hardware
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import TrainSpec

# Korthikanti et al.'s GPT layer: GeLU MLP of width 4h, LayerNorm, dropout, 16-bit.
S, B, H, A = 2048, 2, 1024, 16
GPT = ModelSpec(name="gpt-test", architecture="decoder", num_layers=8, hidden_size=H, num_attention_heads=A,
                ffn_hidden_size=4 * H, vocab_size=51200, max_position_embeddings=S)
PLAIN = LayerOption(checkpoint=False, shard_params=False, split=1)


def selective(*modules: str) -> LayerOption:
    return dataclasses.replace(PLAIN, recompute_modules=modules)


def cost_model(tp=1, sp=False, engine="deepspeed", flash=False, dtype="fp16") -> CostModel:
    cluster = ClusterSpec(load_hardware("a100-80gb"), nodes=1, gpus_per_node=8)
    train = TrainSpec(global_batch=16, seq_len=S, dtype=dtype, flash_attention=flash)
    strategy = Strategy(dims=ParallelDims(dp=8 // tp, tp=tp, pp=1), zero_stage=0, micro_batch=B, grad_accum=1,
                        sequence_parallel=sp, engine=engine)
    return CostModel(cluster, train, strategy, H)


def block(tp=1, dtype_bytes=2):
    return layer_groups(GPT, S, dtype_bytes, tp)[1]


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (8, False), (8, True)])
def test_core_attention_recompute_removes_korthikantis_5as_over_h_term(tp, sp):
    # Table 2: sbh(10 + 24/t + 5as/(ht)) per layer without sequence parallelism, sbh(34/t + 5as/(ht))
    # with it; "selective activation recomputation" (Sec. 5) removes the 5as/(ht) part:
    # 5 * a * s^2 * b / t bytes per micro-batch = 5 * 16 * 2048^2 * 2 / t.
    model = cost_model(tp=tp, sp=sp)
    kept = model.layer(block(tp), PLAIN).activation_bytes
    recomputed = model.layer(block(tp), selective("core_attn"))
    assert kept - recomputed.activation_bytes == pytest.approx(5 * A * S * S * B / tp)
    assert recomputed.transient_bytes == pytest.approx(5 * A * S * S * B / tp)  # rebuilt for its backward
    # What is left is Table 2's selective row, sbh * 34/t (with SP) or sbh(10 + 24/t), plus the
    # 4 bytes per head and token of softmax statistics dsauto counts for the attention kernel.
    rest = S * B * H * (34 / tp if sp else 10 + 24 / tp) + S * B * 4 * A / tp
    assert recomputed.activation_bytes == pytest.approx(rest)


def test_megatron_also_frees_its_fp32_softmax_output():
    # Megatron-core's unfused softmax in fp32 keeps its fp32 output (terms.
    # megatron_softmax_fp32_bytes_per_token), and with dropout the product with the values keeps the
    # dropout's output, not the 16-bit probabilities: 5 + 4 - 2 = 7 bytes per score in 16-bit training.
    model = cost_model(engine="megatron", dtype="bf16")
    saved = model.layer(block(), PLAIN).activation_bytes - model.layer(block(), selective("core_attn")).activation_bytes
    assert saved == pytest.approx(7 * A * S * S * B)


def test_norm_and_mlp_recompute_free_their_outputs():
    # Korthikanti Sec. 4.1: the two LayerNorm outputs feeding QKV and the MLP, 2sbh each (split by t
    # under sequence parallelism), and the MLP's GeLU input and output, 8sbh each (split by t).
    for tp, sp in [(1, False), (4, False), (4, True)]:
        model = cost_model(tp=tp, sp=sp)
        kept = model.layer(block(tp), PLAIN).activation_bytes
        norms = kept - model.layer(block(tp), selective("layernorm")).activation_bytes
        mlp = kept - model.layer(block(tp), selective("mlp")).activation_bytes
        both = kept - model.layer(block(tp), selective("layernorm", "mlp")).activation_bytes
        assert norms == pytest.approx(4 * S * B * H / (tp if sp else 1))
        assert mlp == pytest.approx(16 * S * B * H / tp)
        assert both == pytest.approx(norms + mlp)


def test_recomputed_flops_per_module():
    group = block()
    # Attention core (Sec. 5): QK^T and attention over V, 2 * 2 * s * h FLOPs per token, half of it
    # under a fused causal kernel, which skips the masked triangle.
    assert selective_recompute_flops_per_token(group, selective("core_attn"), False) == 4 * S * H
    assert selective_recompute_flops_per_token(group, selective("core_attn"), True) == 2 * S * H
    # The MLP's two matrices, h x 4h and 4h x h: 2 * 8h^2 FLOPs per token; the norms none.
    assert selective_recompute_flops_per_token(group, selective("mlp"), False) == 16 * H * H
    assert selective_recompute_flops_per_token(group, selective("layernorm"), False) == 0
    # Only for transformer layers not checkpointed whole.
    assert selective_recompute_flops_per_token(group, dataclasses.replace(selective("mlp"), checkpoint=True),
                                               False) == 0


@pytest.mark.parametrize("modules", [("core_attn",), ("layernorm",), ("mlp",), ("core_attn", "layernorm", "mlp")])
def test_recomputation_adds_its_forward_to_backward_only(modules):
    model = cost_model(tp=2)
    plain, option = model.layer(block(2), PLAIN), model.layer(block(2), selective(*modules))
    extra = selective_recompute_seconds(block(2), selective(*modules), model.context)
    assert extra > 0
    assert option.forward_seconds == plain.forward_seconds
    assert option.backward_seconds == pytest.approx(plain.backward_seconds + extra)
    # Less than a whole-layer checkpoint, which re-runs the whole forward.
    checkpointed = model.layer(block(2), dataclasses.replace(PLAIN, checkpoint=True))
    assert option.backward_seconds < checkpointed.backward_seconds


def test_core_attention_under_a_fused_kernel_frees_nothing_and_costs_a_forward():
    model = cost_model(flash=True)
    plain, option = model.layer(block(), PLAIN), model.layer(block(), selective("core_attn"))
    assert option.activation_bytes == plain.activation_bytes
    assert option.backward_seconds > plain.backward_seconds


def test_embedding_and_head_are_not_recomputed_selectively():
    model = cost_model()
    for group in (layer_groups(GPT, S, 2, 1)[0], layer_groups(GPT, S, 2, 1)[2]):
        assert model.layer(group, selective("core_attn", "mlp")) == model.layer(group, PLAIN)


def test_deepspeed_prices_the_hooks_modules_under_fused_attention():
    # What the DeepSpeed hook frees (dsauto.runtime.recompute; measured in
    # tests/runtime/test_deepspeed_selective.py): a fused attention kernel keeps no scores, so the core
    # frees nothing counted; the two norm outputs are 2h elements per token and the GeLU MLP's input
    # and output 4h each, 4 bytes apiece in fp32.
    model, group = cost_model(engine="deepspeed", flash=True, dtype="fp32"), block(dtype_bytes=4)
    kept = model.layer(group, PLAIN).activation_bytes
    for modules, per_token in [(("core_attn",), 0), (("layernorm",), 2 * H * 4), (("mlp",), 8 * H * 4),
                               (("core_attn", "layernorm", "mlp"), 10 * H * 4)]:
        freed = kept - model.layer(group, selective(*modules)).activation_bytes
        assert freed == pytest.approx(S * B * per_token)
