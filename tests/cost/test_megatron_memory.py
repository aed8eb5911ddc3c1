"""Megatron-core's memory terms against hand-computed examples and against measured peaks.

The model is the GPT of benchmarks/megatron_memory.py (hidden 256, 4 heads, FFN 1024, vocabulary
4096, tied head) on micro-batches of 2 x 256 tokens, so that every number below is a few MiB that
the benchmark measured (benchmarks/results/megatron_memory.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dsauto.cost.layer import CostModel
from dsauto.cost.step import (
    gradient_transient_bytes,
    optimizer_step_bytes,
    predict_step,
)
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import state_bytes_per_param
from dsauto.parallel import ParallelDims
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import TrainSpec

MiB = 2**20
MODEL = ModelSpec(name="bench-gpt", architecture="decoder", num_layers=4, hidden_size=256, num_attention_heads=4,
                  ffn_hidden_size=1024, vocab_size=4096, max_position_embeddings=256, dropout=False)
TOKENS = 2 * 256
KEEP, RECOMPUTE = LayerOption(False, False, 1), LayerOption(True, False, 1)


def train(dtype: str = "bf16", flash: bool = False) -> TrainSpec:
    return TrainSpec(global_batch=8, seq_len=256, dtype=dtype, flash_attention=flash)


def strategy(engine: str = "megatron", tp: int = 1, pp: int = 1, dp: int = 1, zero: int = 0) -> Strategy:
    return Strategy(dims=ParallelDims(dp=dp, tp=tp, pp=pp), zero_stage=zero, micro_batch=2,
                    grad_accum=4 // dp, sequence_parallel=False, engine=engine)


def layer(kind: str, option: LayerOption = KEEP, engine: str = "megatron", tp: int = 1, dtype: str = "bf16",
          flash: bool = False, dp: int = 1, zero: int = 0, hardware: str = "cpu"):
    spec = train(dtype, flash)
    cluster = load_cluster(hardware, nodes=1, gpus_per_node=tp * dp)
    cost = CostModel(cluster, spec, strategy(engine, tp=tp, dp=dp, zero=zero), MODEL.hidden_size)
    group = next(g for g in layer_groups(MODEL, spec.seq_len, spec.dtype_bytes, tp) if g.kind == kind)
    return group, cost.layer(group, option)


@pytest.mark.parametrize(("dtype", "dp", "zero", "per_param"), [
    # Megatron's docs/source/api-guide/dist_optimizer.md, bytes per parameter: 18 (bf16 parameters,
    # fp32 gradients), 6 + 12/d with the distributed optimizer; fp16 20 and 4 + 16/d; fp32 16 and 8 + 8/d.
    ("bf16", 1, 0, 18), ("bf16", 2, 1, 6 + 12 / 2), ("bf16", 4, 1, 6 + 12 / 4),
    ("fp16", 1, 0, 20), ("fp16", 2, 1, 4 + 16 / 2), ("fp32", 1, 0, 16), ("fp32", 2, 1, 8 + 8 / 2),
])
def test_model_state_bytes_per_parameter_follow_megatrons_table(dtype, dp, zero, per_param):
    group, cost = layer("transformer", dtype=dtype, dp=dp, zero=zero, hardware="a100-80gb")  # has fp16
    assert cost.static_bytes / group.params == pytest.approx(per_param)


def test_deepspeed_keeps_its_own_bytes_per_parameter():
    assert state_bytes_per_param("deepspeed", 2, True, 1) == (2, 12)
    assert state_bytes_per_param("megatron", 2, True, 1) == (4, 12)


@pytest.mark.parametrize(("tp", "dtype", "flash", "extra"), [
    # The fp32 softmax output of unfused attention: 4 bytes x 4 heads x 256 keys per token, 512 tokens.
    (1, "bf16", False, 2 * MiB), (2, "bf16", False, 1 * MiB),
    (1, "fp32", False, 0), (1, "bf16", True, 0),  # fp32 keeps one softmax; flash attention keeps none
])
def test_unfused_attention_keeps_its_fp32_softmax(tp, dtype, flash, extra):
    _, megatron = layer("transformer", tp=tp, dtype=dtype, flash=flash)
    _, deepspeed = layer("transformer", engine="deepspeed", tp=tp, dtype=dtype, flash=flash)
    assert megatron.activation_bytes - deepspeed.activation_bytes == extra
    # Recomputed, the layer keeps its input (256 x 2 bytes per token) and rebuilds the whole of it.
    _, recomputed = layer("transformer", RECOMPUTE, tp=tp, dtype=dtype, flash=flash)
    assert recomputed.activation_bytes == TOKENS * 256 * (4 if dtype == "fp32" else 2)
    b = 4 if dtype == "fp32" else 2
    fc_grad = 256 * 1024 / tp * b  # the MLP matrix's gradient before the hook
    # The backward of the MLP output projection: beside that gradient, the gradients of the layer's
    # output and of the MLP's inner activation (at these shapes above the attention's moment).
    moment = fc_grad + TOKENS * 256 * b + TOKENS * 1024 / tp * b
    assert recomputed.transient_bytes == megatron.activation_bytes + moment
    assert megatron.transient_bytes == moment


@pytest.mark.parametrize(("tp", "dtype", "transient"), [
    # bf16: 4 MiB of logits + 8 MiB of their fp32 softmax (512 tokens x 4096 / tp), above the 4 MiB
    # logits gradient next to the output weight's 2 MiB gradient.
    (1, "bf16", 12 * MiB), (2, "bf16", 6 * MiB),
    # fp32: the softmax is the logits (8 MiB), below the backward's 8 MiB logits gradient + 4 MiB
    # weight gradient.
    (1, "fp32", 12 * MiB),
])
def test_the_head_peaks_at_the_loss_or_at_its_backward(tp, dtype, transient):
    _, head = layer("head", tp=tp, dtype=dtype)
    assert head.transient_bytes == transient
    _, embedding = layer("embedding", tp=tp, dtype=dtype)
    assert embedding.transient_bytes == 4096 * 256 / tp * (4 if dtype == "fp32" else 2)


def test_megatrons_gradients_are_priced_per_layer_not_per_stage():
    bucket, largest, grads = 16 * MiB, 2 * MiB, 8 * MiB
    assert gradient_transient_bytes(strategy(dp=2, zero=1), bucket, largest, grads) == 0
    # DeepSpeed's pipeline engine under ZeRO-1 (one stage: priced by moment, deepspeed_moment_peak)
    assert gradient_transient_bytes(strategy("deepspeed", dp=2, pp=2, zero=1), bucket, largest, grads) == largest


def test_torch_adamw_on_cpu_makes_two_temporaries_of_the_largest_main_parameter():
    megatron = strategy(dp=2, zero=1)
    assert optimizer_step_bytes(megatron, 10.0, 20.0, 30.0, 0, True, 4.0) == 10 + 20 + 30 + 2 * 4
    assert optimizer_step_bytes(megatron, 10.0, 20.0, 30.0, 0, False, 4.0) == 0.0  # fused Adam on GPUs


def test_16_bit_gradients_are_copied_to_fp32_for_the_update():
    # Megatron-core's optimizers give each fp32 main parameter (shard) .float() of a 16-bit gradient:
    # 4 bytes per main parameter, a third of the 12 the optimizer state takes.
    for zero in (0, 1):
        megatron = strategy(dp=2, zero=zero)
        assert optimizer_step_bytes(megatron, 10.0, 20.0, 30.0, 0, False, 4.0, True) == 10 + 20 + 30 + 10
        assert optimizer_step_bytes(megatron, 10.0, 20.0, 30.0, 0, True, 4.0, True) == 10 + 20 + 30 + 10 + 2 * 4
    # Megatron-FSDP and the precision-aware optimizer of an offloaded plan take the 16-bit gradient as it is.
    assert optimizer_step_bytes(strategy(dp=2, zero=3), 10.0, 20.0, 30.0, 0, False, 4.0, True) == 0.0
    offloaded = dataclasses.replace(strategy(dp=2, zero=1), offload="optimizer")
    assert optimizer_step_bytes(offloaded, 10.0, 20.0, 30.0, 0, False, 4.0, True) == 0.0


def predict(case: Strategy, recompute: bool = False, dtype: str = "bf16", flash: bool = False):
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=case.tp * case.pp * case.dp)
    options = [RECOMPUTE if recompute and 1 <= j <= MODEL.num_layers else KEEP for j in range(MODEL.num_layers + 2)]
    return predict_step(MODEL, cluster, train(dtype, flash), case, [MODEL.num_layers // case.pp] * case.pp, options)


def test_a_last_pipeline_stage_holds_its_own_copy_of_the_tied_embedding():
    step = predict(strategy(pp=2))
    table = 4096 * 256  # the word table on the last stage, without the position table
    first, last = step.stages
    head_norm = 2 * 256
    layers = 2 * (12 * 256 * 256 + 13 * 256)
    assert last.params_bytes == 2 * (layers + head_norm + table)
    assert last.grads_bytes == 4 * (layers + head_norm + table)
    assert last.optimizer_bytes == 12 * (layers + head_norm + table)
    assert first.params_bytes == 2 * (layers + table + 256 * 256)  # embedding: table and positions
    # No copy without pipelining, nor when the head is not tied.
    assert predict(strategy()).stages[0].params_bytes == 2 * (2 * layers + table + 256 * 256 + head_norm)


def test_a_first_pipeline_stage_keeps_its_outputs_and_the_score_buffer():
    kept = predict(strategy(pp=2)).stages[0]
    recomputed = predict(strategy(pp=2), recompute=True).stages[0]
    boundary = TOKENS * 256 * 2  # one micro-batch's output, 0.25 MiB
    # Two micro-batches in flight, each keeping two recomputed layers' inputs and the stage output.
    assert recomputed.activation_bytes == 2 * (2 * boundary + boundary)
    # Backward of a recomputed layer: its activations, its MLP output projection's backward (the
    # weight's gradient, the layer's output gradient, the MLP inner activation's gradient), the
    # gradient received from the next stage, and the 1 MiB score buffer (2 x 4 heads x 256 x 256
    # bf16 scores).
    layer_full = kept.activation_bytes / 2 / 2 - boundary / 2
    projection = 256 * 1024 * 2 + boundary + TOKENS * 1024 * 2
    assert recomputed.transient_bytes == pytest.approx(layer_full + projection + boundary + 1 * MiB)


@pytest.mark.parametrize(("seq", "micro_batch", "heads", "dtype", "recompute", "measured"), [
    (256, 2, 4, "fp32", True, 15_278_080), (256, 2, 4, "bf16", True, 9_773_056),  # the MLP's moment
    # Long sequences: the attention softmax's backward, 4 fp32 score tensors in fp32 and 3 in bf16.
    (1024, 1, 4, "fp32", True, 78_651_392), (1024, 1, 4, "bf16", True, 56_631_296),
    (512, 2, 8, "fp32", True, 77_864_960),
    (1024, 1, 4, "fp32", False, 77_602_816), (1024, 1, 4, "bf16", False, 56_107_008),
])
def test_a_layers_backward_peaks_where_megatron_core_measured_it(seq, micro_batch, heads, dtype, recompute, measured):
    # Measured: one TransformerBlock of Megatron-core 0.16.1's local spec (hidden 256, FFN 1024, no
    # dropout) forward and backward on one CPU rank, each weight's gradient freed once accumulated
    # as DDP's hook does, the live tensor bytes tracked by dsauto.profile.memory.MemoryTracker from
    # before the forward: the input, the output (the next layer's input) and the s x s boolean
    # causal mask Megatron makes per call (transformer/utils.py, get_default_causal_mask) included.
    model = ModelSpec(name="one-layer", architecture="decoder", num_layers=1, hidden_size=256,
                      num_attention_heads=heads, ffn_hidden_size=1024, vocab_size=4096,
                      max_position_embeddings=seq, dropout=False)
    spec = TrainSpec(global_batch=micro_batch, seq_len=seq, dtype=dtype, flash_attention=False)
    case = Strategy(dims=ParallelDims(), zero_stage=0, micro_batch=micro_batch, grad_accum=1,
                    sequence_parallel=False, engine="megatron")
    cost = CostModel(load_cluster("cpu", nodes=1, gpus_per_node=1), spec, case, model.hidden_size)
    group = next(g for g in layer_groups(model, seq, spec.dtype_bytes) if g.kind == "transformer")
    priced = cost.layer(group, RECOMPUTE if recompute else KEEP)
    output, mask = micro_batch * seq * 256 * spec.dtype_bytes, seq * seq
    predicted = priced.activation_bytes + priced.transient_bytes + output + mask
    assert predicted == pytest.approx(measured, rel=0.001)


# Peaks of live tensor bytes per rank measured by benchmarks/megatron_memory.py (Megatron-core 0.16.1,
# bf16, two CPU ranks; benchmarks/results/megatron_memory.md), largest rank.
MEASURED = {
    ("tp2", False): 63_540_276, ("tp2", True): 47_533_108,
    ("pp2", False): 81_542_180, ("pp2", True): 62_546_484,
    ("dp2 zero1", False): 95_105_572, ("dp2 zero1", True): 66_515_492,
    ("dp2 zero0", False): 120_747_556, ("dp2 zero0", True): 92_157_476,
    # --grad-reduce-in-bf16: recomputed, the peak is the update with its fp32 gradient copies
    ("dp2 zero1 bf16-grads", False): 86_558_236, ("dp2 zero1 bf16-grads", True): 60_989_464,
    ("dp2 zero0 bf16-grads", False): 112_200_220, ("dp2 zero0 bf16-grads", True): 94_916_632,
}
PLANS = {"tp2": strategy(tp=2), "pp2": strategy(pp=2), "dp2 zero1": strategy(dp=2, zero=1),
         "dp2 zero0": strategy(dp=2, zero=0),
         "dp2 zero1 bf16-grads": dataclasses.replace(strategy(dp=2, zero=1), grad_reduce_in_fp32=False),
         "dp2 zero0 bf16-grads": dataclasses.replace(strategy(dp=2, zero=0), grad_reduce_in_fp32=False)}


@pytest.mark.parametrize(("plan", "recompute"), sorted(MEASURED))
def test_predicted_peaks_are_within_3_percent_of_megatron_cores(plan, recompute):
    measured = MEASURED[plan, recompute]
    predicted = predict(PLANS[plan], recompute).prediction.peak_memory_bytes
    assert abs(predicted - measured) / measured <= 0.03


def test_an_interleaved_rank_whose_first_chunk_keeps_more_peaks_as_megatron_core_measured():
    """pp 2 interleaved over 2 chunks a rank, layers (1, 3): rank 0 holds the embedding and a layer in
    its first chunk and nothing in its second, so while its backwards drain the empty chunk its
    forwards fill the first one with all 4 micro-batches; rank 1 keeps its loss while its head's
    chunk holds a pass (benchmarks/megatron_memory.py, pp2 vpp2 layers-1+3: 68,913,748 and
    114,326,584 bytes). The warm-up's count alone (pp + (pp - 1) / v passes of every layer) put
    rank 0 17% low (54.7 MiB)."""
    case = dataclasses.replace(strategy(pp=2), virtual_stages=2)
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=2)
    options = [KEEP] * (MODEL.num_layers + 2)
    stages = predict_step(MODEL, cluster, train("bf16", False), case, [1, 3], options).stages
    for stage, measured in zip(stages, (68_913_748, 114_326_584), strict=True):
        assert abs(stage.peak_bytes - measured) / measured <= 0.03, (stage.stage, stage.peak_bytes, measured)


# ---- one layer's kept tensors on an H100 -----------------------------------------------------------

SAVED_ON_H100 = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "device_steps_saved_h100.txt"
"""Every tensor autograd saved, by storage, in one forward of a one-layer Megatron-core GPT (local layer
spec, bf16, the dsauto plugin's config) on an H100, listed with torch's saved_tensors_hooks (the
layers of benchmarks/device_steps.py's cases; how it was measured: that file's results)."""
NOT_ACTIVATIONS = ("vocab_parallel_cross_entropy", "attention_mask_func", "apply_rotary_pos_emb", "int64")
"""Saved tensors the activation count leaves out: the loss's fp32 logits (the head's transient), the
s x s causal mask and the rotary tables Megatron-core builds once per call, the token indices."""


def _saved_on_h100() -> dict[str, tuple[int, int, float]]:
    """{model: (micro-batch, sequence length, MiB of saved activations)} from the listing."""
    import re

    cases: dict[str, tuple[int, int, float]] = {}
    name = ""
    for line in SAVED_ON_H100.read_text().splitlines():
        if header := re.match(r"== (\S+): mb (\d+) s (\d+)", line):
            name = header[1]
            cases[name] = (int(header[2]), int(header[3]), 0.0)
        elif (row := re.match(r"\s*([\d.]+) MiB", line)) and not any(word in line for word in NOT_ACTIVATIONS):
            micro_batch, seq_len, total = cases[name]
            cases[name] = (micro_batch, seq_len, total + float(row[1]))
    return cases


@pytest.mark.parametrize("preset", ["llama2-7b", "llama3-8b", "gpt2-xl"])
def test_one_layer_keeps_what_megatron_core_saved_on_an_h100(preset):
    # Llama 2 7B: rotated queries and keys beside the QKV storage the values' view keeps; Llama 3 8B:
    # keys and values repeated to every head; GPT-2 XL: attention dropout, whose output replaces the
    # 16-bit probabilities. The fp32 softmax output, the 16-bit probabilities and the fused SwiGLU's
    # input in each (terms.megatron_softmax_fp32_bytes_per_token, megatron_eager_qkv_bytes_per_token).
    from dsauto.spec.loaders import load_model

    micro_batch, seq_len, measured = _saved_on_h100()[preset]
    model = dataclasses.replace(load_model(preset), num_layers=1)
    cluster = load_cluster("h100-80gb", nodes=1, gpus_per_node=1)
    run = TrainSpec(global_batch=micro_batch, seq_len=seq_len, dtype="bf16", flash_attention=False)
    cost = CostModel(cluster, run, Strategy(dims=ParallelDims(), zero_stage=1, micro_batch=micro_batch, grad_accum=1,
                                            sequence_parallel=False, engine="megatron"), model.hidden_size)
    kept = sum(cost.layer(group, KEEP).activation_bytes for group in layer_groups(model, seq_len, 2))
    assert kept / MiB == pytest.approx(measured, rel=1e-3)


def test_megatron_core_steps_on_an_h100_peak_as_priced():
    # Real Megatron-core training on an H100 (benchmarks/device_steps.py, run 2): each plan's peak of
    # live bytes over its first steps against its prediction, within 1%. The backward of unfused 16-bit
    # attention holds 4 fp32 score tensors there (the device's softmax_backward_fp32_scores), 3 on CPU.
    import json

    from benchmark_modules import load

    steps = load("device_steps")
    data = json.loads(steps.DEFAULT_FILE.read_text())
    cases = {case.name: case for case in steps.CASES}
    measured = [entry for entry in data["cases"] if "measured" in entry]
    assert len(measured) == 6
    for entry in measured:
        plan = steps.reprice(cases[entry["case"]], entry["plan_yaml"], "h100-80gb")
        peak = entry["measured"]["peak_bytes"]
        assert plan.prediction.peak_memory_bytes == pytest.approx(peak, rel=0.01), entry["case"]


def test_unfused_attention_keeps_per_score_and_per_token_what_the_listing_shows():
    # Per score in bf16: the 16-bit probabilities and the fp32 softmax output (2 + 4) without dropout;
    # with dropout its mask and output replace the probabilities (1 + 2 + 4). Per token, Llama 3 8B's
    # grouped keys and values repeated to all 32 heads beside the rotated queries (3 x 8192 bytes
    # against the neutral 8192 + 4096); under core_attn recomputation the checkpoint keeps the rotated
    # queries and keys and the unrepeated QKV storage (8192 + 2048 + 12288).
    from dsauto.cost.terms import (
        attention_scores_per_token,
        megatron_eager_qkv_bytes_per_token,
        megatron_softmax_fp32_bytes_per_token,
    )
    from dsauto.spec.loaders import load_model

    llama = load_model("llama3-8b")
    [block] = [g for g in layer_groups(llama, 4096, 2) if g.kind == "transformer"]
    scores = attention_scores_per_token(block)
    assert scores == 32 * 4096
    assert block.attention_score_bytes_per_token == 2 * scores and not block.attention_dropout
    assert megatron_softmax_fp32_bytes_per_token(block, 1, 2) == 4 * scores
    dropped = dataclasses.replace(llama, dropout=True)
    [with_dropout] = [g for g in layer_groups(dropped, 4096, 2) if g.kind == "transformer"]
    kept = with_dropout.attention_score_bytes_per_token + megatron_softmax_fp32_bytes_per_token(with_dropout, 1, 2)
    assert kept == 7 * scores
    assert megatron_softmax_fp32_bytes_per_token(block, 1, 4) == 0  # in fp32 the output is the probabilities
    assert megatron_eager_qkv_bytes_per_token(block, 1) == 3 * 8192 - (8192 + 4096)
    assert megatron_eager_qkv_bytes_per_token(block, 1, core_recomputed=True) == 8192 + 2048
    assert megatron_eager_qkv_bytes_per_token(block, 2) == (3 * 8192 - (8192 + 4096)) / 2


def _layer_peak(model: ModelSpec, seq: int, **config) -> int:
    """Peak live bytes of one of Megatron-core's local-spec layers, forward and backward of one
    sequence in bf16 on this CPU, from before the forward (each weight's gradient freed once
    accumulated, as DDP's hook does)."""
    import torch

    from dsauto.profile.megatron_layers import megatron_layer, megatron_layer_state
    from dsauto.profile.memory import MemoryTracker

    with megatron_layer_state(torch.device("cpu")):
        layer = megatron_layer(model, 1, torch.bfloat16, **config)
        for parameter in layer.parameters():
            parameter.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        x = torch.randn(seq, 1, model.hidden_size, dtype=torch.bfloat16)
        with MemoryTracker() as tracker:
            layer(x).float().sum().backward()
        return tracker.peak_bytes()


def test_a_16_bit_softmax_keeps_one_fp32_score_tensor_less_than_priced_for_the_fp32_one():
    """--no-attention-softmax-in-fp32 (Megatron-LM's default launch): measured on real Megatron-core
    layers, the layer's peak falls by what the cost model takes off, the fp32 copy of the scores that
    the fp32 softmax keeps and the fp32 tensors of its backward turned 16-bit."""
    seq = 1024
    model = ModelSpec(name="one-layer", architecture="decoder", num_layers=1, hidden_size=256, num_attention_heads=4,
                      ffn_hidden_size=1024, vocab_size=4096, max_position_embeddings=seq, dropout=False)
    measured = (_layer_peak(model, seq, attention_softmax_in_fp32=True)
                - _layer_peak(model, seq, attention_softmax_in_fp32=False))
    train = TrainSpec(global_batch=1, seq_len=seq, dtype="bf16", flash_attention=False)
    group = next(g for g in layer_groups(model, seq, train.dtype_bytes) if g.kind == "transformer")

    def priced(fp32: bool) -> float:
        case = Strategy(dims=ParallelDims(), zero_stage=0, micro_batch=1, grad_accum=1, sequence_parallel=False,
                        engine="megatron", attention_softmax_in_fp32=fp32)
        cost = CostModel(load_cluster("cpu", nodes=1, gpus_per_node=1), train, case, model.hidden_size)
        layer = cost.layer(group, KEEP)
        return layer.activation_bytes + layer.transient_bytes

    assert measured == 4 * 1024 * 1024 * 4  # one fp32 score tensor: 4 heads x 1024 x 1024 x 4 bytes
    assert priced(True) - priced(False) == pytest.approx(measured, rel=0.001)


def test_the_16_bit_softmax_needs_keys_transformer_engines_kernel_takes(capsys):
    from dsauto.cli import main

    code = main(["plan", "--model", "llama2-7b", "--hardware", "a100-80gb", "--engine", "megatron",
                 "--no-flash-attention", "--no-attention-softmax-in-fp32", "--seq-len", "4092", "--global-batch", "16"])
    err = capsys.readouterr().err
    assert code == 2 and "a multiple of 8, not 4092" in err and err.count("\n") == 1
