"""Megatron-core's recomputation of a whole MoE layer's MLP (``moe``) and of its shared experts
(``shared_experts``), as the cost model prices them: what each frees a token, what it runs again in
backward (the all-to-alls included), and the pins and launches that ask for them."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from dsauto.api import find_plans, make_problem
from dsauto.cli import main
from dsauto.cost.layer import CostModel
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import EXPERT_LOAD_IMBALANCE, selective_recompute_seconds
from dsauto.emit.megatron import megatron_args
from dsauto.engines.megatron_args import read_megatron_args
from dsauto.errors import DsautoError
from dsauto.parallel import ParallelDims
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import TrainSpec

H, EXPERTS, TOP_K, FE, FS = 256, 8, 2, 128, 256
MODEL = ModelSpec(name="moe-bench", architecture="decoder", num_layers=4, hidden_size=H, num_attention_heads=4,
                  ffn_hidden_size=1024, vocab_size=4096, max_position_embeddings=256, dropout=False, mlp="swiglu",
                  norm="rmsnorm", linear_bias=False, position_embedding="rope", num_experts=EXPERTS,
                  moe_top_k=TOP_K, moe_ffn_hidden_size=FE, shared_expert_ffn_hidden_size=FS)
TRAIN = TrainSpec(global_batch=16, seq_len=256, dtype="bf16", flash_attention=True)
TOKENS = 2 * 256
CONFIGS = Path(__file__).resolve().parents[1] / "spec" / "configs"


def layer(modules: tuple[str, ...] = (), ep: int = 1, tp: int = 1, model: ModelSpec = MODEL, fp8: bool = False,
          etp: int = 1):
    """One transformer layer of ``model`` on a bf16 Megatron-core plan (micro-batch 2 x 256) recomputing
    ``modules``; its group and its cost."""
    dims = ParallelDims(dp=2, tp=tp, ep=ep, etp=etp)
    strategy = Strategy(dims=dims, zero_stage=1, micro_batch=2, grad_accum=4, sequence_parallel=tp > 1,
                        engine="megatron", recompute_modules=modules, fp8=fp8, fp8_recipe="tensorwise")
    cluster = load_cluster("h100-80gb", nodes=1, gpus_per_node=dims.world_size)
    cost = CostModel(cluster, TRAIN, strategy, model.hidden_size)
    group = layer_groups(model, TRAIN.seq_len, TRAIN.dtype_bytes, tp)[1]
    return group, cost.layer(group, LayerOption(False, False, 1, recompute_modules=modules))


def test_moe_recomputation_frees_everything_the_moe_mlp_keeps_but_its_input():
    """Megatron-core's MoELayer under 'moe' runs its forward inside tensor_parallel.checkpoint, which keeps
    its input alone (the pre-MLP norm's output, kept either way as the norm's): the top-k copies of each
    token going into its experts (h each; Megatron-core weights them by their probabilities inside the
    fused SwiGLU and combines their outputs unweighted, keeping no output), their SwiGLU inner
    activations (gate, up and the weighted product: 3 x the expert width each), the shared experts'
    (3 x their width) and the router's fp32 logits and probabilities (2 x 4 bytes an expert), all in
    bf16 and, at ep 2, at the busiest rank's load for the routed copies."""
    for ep, load in ((1, 1.0), (2, EXPERT_LOAD_IMBALANCE)):
        _, kept = layer(ep=ep)
        _, recomputed = layer(("moe",), ep=ep)
        routed = TOP_K * (3 * FE * 2 + H * 2) * load
        freed = TOKENS * (routed + 3 * FS * 2 + 2 * EXPERTS * 4)
        assert kept.activation_bytes - recomputed.activation_bytes == pytest.approx(freed)
        assert recomputed.transient_bytes - kept.transient_bytes == pytest.approx(freed)  # rebuilt for its backward


def test_moe_recomputation_covers_the_experts_activation_and_the_shared_experts():
    _, whole = layer(("moe",))
    for modules in (("moe", "moe_act"), ("moe", "shared_experts"), ("moe", "moe_act", "shared_experts")):
        _, both = layer(modules)
        assert both.activation_bytes == pytest.approx(whole.activation_bytes)
        assert both.backward_seconds == pytest.approx(whole.backward_seconds)


def test_shared_expert_recomputation_frees_their_inner_activations():
    _, kept = layer()
    _, shared = layer(("shared_experts",))
    assert kept.activation_bytes - shared.activation_bytes == pytest.approx(TOKENS * 3 * FS * 2)
    assert kept.backward_seconds < shared.backward_seconds


def test_under_fp8_the_shared_experts_free_what_they_keep_at_the_mean_load():
    """FP8 keeps the experts' output projections' inputs in one byte each: recomputing the shared experts
    then frees their SwiGLU's three bf16 values less one byte, at the mean load even where the routed
    experts' busiest rank carries 1.1x it (the shared experts take every local token)."""
    _, kept = layer(ep=2, fp8=True)
    _, shared = layer(("shared_experts",), ep=2, fp8=True)
    assert kept.activation_bytes - shared.activation_bytes == pytest.approx(TOKENS * (3 * FS * 2 - FS))


def test_moe_recomputation_runs_the_layer_and_its_all_to_alls_again_in_backward():
    """The recomputed forward is the MoE layer's matrix multiplies (router, routed and shared experts)
    and, at ep > 1, its dispatch and combine again: it costs more than the shared experts' alone and
    than the activation function's alone, and its all-to-alls add to the backward of an expert-parallel
    plan what they take in forward."""
    group, kept = layer(ep=2)
    _, whole = layer(("moe",), ep=2)
    _, act = layer(("moe_act",), ep=2)
    _, shared = layer(("shared_experts",), ep=2)
    added = whole.backward_seconds - kept.backward_seconds
    assert added > shared.backward_seconds - kept.backward_seconds > 0
    assert added > act.backward_seconds - kept.backward_seconds > 0
    assert whole.forward_seconds == pytest.approx(kept.forward_seconds)
    # without expert parallelism there is no exchange to repeat
    _, kept1 = layer(ep=1)
    _, whole1 = layer(("moe",), ep=1)
    assert added > whole1.backward_seconds - kept1.backward_seconds


def test_shared_experts_are_a_tensor_parallel_mlp_of_their_own():
    """An MoE layer's routed experts take their tokens from the sequence-parallel shard, while its shared
    experts (Megatron-core's SharedExpertMLP, a tensor-parallel MLP) gather and reduce-scatter them as a
    dense MLP does: two collectives a layer with shared experts, one (attention's) without; recomputing
    them at tp 2 runs theirs again."""
    group, _ = layer()
    assert (group.tp_comm_bytes_per_token, group.tp_collectives) == (2 * H * 2, 2)
    routed_only = layer_groups(dataclasses.replace(MODEL, shared_expert_ffn_hidden_size=0), 256, 2)[1]
    assert (routed_only.tp_comm_bytes_per_token, routed_only.tp_collectives) == (H * 2, 1)
    group2, _ = layer(tp=2)
    ctx = CostModel(load_cluster("h100-80gb", nodes=1, gpus_per_node=4), TRAIN,
                    Strategy(dims=ParallelDims(dp=2, tp=2), zero_stage=1, micro_batch=2, grad_accum=4,
                             sequence_parallel=True, engine="megatron"), H).context
    collective = ctx.tp_group.all_reduce(H * 2 * TOKENS)  # the shared experts' one MLP's worth, every layer MoE
    for modules in (("shared_experts",), ("moe",)):
        option = LayerOption(False, False, 1, recompute_modules=modules)
        without = dataclasses.replace(group2, moe_layer_fraction=0.0)  # no layer's shared experts to gather
        assert selective_recompute_seconds(group2, option, ctx) - selective_recompute_seconds(without, option, ctx) \
            == pytest.approx(collective)


def test_a_model_without_shared_experts_refuses_their_recomputation():
    plain = dataclasses.replace(MODEL, shared_expert_ffn_hidden_size=0)
    problem = make_problem(plain, "h100-80gb", nodes=1, gpus_per_node=8, global_batch=16, seq_len=256,
                           engine="megatron", recompute_modules="shared_experts")
    with pytest.raises(DsautoError, match="recomputes an MoE layer's shared experts, and the model has none"):
        find_plans(problem)


@pytest.mark.parametrize(("pins", "message"), [
    (dict(engine="deepspeed"), "'moe' is Megatron-core's recomputation of its MoE layers' whole MLP"),
    (dict(engine="megatron", expert_a2a_overlap=True, ep=8),
     "overlapped schedule runs an MoE layer's parts one by one and never recomputes it whole"),
])
def test_pins_the_engine_cannot_run_with_moe_recomputation_are_refused(pins, message):
    problem = make_problem(MODEL, "h100-80gb", nodes=1, gpus_per_node=8, global_batch=16, seq_len=256,
                           recompute_modules="moe", **pins)
    with pytest.raises(DsautoError, match=message):
        find_plans(problem)


def test_a_pinned_moe_recomputation_is_planned_and_emitted():
    """A mixture of experts on 8 H100s with 'moe' pinned: every layer recomputes it and the launch says so."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = find_plans(make_problem(MODEL, "h100-80gb", nodes=1, gpus_per_node=8, global_batch=16, seq_len=256,
                                       engine="megatron", recompute_modules="moe"))[0]
    assert plan.uniform_recompute_modules() == ("moe",)
    lines = megatron_args(plan)
    assert "--recompute-granularity selective" in lines and "--recompute-modules moe" in lines


def test_megatron_lms_deprecated_moe_layer_recompute_flag_reads_as_moe(tmp_path):
    """Megatron-core's TransformerConfig turns --moe-layer-recompute into selective recomputation with
    'moe' added to the modules, and refuses it beside full recomputation."""
    base = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 1024 --seq-length 256 "
            "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 16 --bf16 "
            "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 --swiglu --disable-bias-linear "
            "--normalization RMSNorm --position-embedding-type rope --hidden-dropout 0 --attention-dropout 0 "
            "--untie-embeddings-and-output-weights --vocab-size 4096 --moe-token-dispatcher-type alltoall ")
    path = tmp_path / "args.txt"
    path.write_text(base + "--moe-layer-recompute")
    launch = read_megatron_args(path)
    assert launch.pins["recompute_modules"] == "core_attn,moe"
    path.write_text(base + "--moe-layer-recompute --recompute-granularity selective --recompute-modules mla_up_proj moe")
    assert read_megatron_args(path).pins["recompute_modules"] == "mla_up_proj,moe"
    dense = base.replace("--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 ", "").replace(
        "--moe-token-dispatcher-type alltoall ", "")
    path.write_text(dense + "--moe-layer-recompute")  # Megatron-core's 'moe' finds no MoE layer to recompute
    assert read_megatron_args(path).pins["recompute_modules"] == "core_attn"
    path.write_text(base + "--moe-layer-recompute --recompute-granularity full --recompute-method block "
                           "--recompute-num-layers 1")
    with pytest.raises(DsautoError, match="--moe-layer-recompute with --recompute-granularity full"):
        read_megatron_args(path)


def test_a_plan_for_hugging_faces_trainer_names_the_trainer_as_what_refuses_moe(capsys):
    """--for hf runs DeepSpeed whatever --engine says, so the fix is not --engine megatron."""
    assert main(["plan", "--model", str(CONFIGS / "mixtral-8x7b.json"), "--hardware", "h100-80gb", "--nodes", "1",
                 "--for", "hf", "--recompute-modules", "moe"]) == 2
    error = capsys.readouterr().err.strip()
    assert "Hugging Face's Trainer runs DeepSpeed, which does not recompute moe (Megatron-core's); drop it, or " \
           "plan without --for hf." in error and len(error.splitlines()) == 1


@pytest.mark.parametrize("mlp, unfused_widths", [("swiglu", 0), ("gelu", 1), ("geglu", 3)])
def test_megatron_core_weights_the_routed_copies_inside_the_experts(mlp, unfused_widths):
    """Megatron-core (0.13 on) multiplies each routed copy by its router probability inside the experts
    and combines their outputs unweighted, so a copy keeps its input and its inner activations but no
    output (h fewer than the engine-neutral count, which keeps the output for a weighted combine, as
    DeepSpeed-MoE's einsum does); an unfused activation (all but SwiGLU) keeps its output beside the
    weighted copy, and a gated one (GeGLU) also the up projection plus its offset and their product.
    Measured on two CPU ranks: benchmarks/megatron_memory.py, the ep2 plans (GeLU and GeGLU experts)."""
    model = dataclasses.replace(MODEL, mlp=mlp, shared_expert_ffn_hidden_size=0)
    group, megatron = layer(model=model)
    engine_neutral = TOP_K * ((3 if mlp != "gelu" else 2) * FE + 2 * H) * 2  # bf16, each copy
    assert group.expert_act_bytes_per_token == engine_neutral
    strategy = Strategy(dims=ParallelDims(dp=2), zero_stage=1, micro_batch=2, grad_accum=4, sequence_parallel=False,
                        engine="deepspeed")
    deepspeed = CostModel(load_cluster("h100-80gb", nodes=1, gpus_per_node=2), TRAIN, strategy, H).layer(
        group, LayerOption(False, False, 1))
    change = TOKENS * TOP_K * (unfused_widths * FE - H) * 2
    # DeepSpeed's count keeps Hugging Face's fp32 RMSNorm work and its gated experts' activation
    # outputs besides (LayerGroup.unfused_*)
    unfused = TOKENS * group.unfused_bytes_per_token
    assert megatron.activation_bytes - deepspeed.activation_bytes == pytest.approx(change - unfused)
    # 'moe' frees what the copies keep; 'moe_act' the activation's output and, unfused, what the
    # weighting and the gated product keep (Megatron-core checkpoints them together: bias_act_func).
    _, whole = layer(("moe",), model=model)
    _, act = layer(("moe_act",), model=model)
    freed = TOKENS * TOP_K * (1 + unfused_widths) * FE * 2
    assert megatron.activation_bytes - act.activation_bytes == pytest.approx(freed)
    inner = 3 if mlp != "gelu" else 2
    freed = TOKENS * (TOP_K * ((inner + unfused_widths) * FE + H) * 2 + 2 * EXPERTS * 4)
    assert megatron.activation_bytes - whole.activation_bytes == pytest.approx(freed)


def test_gpt_oss_clamped_gate_keeps_the_first_matrix_output_and_its_clamped_copy():
    """gpt-oss's gate (glu_clamp) runs in Megatron-core's fused weighted quick-GeGLU, but clamps both
    halves and concatenates them before it (fusions/fused_bias_geglu.py, weighted_bias_quick_geglu_impl):
    the clamps keep the first matrix's output and the fused function the clamped copy, two widths a
    routed copy beyond SwiGLU's."""
    swiglu = dataclasses.replace(MODEL, shared_expert_ffn_hidden_size=0)
    clamped = dataclasses.replace(swiglu, glu_clamp=7.0)
    _, plain = layer(model=swiglu)
    _, gate = layer(model=clamped)
    assert gate.activation_bytes - plain.activation_bytes == pytest.approx(TOKENS * TOP_K * 2 * FE * 2)


def test_under_fp8_a_routed_copy_keeps_its_input_in_one_byte():
    """Transformer Engine's grouped linear layers keep their inputs for the weight gradient in FP8: a
    routed copy's input (h) and its second matrix's input (the expert width), one byte each; 'moe'
    frees them at that size."""
    for ep, load in ((1, 1.0), (2, EXPERT_LOAD_IMBALANCE)):
        _, kept = layer(ep=ep, fp8=True)
        _, recomputed = layer(("moe",), ep=ep, fp8=True)
        routed = TOP_K * (3 * FE * 2 + H * 2 - (FE + H)) * load
        freed = TOKENS * (routed + 3 * FS * 2 - FS + 2 * EXPERTS * 4)
        assert kept.activation_bytes - recomputed.activation_bytes == pytest.approx(freed)


def test_expert_tensor_parallelism_keeps_every_gathered_copy_as_input():
    """Under expert tensor parallelism an expert's etp ranks all-gather the copies they received
    (token_dispatcher.py, over the expert tensor-parallel group) and each keeps all of them as its first
    matrix's input, while the inner activations split etp ways: etp times the copies' inputs of etp 1,
    which 'moe' frees too."""
    for fp8, kept_bytes in ((False, 2), (True, 1)):
        _, one = layer(tp=2, ep=2, fp8=fp8)
        _, two = layer(tp=2, ep=2, etp=2, fp8=fp8)
        gathered = TOKENS / 2 * TOP_K * H * kept_bytes * EXPERT_LOAD_IMBALANCE
        assert two.activation_bytes - one.activation_bytes == pytest.approx(gathered)
        _, one_moe = layer(("moe",), tp=2, ep=2, fp8=fp8)
        _, two_moe = layer(("moe",), tp=2, ep=2, etp=2, fp8=fp8)
        assert two_moe.activation_bytes == pytest.approx(one_moe.activation_bytes)


def test_probabilities_on_the_input_keep_the_unweighted_copy():
    """Llama 4 weights a routed copy's input by its probability (moe_apply_probs_on_input): the multiply
    keeps the unweighted copy beside the weighted one the first matrix keeps, two h a copy, as the
    engine-neutral count has them."""
    model = dataclasses.replace(MODEL, moe_top_k=1, moe_probs_on_input=True, shared_expert_ffn_hidden_size=0)
    group, megatron = layer(model=model)
    assert group.megatron_expert_extra_bytes_per_token == H * 2  # top 1
    from dsauto.cost.terms import megatron_routed_copy_change_bytes_per_token
    assert megatron_routed_copy_change_bytes_per_token(group) == 0
    _, act = layer(("moe_act",), model=model)  # the input's multiply runs before the checkpointed activation
    assert megatron.activation_bytes - act.activation_bytes == pytest.approx(TOKENS * FE * 2)


def test_under_fp8_an_moe_layer_keeps_its_mlp_input_in_16_bits_for_the_router():
    """The router keeps the pre-MLP norm's output in 16 bits (RouterGatingLinearFunction), so FP8 saves
    nothing on it in an MoE layer, and a shared expert's first matrix keeps an FP8 copy beside it."""
    from dsauto.cost.terms import fp8_activation_change_bytes_per_token

    dense = dataclasses.replace(MODEL, num_experts=0, moe_top_k=0, moe_ffn_hidden_size=0,
                                shared_expert_ffn_hidden_size=0)
    group_dense, _ = layer(model=dense, fp8=True)
    group_moe, _ = layer(fp8=True)
    strategy = Strategy(dims=ParallelDims(dp=2), zero_stage=1, micro_batch=2, grad_accum=4, sequence_parallel=False,
                        engine="megatron", fp8=True, fp8_recipe="tensorwise")
    ctx = CostModel(load_cluster("h100-80gb", nodes=1, gpus_per_node=2), TRAIN, strategy, H).context
    norms_dense = -fp8_activation_change_bytes_per_token(group_dense, ctx) - group_dense.mlp_act_bytes_per_token / 3 / 2
    assert norms_dense == pytest.approx(2 * H)  # both norms' outputs, one byte saved an element
    # ep 1 (the mean load): the routed copies' inputs to both matrices and the shared expert's second
    # matrix's save a byte an element; the norms' outputs 2h less the MLP input's h, which stays in 16
    # bits, less the shared expert's FP8 copy of it (h): none
    change = fp8_activation_change_bytes_per_token(group_moe, ctx)
    assert change == pytest.approx(-(TOP_K * (FE + H) + FS))
