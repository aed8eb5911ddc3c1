"""Layer profiling: separate forward and backward times, kept activations that match the analytic
counts of the same layer, recomputation that keeps only the input, and TP shard shapes."""

import dataclasses

import pytest
import torch

from dsauto.profile.layers import profile_layers, reference_layer
from dsauto.spec.loaders import load_model
from dsauto.spec.model import layer_groups

SEQ = 64


@pytest.fixture(scope="module")
def tiny():
    return load_model("gpt-tiny")


@pytest.fixture(scope="module")
def measured(tiny):
    return profile_layers(tiny, SEQ, micro_batches=(1, 2), tps=(1, 2), dtype=torch.float32,
                          device=torch.device("cpu"), warmup=1, repeats=1)


def test_every_group_tp_micro_batch_and_checkpoint_setting_is_measured(measured):
    keys = {(m.group, m.tp, m.micro_batch, m.checkpoint) for m in measured}
    expected = {(g, t, b, False) for g in ("embedding", "decoder", "head") for t in (1, 2) for b in (1, 2)}
    expected |= {("decoder", t, b, True) for t in (1, 2) for b in (1, 2)}
    assert keys == expected
    assert all(m.forward_seconds > 0 and m.backward_seconds > 0 for m in measured)


def test_kept_activations_match_the_analytic_count_of_a_transformer_layer(tiny, measured):
    # Flash attention and no dropout: the descriptors count exactly what autograd keeps
    # (Korthikanti et al. 2022, generalised in spec.model), up to the small per-head softmax stats.
    block = layer_groups(tiny, SEQ, 4, tp=1)[1]
    for m in measured:
        if m.group == "decoder" and m.tp == 1 and not m.checkpoint:
            tokens = m.micro_batch * SEQ
            analytic = tokens * (block.act_tp_bytes_per_token + block.act_replicated_bytes_per_token)
            assert m.activation_bytes == pytest.approx(analytic, rel=0.05)


def test_recomputation_keeps_only_the_input_and_costs_a_forward_in_backward(tiny, measured):
    by_key = {(m.group, m.tp, m.micro_batch, m.checkpoint): m for m in measured}
    for b in (1, 2):
        full, ckpt = by_key[("decoder", 1, b, False)], by_key[("decoder", 1, b, True)]
        assert ckpt.activation_bytes == b * SEQ * tiny.hidden_size * 4
        assert ckpt.activation_bytes < full.activation_bytes / 10


def test_activations_scale_with_the_micro_batch_and_shrink_with_tp(measured):
    by_key = {(m.group, m.tp, m.micro_batch, m.checkpoint): m for m in measured}
    one, two = by_key[("decoder", 1, 1, False)], by_key[("decoder", 1, 2, False)]
    assert two.activation_bytes == 2 * one.activation_bytes
    assert by_key[("decoder", 2, 1, False)].activation_bytes < one.activation_bytes


def test_tp_shards_hold_their_share_of_the_parameters(tiny):
    groups = layer_groups(tiny, SEQ, 4, tp=2)
    for group, descriptor in zip(("embedding", "block", "head"), groups):
        layer = reference_layer(tiny, group, 2, tiny.padded_vocab_size(2))
        local = descriptor.tp_params / 2 + descriptor.params - descriptor.tp_params
        params = sum(p.numel() for p in layer.parameters())
        if group == "head":  # the untied LM head is measured, as the tied one costs the same matmul
            local += tiny.padded_vocab_size(2) * tiny.hidden_size / 2
        assert params == local


def test_swiglu_gqa_rope_layers_profile_too(tiny):
    llama = dataclasses.replace(tiny, name="tiny-llama", mlp="swiglu", norm="rmsnorm", position_embedding="rope",
                                num_kv_heads=2, linear_bias=False, tied_embeddings=False)
    result = profile_layers(llama, SEQ, micro_batches=(1,), tps=(1,), dtype=torch.float32,
                            device=torch.device("cpu"), warmup=1, repeats=1)
    block = layer_groups(llama, SEQ, 4, tp=1)[1]
    decoder = next(m for m in result if m.group == "decoder" and not m.checkpoint)
    analytic = SEQ * (block.act_tp_bytes_per_token + block.act_replicated_bytes_per_token)
    # The analytic count assumes Megatron's fused kernels. The reference layer keeps more, which is
    # why measuring matters: torch's RMSNorm is not fused and keeps its normalised output as well as
    # its input, and the fused gate/up output stays alive through the views SwiGLU takes of it.
    assert analytic < decoder.activation_bytes < 1.6 * analytic


def test_the_head_measures_what_its_final_norm_keeps(tiny, measured):
    # A LayerNorm keeps its input and per-token statistics, and the LM head matrix the norm's output:
    # the analytic count's input and output. Only the head measures it.
    head = layer_groups(tiny, SEQ, 4, tp=1)[2]
    for m in measured:
        tokens = m.micro_batch * SEQ
        if m.group != "head":
            assert m.hidden_bytes == 0
        elif m.tp == 1:
            assert m.hidden_bytes == pytest.approx(tokens * head.act_replicated_bytes_per_token, rel=0.01)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_head_of_an_rmsnorm_model_keeps_what_the_count_prices(dtype):
    # The reference RMSNorm computes as Hugging Face's LlamaRMSNorm (fp32, cast back, then the
    # weight): beyond the fused count's input and output it keeps 4 bytes an element in either
    # dtype (the unfused extra), and a 4-byte reciprocal RMS per token.
    llama = dataclasses.replace(load_model("gpt-tiny"), name="tiny-llama", norm="rmsnorm", mlp="swiglu",
                                position_embedding="rope", tied_embeddings=False, linear_bias=False)
    head = reference_layer(llama, "head", 1, llama.padded_vocab_size(1)).to(dtype)
    from dsauto.profile.layers import head_hidden_bytes

    x = torch.randn(2, SEQ, llama.hidden_size, dtype=dtype, requires_grad=True)
    counted = layer_groups(llama, SEQ, x.element_size(), tp=1)[2]
    per_token = counted.act_replicated_bytes_per_token + counted.unfused_extra_bytes_per_token
    assert counted.unfused_extra_bytes_per_token == 4 * llama.hidden_size
    assert head_hidden_bytes(head, x) == 2 * SEQ * (per_token + 4)
