"""dsauto.megatron: the plan mapped onto Megatron-core, checked by Megatron-core itself.

The first tests call the mapping in this process (it needs no process group). The others train the
GPT of examples/megatron/train_gpt.py with real Megatron-core modules on CPU ranks (gloo, through
dsauto.compat.megatron_cpu) under several plans, all on the same weights and global batch, and
compare with a TP=1, PP=1 run.

Tolerance of the loss comparisons: 1e-5 relative (6e-5 at these losses of about 6). The runs compute
the same fp32 arithmetic in a different order only: tensor parallelism sums partial matmuls and
all-reduces them, data parallelism reduce-scatters gradients, a pipeline all-reduces the gradients
of the tied embedding across its end stages. Each reordering changes a sum by a few units in the last
place (fp32 has 24 bits; one ulp of a loss of 6 is 4.8e-7), and over 4 or 5 Adam steps the measured
differences stay at one or two ulps (at most 9.5e-7, TP=2 x PP=2 and DeepSpeed ZeRO over TP=2). Any real fault (a wrong shard, a gradient not
reduced, a layer on the wrong stage, a recomputation that replays other values) changes the update,
and the loss moves by 1e-2 to 1e-1 per step here, so it shows up 100 times above the tolerance.

The interleaved pipeline (pp 2 with 2 or 4 model chunks per rank, also under tp 2 or dp 2) reorders
no sum beyond those, and so is held to the same tolerance. Its fault of this kind shows up as well:
with Megatron-core's default batched sends at pp 2, which swap a rank's activations and gradients
(see dsauto.megatron.apply), the 8-layer model's first loss was already 1.3e-3 (2e-4 relative, 20
times the tolerance) off and its fourth 3.4e-2.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_launch import MICRO_BATCH, SEQ_LEN, TINY, launch, make_plan

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnBackend, LayerType
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

import dsauto.megatron as dm
from dsauto.emit.ds_config import write_ds_config
from dsauto.errors import DsautoError
from dsauto.plan_io import write_plan_yaml
from dsauto.runtime.megatron import pipeline_layout_fields
from dsauto.spec.model import ModelSpec

pytestmark = [
    # TransformerConfig warns about a CUDA-graph default that has nothing to do with these tests,
    pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning"),
    # and on every selective recomputation of core_attn, in case the attention is a fused one.
    pytest.mark.filterwarnings("ignore:If you are using transformer_engine:UserWarning"),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "train_gpt.py"

RTOL = 1e-5
"""Relative tolerance of loss comparisons between parallel layouts; see the module docstring."""

TINY8 = ModelSpec(**{**TINY.__dict__, "name": "gpt-test-8", "num_layers": 8})
"""The test GPT with 8 layers: 2 per model chunk with pp 2 and 2 virtual stages, so that block
recomputation of each chunk's first layer is not recomputation of whole chunks."""


def config_for(model: ModelSpec = TINY, **kwargs) -> TransformerConfig:
    return TransformerConfig(**dm.transformer_config_kwargs(model), **kwargs)


def layers_per_stage(config: TransformerConfig) -> list[int]:
    """Transformer layers Megatron-core builds on each pipeline stage for ``config``."""
    if config.pipeline_model_parallel_layout is not None:
        return [stage[0].count(LayerType.decoder) for stage in config.pipeline_model_parallel_layout.layout]
    return [get_num_layers_to_build(config, pp_rank=s) for s in range(config.pipeline_model_parallel_size)]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("dsauto")]


# --- the mapping, in this process ------------------------------------------------------------------

def test_apply_sets_the_parallel_layout_and_dtype():
    plan = make_plan(tp=2, pp=2)
    config = dm.apply(plan, config_for())
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (2, 2)
    assert config.sequence_parallel and plan.sequence_parallel
    assert config.params_dtype == config.pipeline_dtype and str(config.params_dtype) == "torch.float32"
    assert not dm.apply(make_plan(tp=2, sequence_parallel=False), config_for()).sequence_parallel


@pytest.mark.parametrize("stages", [(1, 3), (3, 1), (0, 4), (4, 0), (2, 2), (1, 2, 1), (1, 1, 2),
                                    (0, 2, 2), (2, 0, 1, 1), (1, 1, 1, 1)])
def test_pipeline_layout_builds_exactly_the_planned_layers(stages):
    # The layout fields alone: dsauto's cost model does not price a middle stage without layers yet.
    config = dataclasses.replace(config_for(), pipeline_model_parallel_size=len(stages),
                                 pipeline_dtype=torch.float32, **pipeline_layout_fields(stages))
    assert layers_per_stage(config) == list(stages)


def test_first_and_last_stage_counts_when_they_suffice_else_the_layout_string():
    config = dm.apply(make_plan(pp=2, stage_layers=(1, 3)), config_for())
    assert (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage) == (1, 3)
    assert layers_per_stage(config) == [1, 3]
    config = dm.apply(make_plan(pp=2, stage_layers=(0, 4)), config_for())
    assert layers_per_stage(config) == [0, 4]
    assert dm.apply(make_plan(pp=2), config_for()).num_layers_in_first_pipeline_stage is None
    assert pipeline_layout_fields((0, 4))["pipeline_model_parallel_layout"] == "E|t*4L"
    assert pipeline_layout_fields((2, 0, 1, 1))["pipeline_model_parallel_layout"] == "Et*2||t|tL"


@pytest.mark.parametrize(("stages", "virtual", "chunks"), [((4, 4), 2, None), ((3, 5), 2, None), ((4, 4), 4, None),
                                                            ((5, 3), 4, None), ((4, 4), 2, (1, 3, 3, 1)),
                                                            ((5, 3), 4, (0, 0, 2, 1, 2, 1, 1, 1))])
def test_an_interleaved_plan_gives_the_layout_megatron_reads_back(monkeypatch, stages, virtual, chunks):
    plan = make_plan(pp=2, stage_layers=stages, virtual_stages=virtual, model=TINY8, chunk_layout=chunks)
    config = dm.apply(plan, config_for(TINY8))
    layout = config.pipeline_model_parallel_layout  # Megatron's parse of the layout string
    assert config.virtual_pipeline_model_parallel_size == layout.virtual_pipeline_model_parallel_size == virtual
    # The layout asks the process groups for the virtual size: the one initialize_model_parallel sets.
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: virtual)
    # Megatron's 0-based layer ids of chunk (vp_stage s, pp_rank r), in chunk order s * pp + r.
    built = [[i + 1 for i in layout.get_layer_id_list(vp_stage=s, pp_rank=r)]
             for s in range(virtual) for r in range(2)]
    assert built == [list(layers) for layers in plan.stage_ranges()]
    assert LayerType.embedding in layout.layout[0][0] and LayerType.loss in layout.layout[-1][-1]
    # Megatron-LM's point-to-point settings for the interleaved schedule (see apply).
    assert config.overlap_p2p_comm and not config.batch_p2p_comm
    assert config.microbatch_group_size_per_vp_stage == 2


@pytest.mark.parametrize(("stages", "virtual", "layout"), [((2, 1, 2, 3), 1, "Et*2|t|t*2|t*3mL"),
                                                            ((4, 4), 2, "Et*2|t*2|t*2|t*2mL")])
def test_multi_token_prediction_layers_reach_the_config_and_megatrons_layout(stages, virtual, layout):
    """A model with a multi-token-prediction layer: mtp_num_layers in the TransformerConfig, and a
    layout string with the layer on the last stage, before the loss, which Megatron's
    PipelineParallelLayerLayout reads back and validates against mtp_num_layers (in the config's
    __post_init__); the plan's checks refuse a config without it."""
    model = dataclasses.replace(TINY8, mtp_layers=1, tied_embeddings=False, position_embedding="rope")
    plan = make_plan(pp=len(stages), stage_layers=stages, virtual_stages=virtual, model=model)
    config = dm.apply(plan, config_for(model))
    assert config.mtp_num_layers == 1
    parsed = config.pipeline_model_parallel_layout
    assert pipeline_layout_fields(stages, virtual, 1)["pipeline_model_parallel_layout"] == layout
    assert parsed.layout[-1][-1][-2:] == [LayerType.mtp, LayerType.loss]
    assert sum(chunk.count(LayerType.mtp) for rank in parsed.layout for chunk in rank) == 1
    with pytest.raises(DsautoError, match="mtp_num_layers=None but the plan was made for"):
        dm.apply(plan, config_for(dataclasses.replace(model, mtp_layers=0)))


def test_megatron_lms_deprecated_moe_layer_recompute_gives_way_to_the_plan(caplog):
    """A config built from a launch with --moe-layer-recompute (TransformerConfig.moe_layer_recompute, which
    its __post_init__ turns into selective recomputation with 'moe' added, and refuses beside full
    recomputation) recomputes what the plan says: nothing, or the first layer of each stage whole."""
    config = config_for(recompute_granularity="selective", moe_layer_recompute=True)
    assert config.recompute_modules == ["core_attn", "moe"]
    plain = dm.apply(make_plan(), config)
    assert not plain.moe_layer_recompute and plain.recompute_granularity is None
    assert any("moe_layer_recompute" in w for w in warnings_of(caplog))
    full = dm.apply(make_plan(pp=2, checkpoint=(1, 3)), config)
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "block", 1)


def test_the_shared_experts_overlap_gives_way_to_their_recomputation(caplog):
    """Megatron-core refuses moe_shared_expert_overlap beside the shared experts' recomputation: a config
    with the overlap on trains a plan recomputing them with the overlap off, said in a warning."""
    model = dataclasses.replace(TINY, name="shared-moe", num_experts=4, moe_top_k=2, moe_ffn_hidden_size=128,
                                shared_expert_ffn_hidden_size=128, linear_bias=False)
    config = config_for(model, moe_shared_expert_overlap=True)
    applied = dm.apply(make_plan(model=model, recompute_modules=("shared_experts",)), config)
    assert not applied.moe_shared_expert_overlap and "shared_experts" in applied.recompute_modules
    assert any("moe_shared_expert_overlap" in w for w in warnings_of(caplog))
    assert dm.apply(make_plan(model=model), config).moe_shared_expert_overlap  # kept where nothing refuses it


def test_a_plan_without_interleaving_turns_overlapped_sends_off():
    # Megatron-core's non-interleaved schedules refuse overlap_p2p_comm.
    config = dm.apply(make_plan(pp=2), config_for(overlap_p2p_comm=True, batch_p2p_comm=False))
    assert config.virtual_pipeline_model_parallel_size is None
    assert not config.overlap_p2p_comm and config.batch_p2p_comm


def test_block_recomputation_counts_per_model_chunk(caplog):
    # Chunks of stages (3, 5) with 2 virtual stages: layers 1-2 | 3-5 | 6 | 7-8 (chunk order).
    plan = make_plan(pp=2, stage_layers=(3, 5), virtual_stages=2, checkpoint=(1, 3, 6, 7), model=TINY8)
    config = dm.apply(plan, config_for(TINY8))
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 1)
    assert warnings_of(caplog) == []
    # The first layer of each pipeline rank is not the first of each of its chunks: widened, reported.
    config = dm.apply(make_plan(pp=2, virtual_stages=2, checkpoint=(1, 3), model=TINY8), config_for(TINY8))
    assert config.recompute_num_layers == 1
    [message] = warnings_of(caplog)
    assert ("first N transformer layers of every model chunk, and the plan checkpoints layers 1, 3 of model "
            "chunks of [2, 2, 2, 2] layers; dsauto sets recompute_num_layers=1, which also checkpoints "
            "layers 5, 7") in message


def test_model_chunks_needs_the_plans_process_groups():
    if parallel_state.model_parallel_is_initialized():
        pytest.skip("another test initialised Megatron's process groups in this process")
    with pytest.raises(DsautoError, match=r"call dm.initialize_model_parallel\(plan\) before building the model"):
        dm.model_chunks(make_plan(pp=2, virtual_stages=2), lambda **chunk: None)


def test_checkpointing_the_first_layers_of_each_stage_is_applied_exactly(caplog):
    plan = make_plan(pp=2, checkpoint=(1, 3))  # the first layer of each stage of (2, 2)
    config = dm.apply(plan, config_for())
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 1)
    assert warnings_of(caplog) == []


def test_other_checkpointed_sets_are_widened_and_reported(caplog):
    config = dm.apply(make_plan(checkpoint=(2, 4)), config_for())
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 4)
    [message] = warnings_of(caplog)
    assert "the plan checkpoints layers 2, 4" in message and "also checkpoints layers 1, 3" in message


def test_flash_attention_plan_on_unfused_attention_recomputes_core_attention(caplog):
    plan = make_plan(flash_attention=True)
    config = dm.apply(plan, config_for(attention_backend=AttnBackend.local))
    assert config.recompute_granularity == "selective" and "core_attn" in config.recompute_modules
    assert "attention scores" in warnings_of(caplog)[0]
    caplog.clear()
    # A fused backend keeps no scores: nothing to recompute, nothing to report.
    assert dm.apply(plan, config_for(attention_backend=AttnBackend.flash)).recompute_granularity is None
    assert dm.apply(make_plan(), config_for(attention_backend=AttnBackend.local)).recompute_granularity is None
    assert warnings_of(caplog) == []


def test_full_and_selective_cannot_mix_and_this_is_reported(caplog):
    plan = make_plan(checkpoint=(1, 2), flash_attention=True)
    config = dm.apply(plan, config_for(attention_backend=AttnBackend.local))
    assert config.recompute_granularity == "full"
    assert any("2 transformer layers not checkpointed keep them" in m for m in warnings_of(caplog))


def test_what_megatron_cannot_express_is_reported(caplog):
    dm.apply(make_plan(checkpoint=(0, 5), split={1: 2, 5: 4}), config_for())
    text = "\n".join(warnings_of(caplog))
    assert "checkpointing of the layers 0, 5 (embedding and head) is not applied" in text
    assert "splitting of layer 1 (decoder) in 2 slices, layer 5 (head) in 4 slices is not applied" in text


def test_a_config_for_another_model_is_refused():
    with pytest.raises(DsautoError, match=r"num_layers=6 but the plan was made for gpt-test with num_layers=4"):
        dm.apply(make_plan(), config_for(ModelSpec(**{**TINY.__dict__, "num_layers": 6})))
    with pytest.raises(DsautoError, match=r"hidden_size=128 .* hidden_size=64"):
        dm.apply(make_plan(), config_for(ModelSpec(**{**TINY.__dict__, "hidden_size": 128})))


def test_a_mixture_of_experts_reaches_the_config_and_is_checked():
    """The experts of the planned model become TransformerConfig's moe_* fields (Megatron's own
    checks accept them), and a config with other experts is refused."""
    moe = ModelSpec(**{**TINY.__dict__, "name": "moe-test", "num_experts": 4, "moe_top_k": 2,
                       "moe_ffn_hidden_size": 32, "moe_first_dense_layers": 1})
    config = config_for(moe, expert_model_parallel_size=2)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 32)
    assert config.moe_layer_freq == [0, 1, 1, 1] and config.moe_token_dispatcher_type == "alltoall"
    dense_plan = make_plan()
    with pytest.raises(DsautoError, match=r"num_moe_experts=4 but the plan was made for gpt-test with "
                                          r"num_moe_experts=None"):
        dm.apply(dense_plan, config_for(moe))


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_ddp_and_optimizer_configs_follow_the_zero_stage(zero_stage, caplog):
    plan = make_plan(dp=2, zero_stage=zero_stage, resident=(1, 2))
    ddp, opt = dm.ddp_config(plan), dm.optimizer_config(plan, lr=1e-3)
    assert ddp.use_distributed_optimizer == opt.use_distributed_optimizer == (zero_stage >= 1)
    assert ddp.overlap_grad_reduce and ddp.overlap_param_gather == (zero_stage >= 1)
    assert ddp.bucket_size == plan.reduce_bucket_bytes // 4  # fp32 gradients
    assert ddp.use_megatron_fsdp == (zero_stage >= 2)
    assert ddp.data_parallel_sharding_strategy == {2: "optim_grads", 3: "optim_grads_params"}.get(zero_stage, "no_shard")
    resident = [m for m in warnings_of(caplog) if "resident" in m]
    assert (resident != []) == (zero_stage == 3)
    if zero_stage == 3:
        assert "layers 1-2 resident" in resident[0]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_without_megatron_fsdp_zero_2_and_3_fall_back_to_the_distributed_optimizer(zero_stage, caplog):
    plan = make_plan(dp=2, zero_stage=zero_stage)
    ddp = dm.ddp_config(plan, megatron_fsdp=False)
    assert ddp.use_distributed_optimizer and not ddp.use_megatron_fsdp
    [message] = warnings_of(caplog)
    assert f"ZeRO-{zero_stage} runs as Megatron's distributed optimizer" in message
    assert ("parameters" in message) == (zero_stage == 3)


def test_load_plan_reads_plan_yaml_and_the_ds_config_block(tmp_path):
    plan = make_plan(tp=2, pp=2, checkpoint=(1,))
    assert dm.load_plan(write_plan_yaml(plan, tmp_path / "plan.yaml")) == plan
    assert dm.load_plan(write_ds_config(plan, tmp_path / "ds_config.json")) == plan


def test_initialize_model_parallel_needs_torch_distributed():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("another test initialised torch.distributed in this process")
    with pytest.raises(DsautoError, match="torch.distributed is not initialised"):
        dm.initialize_model_parallel(make_plan())


def test_gpt_model_arguments_and_encoders():
    kwargs = dm.gpt_model_kwargs(make_plan(tp=2))
    assert kwargs == dict(vocab_size=512, max_sequence_length=64, position_embedding_type="learned_absolute",
                          share_embeddings_and_output_weights=True)
    encoder = ModelSpec(**{**TINY.__dict__, "architecture": "encoder"})
    with pytest.raises(DsautoError, match="encoder model, and GPTModel builds decoders"):
        dm.gpt_model_kwargs(make_plan(model=encoder))


# --- training on CPU ranks -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict[str, dict]:
    """TP=1, PP=1: the reference, and the same plan with full and with selective recomputation,
    each measuring the bytes kept for backward."""
    return launch(1, {
        "reference": {"plan": make_plan(), "measure": True},
        "full": {"plan": make_plan(checkpoint=(1, 2)), "measure": True},
        "selective": {"plan": make_plan(flash_attention=True), "measure": True},
    }, tmp_path_factory.mktemp("one_rank"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, dict]:
    return launch(2, {
        "tp2": {"plan": make_plan(tp=2)},
        "pp2": {"plan": make_plan(pp=2, checkpoint=(1, 3)), "measure": True},
        "dp2_zero1": {"plan": make_plan(dp=2, zero_stage=1)},
        "uneven_1_3": {"plan": make_plan(pp=2, stage_layers=(1, 3), checkpoint=(1, 2, 3))},
        "layout_0_4": {"plan": make_plan(pp=2, stage_layers=(0, 4))},
        "four_rank_plan": {"plan": make_plan(tp=2, pp=2), "expect_error": True},
    }, tmp_path_factory.mktemp("two_ranks"))


def assert_same_losses(losses: list[float], reference: list[float]) -> None:
    assert losses == pytest.approx(reference, rel=RTOL)


@pytest.mark.parametrize("run", ["tp2", "pp2", "dp2_zero1", "uneven_1_3", "layout_0_4"])
def test_two_rank_layouts_train_like_one_rank(two_ranks, one_rank, run):
    reference = one_rank["reference"]["losses"]
    assert reference[-1] < reference[0]  # it trains
    assert_same_losses(two_ranks[run]["losses"], reference)


@pytest.mark.parametrize(("run", "stages"), [("pp2", [[1, 2], [3, 4]]), ("uneven_1_3", [[1], [2, 3, 4]]),
                                             ("layout_0_4", [[], [1, 2, 3, 4]])])
def test_each_stage_builds_the_planned_layers(two_ranks, run, stages):
    # Megatron's layer_number is 1-based over the whole model, as the plan's transformer layers.
    assert two_ranks[run]["stage_layers"] == stages


def test_pipeline_recomputes_as_planned(two_ranks):
    assert two_ranks["pp2"]["recompute"] == ["full", "block", 1]
    # Stage 0's one layer and stage 1's first two: the first 2 layers of every stage.
    assert two_ranks["uneven_1_3"]["recompute"] == ["full", "block", 2]


def test_a_plan_for_another_world_size_is_refused(two_ranks):
    assert two_ranks["four_rank_plan"]["error"] == (
        "The plan is for 4 ranks (tp=2 pp=2 dp=1) but torch.distributed has 2; launch 4 processes "
        "or re-plan for 2 devices.")


def test_recomputation_keeps_losses_and_saves_activation_memory(one_rank):
    none, full, selective = (one_rank[name] for name in ("reference", "full", "selective"))
    assert full["recompute"] == ["full", "block", 2] and selective["recompute"][0] == "selective"
    # Recomputation replays the same arithmetic: the same losses, bit for bit.
    assert full["losses"] == none["losses"] and selective["losses"] == none["losses"]
    [none_bytes], [full_bytes], [selective_bytes] = none["saved_bytes"], full["saved_bytes"], selective["saved_bytes"]
    # Selective recomputation drops each layer's fp32 attention probabilities, b x a x s x s x 4 bytes
    # (Korthikanti et al. 2022, Sec. 5; no dropout here, so no mask).
    scores = MICRO_BATCH * TINY.num_attention_heads * SEQ_LEN**2 * 4
    assert none_bytes - selective_bytes >= TINY.num_layers * scores
    # A checkpointed layer keeps only its input (b x s x h x 4 bytes) instead of its activations,
    # which include at least those probabilities: two such layers save at least this much.
    layer_input = MICRO_BATCH * SEQ_LEN * TINY.hidden_size * 4
    assert none_bytes - full_bytes >= 2 * (scores - layer_input)
    print(f"bytes kept for backward per micro-batch: none {none_bytes}, full recompute of layers 1-2 "
          f"{full_bytes}, selective {selective_bytes}")


def test_pipeline_stages_with_recomputation_keep_less(two_ranks, one_rank):
    # pp2 checkpoints the first layer of each stage; each stage keeps less than the whole model.
    assert max(two_ranks["pp2"]["saved_bytes"]) < one_rank["reference"]["saved_bytes"][0]


@pytest.mark.slow
def test_four_rank_layouts_train_like_one_rank(tmp_path, one_rank):
    results = launch(4, {
        "tp2_pp2": {"plan": make_plan(tp=2, pp=2, checkpoint=(1, 2, 3, 4))},
        # Interleaved (one layer per chunk, chunk k holds layer k + 1) under tensor and sequence
        # parallelism, and under data parallelism with the distributed optimizer (its gathers and
        # reductions overlapped per chunk).
        "tp2_pp2_vpp2": {"plan": make_plan(tp=2, pp=2, virtual_stages=2)},
        "dp2_pp2_vpp2_zero1": {"plan": make_plan(dp=2, pp=2, virtual_stages=2, zero_stage=1)},
    }, tmp_path)
    assert results["tp2_pp2"]["stage_layers"] == [[1, 2], [3, 4]]
    for run in ("tp2_pp2_vpp2", "dp2_pp2_vpp2_zero1"):
        assert results[run]["chunk_layers"] == [[1], [2], [3], [4]]
    for run in ("tp2_pp2", "tp2_pp2_vpp2", "dp2_pp2_vpp2_zero1"):
        assert_same_losses(results[run]["losses"], one_rank["reference"]["losses"])


@pytest.fixture(scope="module")
def interleaved(tmp_path_factory) -> dict[str, dict]:
    """Interleaved 1F1B (pp 2, model chunks per rank 2 or 4) of the 8-layer GPT on two ranks, and
    its TP=1, PP=1 reference on one; same weights, same global batch of 4 micro-batches."""
    folder = tmp_path_factory.mktemp("interleaved")
    reference = launch(1, {"reference": {"plan": make_plan(model=TINY8)}}, folder / "one")
    runs = launch(2, {
        "vpp2": {"plan": make_plan(pp=2, virtual_stages=2, model=TINY8), "measure": True},
        # The first layer of every chunk checkpointed: Megatron's block recompute of 1 layer per chunk.
        "vpp2_recompute": {"plan": make_plan(pp=2, virtual_stages=2, checkpoint=(1, 3, 5, 7), model=TINY8),
                           "measure": True},
        "vpp2_uneven": {"plan": make_plan(pp=2, stage_layers=(3, 5), virtual_stages=2, model=TINY8)},
        # A layout string splitting each rank's 4 layers 1 + 3 and 3 + 1 over its chunks (Plan.chunk_layout).
        "vpp2_chunks": {"plan": make_plan(pp=2, stage_layers=(4, 4), virtual_stages=2, chunk_layout=(1, 3, 3, 1),
                                          model=TINY8)},
        "vpp4": {"plan": make_plan(pp=2, virtual_stages=4, model=TINY8)},
        # Fewer layers than chunks on the last rank: its last chunk holds the head alone ("...|L").
        "vpp4_padded": {"plan": make_plan(pp=2, stage_layers=(5, 3), virtual_stages=4, model=TINY8)},
    }, folder / "two")
    return {**reference, **runs}


@pytest.mark.slow
@pytest.mark.parametrize(("run", "chunks"), [
    ("vpp2", [[1, 2], [3, 4], [5, 6], [7, 8]]),
    ("vpp2_recompute", [[1, 2], [3, 4], [5, 6], [7, 8]]),
    ("vpp2_uneven", [[1, 2], [3, 4, 5], [6], [7, 8]]),
    ("vpp2_chunks", [[1], [2, 3, 4], [5, 6, 7], [8]]),
    ("vpp4", [[layer] for layer in range(1, 9)]),
    ("vpp4_padded", [[1, 2], [3], [4], [5], [6], [7], [8], []]),
])
def test_interleaved_pipeline_trains_like_one_rank(interleaved, run, chunks):
    reference = interleaved["reference"]["losses"]
    assert reference[-1] < reference[0]  # it trains
    # Megatron's layer_number of each chunk's layers, in chunk order (chunk s * pp + r: rank r's s-th).
    assert interleaved[run]["chunk_layers"] == chunks
    assert_same_losses(interleaved[run]["losses"], reference)


@pytest.mark.slow
def test_interleaved_pipeline_recomputes_the_first_layer_of_every_chunk(interleaved):
    plain, recompute = interleaved["vpp2"], interleaved["vpp2_recompute"]
    assert recompute["recompute"] == ["full", "block", 1]
    assert recompute["losses"] == plain["losses"]  # recomputation replays the same arithmetic
    # Per forward pass of a chunk (2 layers), one layer keeps its input (b x s x h x 4 bytes) instead
    # of its activations, which include the b x a x s x s x 4 bytes of attention probabilities.
    scores = MICRO_BATCH * TINY8.num_attention_heads * SEQ_LEN**2 * 4
    layer_input = MICRO_BATCH * SEQ_LEN * TINY8.hidden_size * 4
    for kept_plain, kept_recompute in zip(plain["saved_bytes"], recompute["saved_bytes"], strict=True):
        assert kept_plain - kept_recompute >= scores - layer_input



@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "pins"), [(4, ["--tp", "2", "--pp", "2"]), (2, ["--pp", "2", "--vpp", "2"])],
                         ids=["tp2_pp2", "pp2_vpp2"])
def test_the_example_trains_under_a_tuned_plan(tmp_path, ranks, pins):
    """The commands of examples/megatron/train_gpt.py, as its docstring gives them (3 steps)."""
    subprocess.run([sys.executable, "-m", "dsauto", "tune", "--model", "gpt-tiny", "--hardware", "cpu",
                    "--nodes", "1", "--gpus-per-node", str(ranks), *pins, "--out", str(tmp_path)],
                   check=True, capture_output=True)
    if "--vpp" in pins:
        assert dm.load_plan(tmp_path / "plan.yaml").virtual_stages == 2
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(ranks), str(EXAMPLE), "--plan", str(tmp_path / "plan.yaml"), "--steps", "3"],
                            capture_output=True, text=True, env=env, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-5000:]
    losses = [float(m.group(2)) for m in re.finditer(r"^step (\d+) loss (\S+)$", result.stdout, re.MULTILINE)]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_an_attention_backend_other_than_the_planned_kernel_is_reported(caplog):
    from dsauto.api import make_plan as plan_for

    with pytest.warns(UserWarning, match="no fused attention efficiency"):
        plan = plan_for("gpt-tiny", "cpu", engine="megatron", dtype="bf16", attention_kernel="cudnn")
    dm.apply(plan, config_for(plan.model, attention_backend=AttnBackend.flash))
    [message] = [m for m in warnings_of(caplog) if "attention_backend" in m]
    assert "priced with attention_backend fused and the config runs flash" in message
    caplog.clear()
    for matching in (AttnBackend.fused, AttnBackend.auto):
        dm.apply(plan, config_for(plan.model, attention_backend=matching))
    assert not [m for m in warnings_of(caplog) if "attention_backend" in m]


def test_pinned_tp_comm_overlap_and_bf16_gradients_reach_megatron_core(caplog):
    from dsauto.api import make_plan as plan_for

    plan = plan_for("gpt-tiny", "cpu", engine="megatron", dtype="bf16", tp=2, tp_comm_overlap=True,
                    grad_reduce_in_fp32=False)
    assert plan.tp_comm_overlap and not plan.grad_reduce_in_fp32
    ddp = dm.ddp_config(plan)
    assert ddp.grad_reduce_in_fp32 is False and ddp.bucket_size == plan.reduce_bucket_bytes // 2
    assert dm.apply(plan, config_for(plan.model)).tp_comm_overlap is True
    # A config that overlaps where the plan did not keeps it, and the prediction's gap is said.
    plain = plan_for("gpt-tiny", "cpu", engine="megatron", dtype="bf16", tp=2)
    assert dm.ddp_config(plain).grad_reduce_in_fp32 is True
    assert dm.apply(plain, config_for(plain.model, tp_comm_overlap=True)).tp_comm_overlap is True
    assert any("priced without it" in m for m in warnings_of(caplog))


def test_an_unfused_swiglu_is_reported_and_the_plugin_fuses_it(caplog):
    # The plan's memory holds the fused SwiGLU's input alone (the H100 listing,
    # benchmarks/results/device_steps_saved_h100.txt: bias_swiglu_impl keeps its 2 x FFN input); Megatron-core's
    # unfused glu keeps two more FFN-wide tensors a token.
    import torch.nn.functional as F

    from dsauto.api import make_plan as plan_for

    llama = dataclasses.replace(TINY, name="tiny-llama", mlp="swiglu", norm="rmsnorm", position_embedding="rope",
                                linear_bias=False, tied_embeddings=False)
    plan = plan_for(llama, "cpu", engine="megatron", dtype="bf16")
    assert dm.transformer_config_kwargs(plan.model)["bias_activation_fusion"] is True
    unfused = {**dm.transformer_config_kwargs(plan.model), "bias_activation_fusion": False}
    dm.apply(plan, TransformerConfig(**unfused))
    [message] = [m for m in warnings_of(caplog) if "SwiGLU" in m]
    assert f"2 x {llama.ffn_hidden_size} more values per token" in message and "bias_activation_fusion=True" in message
    caplog.clear()
    dm.apply(plan, config_for(plan.model))
    gpt = plan_for("gpt-tiny", "cpu", engine="megatron", dtype="bf16")
    assert dm.transformer_config_kwargs(gpt.model)["bias_activation_fusion"] is False  # the exact GeLU
    dm.apply(gpt, TransformerConfig(**{**dm.transformer_config_kwargs(gpt.model), "activation_func": F.gelu}))
    assert not [m for m in warnings_of(caplog) if "SwiGLU" in m]


def test_the_launch_environment_the_plan_needs_is_written_and_checked(caplog, monkeypatch):
    # Megatron-LM's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor parallelism before
    # Blackwell, and that it is not 1 with Megatron-FSDP; megatron_args.txt says which, and the hook
    # reports a process launched otherwise (on a GPU, where CUDA reads it).
    from dsauto.api import make_plan as plan_for
    from dsauto.emit.megatron import megatron_args

    tp = plan_for("gpt-tiny", "cpu", engine="megatron", dtype="bf16", tp=2)
    fsdp = plan_for("gpt-tiny", "cpu", engine="megatron", dtype="bf16", zero_stage=3, tp=1)
    plain = plan_for("gpt-tiny", "cpu", engine="megatron", dtype="bf16", tp=1, zero_stage=1)
    assert "# Launch environment: CUDA_DEVICE_MAX_CONNECTIONS=1, for tensor or context parallelism" in "\n".join(
        megatron_args(tp))
    assert "# Launch environment: CUDA_DEVICE_MAX_CONNECTIONS unset (or above 1), for Megatron-FSDP" in "\n".join(
        megatron_args(fsdp))
    assert not [line for line in megatron_args(plain) if "Launch environment" in line]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for plan, value, reported in ((tp, None, True), (tp, "1", False), (fsdp, "1", True), (fsdp, "32", False),
                                  (plain, "1", False)):
        caplog.clear()
        if value is None:
            monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        else:
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
        dm.apply(plan, config_for(plan.model))
        said = [m for m in warnings_of(caplog) if "CUDA_DEVICE_MAX_CONNECTIONS" in m]
        assert bool(said) == reported, (plan.tp, plan.zero_stage, value, said)
        if plan is fsdp and reported:
            assert said == ["dsauto: The plan needs CUDA_DEVICE_MAX_CONNECTIONS unset (or above 1) for Megatron-FSDP "
                            "(validate_args asserts it is not 1), and this process has 1; set it in the launch "
                            "environment."]


def test_apply_sets_the_softmax_precision_the_plan_was_priced_with(caplog):
    from dsauto.api import make_plan as plan_for

    def plan(**pins):
        return plan_for("gpt-tiny", "cpu", dtype="bf16", flash_attention=False, engine="megatron", tp=1, pp=1,
                        global_batch=8, seq_len=64, micro_batch=4, **pins)

    fp32, half = plan(), plan(attention_softmax_in_fp32=False)
    assert dm.apply(fp32, config_for(fp32.model)).attention_softmax_in_fp32
    assert not dm.apply(half, config_for(fp32.model)).attention_softmax_in_fp32
    assert warnings_of(caplog) == []
    dm.apply(fp32, config_for(fp32.model, masked_softmax_fusion=True))
    assert any("fuses the masked softmax" in w for w in warnings_of(caplog))
    caplog.clear()
    # Megatron-core forces the fp32 softmax under query-key layer scaling; the hook says so.
    dm.apply(half, config_for(fp32.model, apply_query_key_layer_scaling=True, fp16=True))
    assert any("apply_query_key_layer_scaling" in w for w in warnings_of(caplog))


def test_transformer_engines_unfused_softmax_is_checked_against_the_launch_environment(caplog, monkeypatch):
    from dsauto.api import make_plan as plan_for

    def plan(**pins):
        return plan_for("gpt-tiny", "cpu", dtype="bf16", flash_attention=False, engine="megatron", tp=1, pp=1,
                        global_batch=8, seq_len=64, micro_batch=4, **pins)

    fp32, half = plan(), plan(attention_softmax_in_fp32=False)
    te = config_for(fp32.model, attention_backend=AttnBackend.unfused)
    monkeypatch.delenv("NVTE_MASKED_SOFTMAX_FUSION", raising=False)
    dm.apply(fp32, te)  # Transformer Engine fuses it (64 keys, 4 x heads batches): 16 bits, not as priced
    assert any("NVTE_MASKED_SOFTMAX_FUSION=0" in w for w in warnings_of(caplog))
    caplog.clear()
    dm.apply(half, te)
    assert warnings_of(caplog) == []
    monkeypatch.setenv("NVTE_MASKED_SOFTMAX_FUSION", "0")
    dm.apply(fp32, te)
    assert warnings_of(caplog) == []
    dm.apply(half, te)
    assert any("memory may be higher than predicted" in w for w in warnings_of(caplog))


def test_a_window_that_slides_over_nothing_is_full_attention_and_a_users_own_window_stays():
    """The model's window at least as long as the plan's sequences is full attention (Transformer
    Engine's ring refuses any window): the plugin clears the config's copy of it. A window the user
    set for a model without one is the user's, kept."""
    from dsauto.api import make_plan as plan_for

    windowed = dataclasses.replace(TINY, sliding_window=32)
    long_plan = plan_for(windowed, "cpu", engine="megatron", seq_len=64)
    short_plan = plan_for(windowed, "cpu", engine="megatron", seq_len=32)
    assert dm.apply(long_plan, config_for(windowed)).window_size == (31, 0)
    assert dm.apply(short_plan, config_for(windowed)).window_size is None
    plain = plan_for(TINY, "cpu", engine="megatron", seq_len=32)
    assert dm.apply(plain, config_for(TINY, window_size=(15, 0))).window_size == (15, 0)
