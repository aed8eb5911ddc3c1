"""Megatron-core's multi-token-prediction layers (ModelSpec.mtp_layers) as the cost model prices them:
the state the last pipeline stage holds for them, the peaks measured with Megatron-core on CPU ranks,
the kind of layer they are, and that a DeepSpeed plan, which trains the transformers model, leaves
them out."""

from __future__ import annotations

import dataclasses

import pytest

from dsauto.cost.layer import CostModel
from dsauto.cost.step import predict_step
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import TrainSpec

# The GPT of benchmarks/megatron_memory.py with an untied head, rotary positions and one prediction layer
# (its mtp1 plans).
MODEL = ModelSpec(name="bench-gpt", architecture="decoder", num_layers=4, hidden_size=256, num_attention_heads=4,
                  ffn_hidden_size=1024, vocab_size=4096, max_position_embeddings=256, dropout=False,
                  tied_embeddings=False, position_embedding="rope", mtp_layers=1)
PLAIN = dataclasses.replace(MODEL, mtp_layers=0)
TRAIN = TrainSpec(global_batch=8, seq_len=256, dtype="bf16", flash_attention=False)
KEEP, RECOMPUTE = LayerOption(False, False, 1), LayerOption(True, False, 1)
H = 256


def strategy(engine: str = "megatron", tp: int = 1, pp: int = 1) -> Strategy:
    return Strategy(dims=ParallelDims(tp=tp, pp=pp), zero_stage=0, micro_batch=2, grad_accum=4,
                    sequence_parallel=False, engine=engine)


def predict(model: ModelSpec, case: Strategy, recompute: bool = False):
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=case.tp * case.pp)
    options = [RECOMPUTE if recompute and 1 <= j <= model.num_layers else KEEP for j in range(model.num_layers + 2)]
    return predict_step(model, cluster, TRAIN, case, [model.num_layers // case.pp] * case.pp, options)


def test_the_last_stage_holds_the_prediction_layer_and_an_embedding_for_its_lookups():
    """Megatron-core's last stage of an untied model with one prediction layer (GPTModel with an
    mtp_block_spec, megatron/core/transformer/multi_token_prediction.py): the layer (a GPT layer, 12h^2
    + 13h), its 2h x h projection without bias, its three LayerNorms (enorm, hnorm, final_layernorm:
    2h each) and an embedding (its word table; rotary positions have no table) for the next tokens'
    lookups, in bf16 with fp32 main gradients and Adam (2 + 4 + 12 bytes a parameter); the first stage
    is unchanged."""
    with_mtp, without = predict(MODEL, strategy(pp=2)), predict(PLAIN, strategy(pp=2))
    added = (12 * H * H + 13 * H) + 2 * H * H + 3 * 2 * H + 4096 * H
    assert with_mtp.stages[1].params_bytes - without.stages[1].params_bytes == 2 * added
    assert with_mtp.stages[1].grads_bytes - without.stages[1].grads_bytes == 4 * added
    assert with_mtp.stages[1].optimizer_bytes - without.stages[1].optimizer_bytes == 12 * added
    assert with_mtp.stages[0] == without.stages[0]
    # one stage: the embedding is the rank's own, no copy
    one, plain = predict(MODEL, strategy()), predict(PLAIN, strategy())
    assert one.stages[0].params_bytes - plain.stages[0].params_bytes == 2 * (added - 4096 * H)


# Peaks of live tensor bytes measured by benchmarks/megatron_memory.py (Megatron-core 0.16.1, bf16, two
# CPU ranks; benchmarks/results/megatron_memory.md, the mtp1 plans), largest rank.
MEASURED = {("pp2", False): 135_942_836, ("tp2", False): 94_314_420, ("pp2", True): 120_337_076}


@pytest.mark.parametrize(("plan", "recompute"), sorted(MEASURED))
def test_predicted_peaks_with_a_prediction_layer_are_within_3_percent_of_megatron_cores(plan, recompute):
    """The peak is the last stage's main loss: the prediction layer's kept activations, its fp32
    softmax (kept by its own loss for backward), the hidden states the block returns joined with the
    main ones, and its logits, still referenced while the main loss runs."""
    case = strategy(pp=2) if plan == "pp2" else strategy(tp=2)
    measured = MEASURED[plan, recompute]
    assert abs(predict(MODEL, case, recompute).prediction.peak_memory_bytes - measured) / measured <= 0.03


def test_under_whole_layer_recomputation_the_prediction_layer_keeps_what_it_measured():
    """Megatron-core's prediction layer checkpoints itself under recompute_method uniform only and
    skips it under block ("not supported for MTP yet": MultiTokenPredictionLayer._checkpointed_forward),
    the method dsauto's plans run: checkpointing every layer lowered the last stage's measured peak by
    the two decoder layers' activations alone (14.88 MiB measured; 14.52 MiB priced, the prediction
    layer's 8.76 MiB of activations kept either way)."""
    kept = predict(MODEL, strategy(pp=2)).stages[1].peak_bytes
    recomputed = predict(MODEL, strategy(pp=2), recompute=True).stages[1].peak_bytes
    assert (kept - recomputed) / 2**20 == pytest.approx((135_942_836 - 120_337_076) / 2**20, abs=0.5)


def test_a_deepspeed_plan_prices_the_head_without_the_prediction_layers():
    """transformers builds no multi-token-prediction layer, so DeepSpeed's head costs what it costs
    without them; Megatron-core's adds the layer's passes."""
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=1)
    for engine, same in (("deepspeed", True), ("megatron", False)):
        cost = CostModel(cluster, TRAIN, strategy(engine), H)
        heads = [layer_groups(m, 256, 2)[2] for m in (MODEL, PLAIN)]
        priced = [cost.layer(head, KEEP) for head in heads]
        assert (priced[0] == priced[1]) is same
        if not same:
            assert priced[0].forward_seconds > priced[1].forward_seconds
            assert priced[0].activation_bytes > priced[1].activation_bytes


def test_the_prediction_layer_is_of_the_stacks_last_kind():
    """DeepSeek-V3's first layers are dense and the rest MoE; its prediction layer is an MoE layer, as
    get_gpt_mtp_block_spec takes the decoder's last layer spec."""
    moe = ModelSpec(name="moe", architecture="decoder", num_layers=4, hidden_size=256, num_attention_heads=4,
                    ffn_hidden_size=1024, vocab_size=4096, max_position_embeddings=256, mlp="swiglu",
                    norm="rmsnorm", position_embedding="rope", tied_embeddings=False, linear_bias=False,
                    num_experts=8, moe_top_k=2, moe_ffn_hidden_size=128, moe_first_dense_layers=1, mtp_layers=1)
    embedding, block, head = layer_groups(moe, 256, 2)
    assert 0 < block.moe_layer_fraction < 1
    assert head.mtp_block is not None and head.mtp_block.moe_layer_fraction == 1
    assert head.mtp_block.expert_params == 8 * 3 * 256 * 128
    assert head.mtp_block.params == layer_groups(moe, 256, 2, moe_fraction=1.0)[1].params + 2 * H * H + 3 * H
    assert head.mtp_embedding is not None and head.mtp_embedding.params == 4096 * H  # rotary: no position table


def test_a_deepspeed_plan_of_a_model_with_prediction_layers_says_it_leaves_them_out():
    from dsauto.api import make_plan
    from dsauto.errors import DsautoWarning

    with pytest.warns(DsautoWarning, match="multi-token-prediction layer.s. are not in the DeepSpeed plan: "
                                           "transformers, which DeepSpeed trains, does not build them"):
        plan = make_plan(MODEL, "cpu", nodes=1, gpus_per_node=2, global_batch=8, seq_len=256, engine="deepspeed")
    assert plan.engine == "deepspeed"


def test_the_plans_description_names_the_prediction_layers_beside_the_head():
    from dsauto.api import make_plan
    from dsauto.describe import describe_plan
    from dsauto.units import format_count

    plan = make_plan(MODEL, "cpu", nodes=1, gpus_per_node=2, global_batch=8, seq_len=256, engine="megatron", pp=2)
    assert "5 = head with 1 multi-token-prediction layer and its loss)" in describe_plan(plan)
    # the layer (12h^2 + 13h), its projection (2h^2) and its three norms (2h each)
    mtp = 12 * H * H + 13 * H + 2 * H * H + 3 * 2 * H
    assert describe_plan(plan).splitlines()[0].endswith(f"parameters and {format_count(mtp)} in its multi-token "
                                                        f"prediction")
    assert "= head)" in describe_plan(make_plan(PLAIN, "cpu", nodes=1, gpus_per_node=2, global_batch=8, seq_len=256,
                                                engine="megatron", pp=2))


def test_the_reported_flops_count_the_prediction_layers_as_megatron_lm_does():
    """Megatron-LM's FLOPs count includes the prediction layers (megatron/training/training.py,
    num_floating_point_operations); so do the plan's MFU and TFLOP/s, which would otherwise fall with a
    step the layers lengthen."""
    from dsauto.api import make_plan

    plans = [make_plan(m, "cpu", nodes=1, gpus_per_node=2, global_batch=8, seq_len=256, engine="megatron", tp=2)
             for m in (MODEL, PLAIN)]
    assert plans[0].prediction.step_seconds > 1.3 * plans[1].prediction.step_seconds
    assert plans[0].prediction.mfu == pytest.approx(plans[1].prediction.mfu, rel=0.05)


def test_a_tied_head_with_prediction_layers_is_not_pipelined_on_megatron_core():
    """Megatron-core's last stage of a tied head with prediction layers holds an output weight that gets
    no gradient, which the overlapped gradient reduction refuses (measured: _ParamAndGradBucketGroup.reset's
    assertion at the second step): such plans are not searched, and a pinned --pp says why."""
    from dsauto.api import make_plan
    from dsauto.errors import DsautoError

    tied = dataclasses.replace(MODEL, tied_embeddings=True)
    plan = make_plan(tied, "cpu", nodes=1, gpus_per_node=2, global_batch=8, seq_len=256, engine="megatron")
    assert plan.pp == 1
    with pytest.raises(DsautoError, match="--pp 2 cannot run bench-gpt on Megatron-core: Megatron-core's last "
                                          "pipeline stage of a tied head with multi-token-prediction layers holds "
                                          "an output weight that gets no gradient"):
        make_plan(tied, "cpu", nodes=1, gpus_per_node=2, global_batch=8, seq_len=256, engine="megatron", pp=2)


def test_prediction_layers_need_rotary_positions_as_megatron_lm_asserts():
    with pytest.raises(ValueError, match="mtp_layers needs rotary positions .position_embedding rope., as "
                                         "Megatron-LM runs multi-token prediction with no others, got learned"):
        dataclasses.replace(MODEL, position_embedding="learned")


def test_a_profile_prices_the_model_with_or_without_its_prediction_layers(tmp_path):
    """A profile measures the transformer layers, never the prediction layers: its key and its match
    leave them out, so a launch with or without them, and profiles made before dsauto read them, find it."""
    from dsauto.profile.store import profile_key, profiled_model

    assert profile_key(MODEL, "cpu", "bf16", 256, {}) == profile_key(PLAIN, "cpu", "bf16", 256, {})
    assert profiled_model(MODEL) == PLAIN and profiled_model(PLAIN) is PLAIN
    from dsauto.profile.store import Profile, find_profile, save_profile, software_versions

    save_profile(Profile(model=PLAIN, device="cpu", dtype="bf16", seq_len=256, threads=1,
                         versions=software_versions(), layers=(), optimizer_seconds_per_param=1e-9), tmp_path)
    assert find_profile(tmp_path, MODEL, "bf16", 256).model == PLAIN  # the model with the layer finds it


def test_an_interleaved_schedule_that_lengthens_the_bubble_says_what_it_costs():
    """Where the interleaved schedule's bubble comes out longer than plain 1F1B's (uneven chunks: a
    heavy last chunk), the description says what it costs, not a negative saving."""
    from dsauto.api import make_plan
    from dsauto.describe import describe_plan

    plan = make_plan(PLAIN, "cpu", nodes=1, gpus_per_node=2, global_batch=8, seq_len=256, engine="megatron", pp=2,
                     vpp=2, micro_batch=1)
    longer = dataclasses.replace(plan, prediction=dataclasses.replace(
        plan.prediction, bubble_seconds=2.5, plain_bubble_seconds=1.0))
    line = next(line for line in describe_plan(longer).splitlines() if "interleaved 1F1B" in line)
    assert line.endswith("bubble 2.500 s instead of 1.000 s with plain 1F1B (costs 1.500 s more)")
    line = next(line for line in describe_plan(plan).splitlines() if "interleaved 1F1B" in line)
    assert "(saves " in line


def test_an_interleaved_last_stage_leaves_its_last_chunk_to_the_head_and_the_prediction_layer():
    """The layout search lets the last stage hold a single layer, so that under 2 chunks a rank its
    last chunk holds only the head and the prediction layer, as NVIDIA's DeepSeek-V3 layouts place
    them ("...|mL"): the prediction layer then costs the interleaved step a few percent (its bubble:
    1.4 s more at 47 s with the selective recomputation the plans fit), where a layer beside them made
    the last chunk the slowest."""
    import warnings

    from dsauto.api import make_plan
    from dsauto.emit.megatron import megatron_args
    from dsauto.errors import DsautoWarning
    from dsauto.spec.loaders import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        model = load_model("tests/spec/configs/deepseek-v3.json")
        plans = [make_plan(m, "h100-80gb", nodes=128, gpus_per_node=8, global_batch=8192, seq_len=4096,
                           engine="megatron", tp=2, pp=16, ep=64, micro_batch=1, vpp=2)
                 for m in (model, dataclasses.replace(model, mtp_layers=0))]
    assert plans[0].stage_layers[-1] == 1
    layout = next(line for line in megatron_args(plans[0]) if line.startswith("--pipeline-model-parallel-layout"))
    assert layout.endswith("|mL'")
    assert plans[0].prediction.step_seconds <= 1.035 * plans[1].prediction.step_seconds
