"""FP8 training (Transformer Engine's linear layers under Megatron-core: delayed and tensorwise
scaling, FP8 weights): the transformer layers' GEMMs at the FP8 peak, the casts, the activations
and weight copies it keeps, what it leaves in 16 bits, and the plans, flags and refusals around it."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from dsauto.api import make_plan, make_problem
from dsauto.cost.layer import CostModel
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import FP8_CAST_BYTES, fp8_cast_bytes_per_token
from dsauto.describe import describe_plan
from dsauto.emit.megatron import megatron_args
from dsauto.engines.rules import fp8_refusal
from dsauto.errors import DsautoError
from dsauto.parallel import ParallelDims
from dsauto.plan_io import plan_from_data, plan_yaml_text
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.loaders import load_hardware, load_model
from dsauto.spec.model import layer_groups
from dsauto.spec.training import TrainSpec

PLAIN = LayerOption(checkpoint=False, shard_params=False, split=1)
SHARDED = LayerOption(checkpoint=False, shard_params=True, split=1)
TOKENS = 4096


def costs(fp8: bool, zero: int = 1, tp: int = 1, sp: bool = False, efficiency: float | None = None,
          recipe: str = "delayed", param_gather: bool = False):
    hardware = load_hardware("h100-80gb")
    if efficiency is not None:
        hardware = dataclasses.replace(hardware, device=dataclasses.replace(hardware.device,
                                                                            fp8_matmul_efficiency=efficiency))
    cluster = ClusterSpec(hardware, nodes=1, gpus_per_node=8)
    train = TrainSpec(global_batch=8 // tp, seq_len=TOKENS, dtype="bf16")
    strategy = Strategy(dims=ParallelDims(dp=8 // tp, tp=tp), zero_stage=zero, micro_batch=1, grad_accum=1,
                        sequence_parallel=sp, engine="megatron", fp8=fp8, fp8_recipe=recipe,
                        fp8_param_gather=param_gather)
    model = load_model("llama3-8b")
    return CostModel(cluster, train, strategy, model.hidden_size), layer_groups(model, TOKENS, 2, tp), model


def test_the_transformer_layers_gemms_run_at_the_fp8_peak_and_the_head_does_not():
    same = load_hardware("h100-80gb").device.matmul_efficiency  # FP8 GEMMs as efficient as 16-bit ones
    bf16, (_, block, head), _ = costs(False, efficiency=same)
    fp8, _, _ = costs(True, efficiency=same)
    device = load_hardware("h100-80gb").device
    ratio = device.peak_flops["bf16"] / device.peak_flops["fp8"]
    assert ratio == pytest.approx(0.5, rel=1e-3)  # H100 SXM datasheet, dense: 1979 against 989 TFLOP/s
    # At the same efficiency the FP8 GEMMs take half the time; the casts add 4 bytes per input element.
    gemm = bf16.context.device.matmul_seconds(block.matmul_flops_per_token * TOKENS, block.gemm_dim)
    casts = bf16.memory_seconds(FP8_CAST_BYTES * block.linear_input_elements_per_token * TOKENS)
    a, b = bf16.layer(block, PLAIN), fp8.layer(block, PLAIN)
    assert a.forward_seconds - b.forward_seconds == pytest.approx(gemm * (1 - ratio) - casts, rel=1e-9)
    assert b.backward_seconds < a.backward_seconds
    # The output layer is Megatron-core's ColumnParallelLinear, not a TE module: 16 bits.
    assert fp8.layer(head, PLAIN).forward_seconds == bf16.layer(head, PLAIN).forward_seconds
    # llama3-8b's linear inputs per token: QKV h, the projection's 4096, the MLP's h and f.
    assert block.linear_input_elements_per_token == 4096 + 4096 + 4096 + 14336
    assert fp8_cast_bytes_per_token(block, bf16.context) == 0.0


def test_fp8_keeps_linear_inputs_in_fp8_and_the_attention_output_twice():
    bf16, (_, block, _), _ = costs(False)
    fp8, _, _ = costs(True)
    a, b = bf16.layer(block, PLAIN), fp8.layer(block, PLAIN)
    # Per token: the two norms' outputs (QKV and MLP inputs, 2 x 4096 x 2 bytes) drop to one byte each,
    # the MLP output projection's 14336-wide input too, and the 4096-wide attention output gains a copy.
    per_token = -2 * 4096 - 14336 + 4096
    assert b.activation_bytes - a.activation_bytes == pytest.approx(TOKENS * per_token)


def test_relu_keeps_its_16_bit_output_beside_the_projections_fp8_copy():
    """ReLU's backward reads its own output, so the MLP output projection's FP8 copy of it is kept
    beside the 16-bit one rather than instead of it: one byte more a 14336-wide element, where a GeLU's
    output, which nothing else keeps, drops from two bytes to one. Recomputing the MLP frees both."""
    cost_16, _, model = costs(False)
    cost_8, _, _ = costs(True)
    change = {}
    for mlp in ("gelu", "relu"):
        block = layer_groups(dataclasses.replace(model, mlp=mlp), TOKENS, 2)[1]
        kept_16, kept_8 = cost_16.layer(block, PLAIN), cost_8.layer(block, PLAIN)
        change[mlp] = (kept_8.activation_bytes - kept_16.activation_bytes) / TOKENS
        mlp_recomputed = dataclasses.replace(PLAIN, recompute_modules=("mlp",))
        freed = kept_8.activation_bytes - cost_8.layer(block, mlp_recomputed).activation_bytes
        # GeLU keeps its 16-bit input and the projection its output in FP8; ReLU its 16-bit output
        # and the projection the FP8 copy: three bytes a 14336-wide element either way
        assert freed == pytest.approx(TOKENS * 14336 * 3)
    assert change["gelu"] == pytest.approx(-2 * 4096 - 14336 + 4096)
    assert change["relu"] == pytest.approx(-2 * 4096 + 14336 + 4096)


def test_fp8_activation_change_splits_like_the_activations_under_tp_and_sp():
    bf16, (_, block, _), _ = costs(False, tp=2, sp=True)
    fp8, _, _ = costs(True, tp=2, sp=True)
    delta = fp8.layer(block, PLAIN).activation_bytes - bf16.layer(block, PLAIN).activation_bytes
    tokens = bf16.tokens
    assert delta == pytest.approx(tokens * (-2 * 4096 - 14336 + 4096) / 2)


def test_resident_layers_keep_two_fp8_copies_of_their_weights_sharded_ones_while_gathered():
    bf16, (_, block, _), _ = costs(False, zero=1)
    fp8, _, _ = costs(True, zero=1)
    added = fp8.layer(block, PLAIN).params_bytes - bf16.layer(block, PLAIN).params_bytes
    assert added == pytest.approx(2 * block.params)
    bf16_3, _, _ = costs(False, zero=3)
    fp8_3, _, _ = costs(True, zero=3)
    a, b = bf16_3.layer(block, SHARDED), fp8_3.layer(block, SHARDED)
    assert b.params_bytes == pytest.approx(a.params_bytes)
    # Megatron-FSDP's unit (the whole layer) in use and prefetched, now with its FP8 copies too.
    assert b.transient_bytes - a.transient_bytes == pytest.approx(2 * block.params * 2)


def test_a_profile_measured_in_16_bits_does_not_price_fp8_layers():
    from dsauto.profile.layers import LayerMeasurement
    from dsauto.profile.store import Profile

    model = load_model("gpt-tiny")
    layers = tuple(LayerMeasurement(group=group, tp=1, micro_batch=1, checkpoint=False, forward_seconds=0.001,
                                    backward_seconds=0.002, activation_bytes=50_000, peak_bytes=80_000,
                                    params_bytes=4096)
                   for group in ("embedding", model.architecture, "head"))
    profile = Profile(model=model, device="cpu", dtype="bf16", seq_len=256, threads=1, versions={"torch": "2.0"},
                      layers=layers, optimizer_seconds_per_param=2e-9, collectives=(), zero3_module_seconds=0.0,
                      layer_modules={})
    block = layer_groups(model, 256, 2, 1)[1]
    cluster = ClusterSpec(load_hardware("h100-80gb"), nodes=1, gpus_per_node=2)
    train = TrainSpec(global_batch=2, seq_len=256, dtype="bf16")

    def measured(fp8: bool):
        strategy = Strategy(dims=ParallelDims(dp=2), zero_stage=1, micro_batch=1, grad_accum=1,
                            sequence_parallel=False, engine="megatron", fp8=fp8)
        return CostModel(cluster, train, strategy, model.hidden_size, profile)._measured_layer(block, False)

    assert measured(False) is not None  # the profile prices the 16-bit layer
    assert measured(True) is None  # and not the FP8 one, which the analytic model prices


def test_fp8_plans_only_when_pinned_and_on_megatron_core():
    plain = make_plan("llama3-8b", "h100-80gb", global_batch=64, seq_len=8192)
    assert not plain.fp8
    plan = make_plan("llama3-8b", "h100-80gb", global_batch=64, seq_len=8192, fp8=True)
    assert plan.fp8 and plan.engine == "megatron"
    same = make_plan("llama3-8b", "h100-80gb", global_batch=64, seq_len=8192, engine="megatron",
                     tp=plan.tp, pp=plan.pp, zero_stage=plan.zero_stage, micro_batch=plan.micro_batch)
    assert plan.prediction.step_seconds < same.prediction.step_seconds
    args = megatron_args(plan)
    assert "--fp8-format hybrid" in args and "--fp8-recipe delayed" in args
    assert not any(line.startswith("--fp8") for line in megatron_args(same))
    assert plan_from_data(yaml.safe_load(plan_yaml_text(plan)), "plan.yaml").fp8
    # MFU against the bf16 peak for both, so that they compare, and said so for the FP8 plan
    assert ", MFU " in describe_plan(plan) and " of the bf16 peak, " in describe_plan(plan)
    assert " of the bf16 peak" not in describe_plan(same)


def test_fp8_refusals_are_one_sentence_each():
    model = load_model("llama3-8b")
    assert "Megatron-core" in fp8_refusal("deepspeed", "bf16", model)
    assert "not fp32" in fp8_refusal("megatron", "fp32", model)
    assert fp8_refusal("megatron", "bf16", model) is None
    odd = dataclasses.replace(model, hidden_size=4104, num_attention_heads=36, num_kv_heads=4)
    assert "multiples of 16" in fp8_refusal("megatron", "bf16", odd)
    with pytest.raises(DsautoError, match="no FP8 peak"):
        make_problem("llama3-8b", "a100-80gb", fp8=True)
    with pytest.raises(DsautoError, match="--fp8 cannot run"):
        make_plan("llama3-8b", "h100-80gb", global_batch=64, engine="deepspeed", fp8=True)
    # Megatron-core's TransformerConfig refuses these recomputations under delayed scaling.
    with pytest.raises(DsautoError, match="'layernorm' under FP8"):
        make_plan("llama3-8b", "h100-80gb", global_batch=64, recompute_modules="layernorm", fp8=True)


def test_the_megatron_plugin_turns_fp8_on_and_reports_a_config_that_has_it_unplanned(caplog):
    from megatron.core.transformer import TransformerConfig

    from dsauto.runtime.megatron import apply

    plan = make_plan("gpt-tiny", "h100-80gb", nodes=1, gpus_per_node=1, global_batch=8, seq_len=256,
                     engine="megatron", fp8=True)
    m = plan.model
    config = TransformerConfig(num_layers=m.num_layers, hidden_size=m.hidden_size,
                               num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_hidden_size)
    applied = apply(plan, config)
    assert (applied.fp8, applied.fp8_recipe) == ("hybrid", "delayed")
    plain = dataclasses.replace(plan, fp8=False)
    assert apply(plain, applied).fp8 == "hybrid"
    assert "trains in FP8" in caplog.text


def test_fp8_trials_on_cpu_processes_are_refused_before_anything_is_written(tmp_path, capsys):
    from dsauto.cli import main

    out = tmp_path / "out"
    assert main(["tune", "--model", "gpt-tiny", "--hardware", "h100-80gb", "--nodes", "1", "--gpus-per-node", "2",
                 "--fp8", "--trials", "2", "--out", str(out)]) == 2
    assert "Transformer Engine on GPUs with FP8" in capsys.readouterr().err
    assert not out.exists()


def test_tensorwise_scaling_reads_each_cast_input_once_more_and_keeps_no_second_attention_output():
    delayed, (_, block, _), _ = costs(True)
    tensorwise, _, _ = costs(True, recipe="tensorwise")
    inputs = block.linear_input_elements_per_token
    assert fp8_cast_bytes_per_token(block, delayed.context) == 4 * inputs
    assert fp8_cast_bytes_per_token(block, tensorwise.context) == 6 * inputs
    a, b = delayed.layer(block, PLAIN), tensorwise.layer(block, PLAIN)
    assert b.forward_seconds > a.forward_seconds
    # Megatron-core's output projection keeps the 16-bit attention output (save_original_input).
    assert a.activation_bytes - b.activation_bytes == pytest.approx(TOKENS * 4096)


def test_the_recipe_is_pinned_emitted_and_frees_layernorm_recomputation():
    plan = make_plan("llama3-8b", "h100-80gb", global_batch=64, seq_len=8192, fp8=True, fp8_recipe="tensorwise",
                     recompute_modules="layernorm")
    assert (plan.fp8, plan.fp8_recipe) == (True, "tensorwise")
    assert "--fp8-recipe tensorwise" in megatron_args(plan)
    assert plan.layer_choice(1).recompute_modules == ("layernorm",)
    with pytest.raises(DsautoError, match="add --fp8"):
        make_problem("llama3-8b", "h100-80gb", fp8_recipe="tensorwise")


def test_fp8_gemm_speedups_stay_below_transformer_engines_kernel_measurement():
    """Transformer Engine's GEMM profiling guide (docs/examples/gemm_profiling/gemm_profiling.rst,
    'Worked Example: 5B Model on H200'; TE at commit d0067d0, August 2026) times a layer's twelve GEMMs
    (hidden 4096, MLP 16384, 15,872 tokens) with the quantization included on an H200: FP8 delayed
    scaling 1.69x and current scaling 1.58x the BF16 time. The preset's FP8 efficiency is an
    end-to-end figure fitted on training runs (what they lose beyond the GEMMs is in it), so the same
    GEMMs and casts priced with it gain from FP8, delayed scaling more than tensorwise, and not more
    than the kernels alone."""
    from dsauto.cost.terms import matmul_seconds
    from dsauto.spec.model import ModelSpec

    tokens = 15872
    model = ModelSpec(name="te-5b", architecture="decoder", num_layers=24, hidden_size=4096, num_attention_heads=32,
                      ffn_hidden_size=16384, vocab_size=32768, max_position_embeddings=512, mlp="gelu")
    block = layer_groups(model, 512, 2, 1)[1]
    cluster = ClusterSpec(load_hardware("h200"), nodes=1, gpus_per_node=1)
    train = TrainSpec(global_batch=31, seq_len=512, dtype="bf16")

    def gemms(**fp8):  # forward, input gradient and weight gradient: three times the forward
        strategy = Strategy(dims=ParallelDims(dp=1), zero_stage=0, micro_batch=31, grad_accum=1,
                            sequence_parallel=False, engine="megatron", **fp8)
        cost = CostModel(cluster, train, strategy, model.hidden_size)
        casts = cost.memory_seconds(fp8_cast_bytes_per_token(block, cost.context) * tokens)
        return 3 * (matmul_seconds(block, PLAIN, cost.context) + casts)

    bf16 = gemms()
    delayed, tensorwise = bf16 / gemms(fp8=True), bf16 / gemms(fp8=True, fp8_recipe="tensorwise")
    assert 1.2 < tensorwise < delayed <= 1.69
    assert tensorwise <= 1.58


def test_fp8_all_gathers_the_sequence_parallel_inputs_in_fp8():
    from dsauto.cost.terms import tp_comm_seconds

    bf16_sp, (_, block, _), _ = costs(False, tp=2, sp=True)
    fp8_sp, _, _ = costs(True, tp=2, sp=True)
    group = bf16_sp.context.tp_group
    volume = block.tp_comm_bytes_per_token * bf16_sp.tokens / 2  # a layer's two collectives
    assert tp_comm_seconds(block, bf16_sp.context) == pytest.approx(2 * group.all_reduce(volume))
    # The all-gather half of each all-reduce's volume in one byte instead of two.
    assert tp_comm_seconds(block, fp8_sp.context) == pytest.approx(2 * group.all_reduce(volume * 0.75))
    bf16_tp, _, _ = costs(False, tp=2)
    fp8_tp, _, _ = costs(True, tp=2)  # no sequence parallelism: all-reduces of 16-bit outputs
    assert tp_comm_seconds(block, fp8_tp.context) == tp_comm_seconds(block, bf16_tp.context)


def test_fp8_weights_are_gathered_at_one_byte_and_kept_without_a_second_copy():
    from dsauto.cost.terms import data_parallel_cost, sharded_gather_bytes
    from dsauto.cost.terms import Passes

    copies, (_, block, head), _ = costs(True, zero=1)
    weights, _, _ = costs(True, zero=1, param_gather=True)
    bf16, _, _ = costs(False, zero=1)
    # ZeRO 1: the 16-bit weight plus two FP8 copies, against the FP8 weight (data and transpose).
    assert copies.layer(block, PLAIN).params_bytes - weights.layer(block, PLAIN).params_bytes == pytest.approx(
        2 * block.params)
    assert weights.layer(block, PLAIN).params_bytes == pytest.approx(bf16.layer(block, PLAIN).params_bytes)
    # The distributed optimizer's all-gather of the updated weights: one byte a parameter, the head's two.
    idle = Passes(0.0, 0.0)
    group = weights.context.dp_group
    assert data_parallel_cost(block, PLAIN, weights.context, idle, False).step_seconds == pytest.approx(
        group.all_gather(block.params * 1))
    assert data_parallel_cost(block, PLAIN, copies.context, idle, False).step_seconds == pytest.approx(
        group.all_gather(block.params * 2))
    assert data_parallel_cost(head, PLAIN, weights.context, idle, False).step_seconds == pytest.approx(
        data_parallel_cost(head, PLAIN, copies.context, idle, False).step_seconds)
    # Megatron-FSDP's gathered unit: the FP8 weight and its transpose, no 16-bit weight beside them.
    fsdp, _, _ = costs(True, zero=3, param_gather=True)
    assert sharded_gather_bytes(block, SHARDED, fsdp.context) == pytest.approx(2 * block.params * 2)
    # Its shard of an FP8 weight: one byte a parameter over the 8 ranks, half a 16-bit shard.
    sixteen, _, _ = costs(True, zero=3)
    assert fsdp.layer(block, SHARDED).params_bytes == pytest.approx(block.params / 8)
    assert sixteen.layer(block, SHARDED).params_bytes == pytest.approx(2 * block.params / 8)


def test_fp8_weights_are_pinned_emitted_applied_and_need_zero_1_to_3():
    from dsauto.runtime.megatron import ddp_config

    plan = make_plan("llama3-8b", "h100-80gb", global_batch=64, seq_len=8192, fp8=True, fp8_param_gather=True)
    assert plan.fp8_param_gather and plan.zero_stage >= 1
    assert "--fp8-param-gather" in megatron_args(plan)
    assert ddp_config(plan, megatron_fsdp=False).fp8_param_gather
    with pytest.raises(DsautoError, match="add --fp8"):
        make_problem("llama3-8b", "h100-80gb", fp8_param_gather=True)
    with pytest.raises(DsautoError, match="--zero-stage 0 turns off"):
        make_problem("llama3-8b", "h100-80gb", fp8=True, fp8_param_gather=True, zero_stage=0)
    # The search drops the ZeRO 0 strategies rather than emit what Megatron-LM refuses, and says so
    # when nothing else is left (one device: one data-parallel replica).
    with pytest.raises(DsautoError, match="one data-parallel replica"):
        make_plan("llama3-8b", "h100-80gb", nodes=1, gpus_per_node=1, global_batch=8, fp8=True,
                  fp8_param_gather=True)


def test_fp8_trials_need_a_transformer_engine_script_on_gpus(monkeypatch):
    """On GPU ranks (not here: the check that decides is replaced), the built-in harness, whose
    Megatron-core layers are the local ones, cannot measure an FP8 plan; a user's script can."""
    import dsauto.profile.resources as resources
    from dsauto.refine.runner import TrialSettings
    from dsauto.refine.study import TuneSettings, check_trials
    from dsauto.search.planner import Planner

    problem = make_problem("gpt-tiny", "h100-80gb", nodes=1, gpus_per_node=2, fp8=True)
    planner = Planner(problem.model, problem.cluster, problem.train, problem.pins)
    monkeypatch.setattr(resources, "ranks_on_cpu", lambda: False)
    with pytest.raises(DsautoError, match="built-in trial harness"):
        check_trials(planner, TuneSettings(trials=2))
    check_trials(planner, TuneSettings(trials=2, trial=TrialSettings(script=__file__)))
