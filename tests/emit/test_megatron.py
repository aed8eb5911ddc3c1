"""Megatron-LM arguments: spellings, values, pipeline layout and recompute flags as Megatron reads
them, and the choices no flag can express reported in comments."""

from __future__ import annotations

import itertools
import shlex
from dataclasses import replace

import pytest

from dsauto.emit.megatron import megatron_args, megatron_argv, write_megatron_args
from dsauto.engines.megatron import block_recompute_layers

# Megatron-core is installed; its own code turns the layout flags into layers per stage.
torch = pytest.importorskip("torch")
transformer = pytest.importorskip("megatron.core.transformer")
from megatron.core.transformer.enums import LayerType  # noqa: E402
from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402

# TransformerConfig warns about a CUDA-graph default that has nothing to do with these tests.
pytestmark = pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning")


def flags(lines: list[str]) -> dict[str, str | None]:
    """Flag -> value (None for a switch) of the non-comment lines."""
    out = {}
    for line in lines:
        if not line.startswith("# "):
            flag, _, value = line.partition(" ")
            assert flag not in out, f"{flag} given twice"
            out[flag] = " ".join(shlex.split(value)) or None  # the words a shell reads
    return out


def comments(lines: list[str]) -> str:
    return "\n".join(line for line in lines if line.startswith("# "))


def megatron_stage_layers(plan) -> list[int]:
    """Transformer layers per pipeline stage as Megatron-core places them from our flags
    (Megatron-LM maps --decoder-first/last-pipeline-num-layers to these TransformerConfig fields,
    megatron/training/argument_utils.py)."""
    given = flags(megatron_args(plan))
    first = given.get("--decoder-first-pipeline-num-layers")
    last = given.get("--decoder-last-pipeline-num-layers")
    config = transformer.TransformerConfig(
        num_layers=plan.model.num_layers, hidden_size=plan.model.hidden_size,
        num_attention_heads=plan.model.num_attention_heads, pipeline_dtype=torch.bfloat16,
        pipeline_model_parallel_size=plan.pp,
        num_layers_in_first_pipeline_stage=int(first) if first else None,
        num_layers_in_last_pipeline_stage=int(last) if last else None,
        pipeline_model_parallel_layout=given.get("--pipeline-model-parallel-layout"),
    )
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        return [layout.layout[rank][0].count(LayerType.decoder) for rank in range(plan.pp)]
    return [get_num_layers_to_build(config, pp_rank=rank) for rank in range(plan.pp)]


def test_zero3_plan_flags(zero3_plan):
    given = flags(megatron_args(zero3_plan))
    assert given["--tensor-model-parallel-size"] == "1"
    assert given["--pipeline-model-parallel-size"] == "1"
    assert given["--num-layers"] == "4" and given["--hidden-size"] == "256"
    assert given["--ffn-hidden-size"] == "688" and given["--num-attention-heads"] == "8"
    assert "--group-query-attention" in given and given["--num-query-groups"] == "4"
    assert given["--seq-length"] == "256" and given["--max-position-embeddings"] == "512"
    assert given["--micro-batch-size"] == "2" and given["--global-batch-size"] == "16"
    assert "--bf16" in given and "--fp16" not in given
    for switch in ("--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                   "--use-distributed-optimizer", "--use-megatron-fsdp"):
        assert given[switch] is None
    assert given["--normalization"] == "RMSNorm"
    assert given["--position-embedding-type"] == "rope"
    assert given["--attention-backend"] == "flash"
    assert given["--hidden-dropout"] == given["--attention-dropout"] == "0.0"
    assert given["--data-parallel-sharding-strategy"] == "optim_grads_params"
    assert "--sequence-parallel" not in given
    # Megatron's bf16 gradients are reduced in fp32: four bytes per counted parameter.
    assert given["--ddp-bucket-size"] == str(zero3_plan.reduce_bucket_bytes // 4)


def test_zero3_plan_recompute_is_a_block_prefix(zero3_plan):
    given = flags(megatron_args(zero3_plan))
    assert given["--recompute-granularity"] == "full"
    assert given["--recompute-method"] == "block"
    assert given["--recompute-num-layers"] == "2"


def test_zero3_plan_reports_what_flags_cannot_say(zero3_plan):
    text = comments(megatron_args(zero3_plan))
    assert "operator splitting of layer 5 (head) in 4 slices" in text
    assert "ZeRO-3 keeps the parameters of layers 1-2 resident" in text
    assert "dsauto hook" in text


def test_pipeline_plan_flags(pipeline_plan):
    lines = megatron_args(pipeline_plan)
    given = flags(lines)
    assert given["--tensor-model-parallel-size"] == "2"
    assert given["--pipeline-model-parallel-size"] == "2"
    assert "--sequence-parallel" in given
    assert given["--decoder-first-pipeline-num-layers"] == "2"
    assert given["--decoder-last-pipeline-num-layers"] == "4"
    assert "--pipeline-model-parallel-layout" not in given
    assert given["--recompute-method"] == "block" and given["--recompute-num-layers"] == "2"
    assert "--fp16" in given and "--bf16" not in given
    assert "--use-distributed-optimizer" in given and "--use-megatron-fsdp" not in given
    assert given["--normalization"] == "LayerNorm"
    assert given["--position-embedding-type"] == "learned_absolute"
    for absent in ("--swiglu", "--group-query-attention", "--untie-embeddings-and-output-weights",
                   "--disable-bias-linear", "--hidden-dropout"):
        assert absent not in given
    assert "Not expressed" not in comments(lines)
    assert megatron_stage_layers(pipeline_plan) == [2, 4]


@pytest.mark.parametrize("stage_layers, expected", [
    ((3, 3), {}),  # Megatron's even split: no layout flags
    ((1, 2, 2, 1), {"--decoder-first-pipeline-num-layers": "1", "--decoder-last-pipeline-num-layers": "1"}),
    ((1, 2, 1, 2), {"--pipeline-model-parallel-layout": "Et|t*2|t|t*2L"}),
    ((0, 3, 3), {"--pipeline-model-parallel-layout": "E|t*3|t*3L"}),
])
def test_pipeline_layout_flags(make_plan, layer_runs, pipeline_plan, stage_layers, expected):
    model, pp = pipeline_plan.model, len(stage_layers)
    plan = make_plan(model, dp=1, tp=1, pp=pp, zero_stage=0, stage_layers=stage_layers,
                     layers=layer_runs(model, stage_layers))
    given = flags(megatron_args(plan))
    layout_flags = {k: v for k, v in given.items() if "pipeline-num-layers" in k or "layout" in k}
    assert layout_flags == expected
    assert megatron_stage_layers(plan) == list(stage_layers)


def test_checkpointing_that_is_not_a_prefix_is_left_to_the_hook(zero3_plan, layer_runs):
    layers = layer_runs(zero3_plan.model, (4,), checkpoint={2, 3})
    lines = megatron_args(replace(zero3_plan, layers=layers))
    assert not any(line.startswith("--recompute") for line in lines)
    assert ("activation checkpointing of transformer layers 2-3 is not the first N layers of every "
            "stage") in comments(lines)


def test_checkpointing_of_embedding_and_head_is_reported(zero3_plan, layer_runs):
    layers = layer_runs(zero3_plan.model, (4,), checkpoint={0, 5})
    lines = megatron_args(replace(zero3_plan, layers=layers))
    assert not any(line.startswith("--recompute") for line in lines)
    assert "checkpointing of the embedding and head" in comments(lines)


def test_replicated_parameters_below_zero3_are_not_reported(pipeline_plan):
    assert "resident" not in comments(megatron_args(pipeline_plan))


def megatron_block(stage_layers: tuple[int, ...], n: int) -> set[int]:
    """Transformer layers (1..L) that Megatron's block method checkpoints with N = n."""
    checkpointed, start = set(), 1
    for count in stage_layers:
        checkpointed |= {start + i for i in range(min(n, count))}
        start += count
    return checkpointed


@pytest.mark.parametrize("stage_layers", [(5,), (2, 3), (1, 2, 2), (3, 1, 1), (0, 3, 2)])
def test_block_recompute_against_every_checkpoint_choice(make_plan, layer_runs, pipeline_plan,
                                                         stage_layers):
    model = replace(pipeline_plan.model, num_layers=sum(stage_layers))
    pp = len(stage_layers)
    for mask in itertools.product([False, True], repeat=model.num_layers):
        chosen = {layer for layer, on in enumerate(mask, start=1) if on}
        plan = make_plan(model, dp=1, tp=1, pp=pp, zero_stage=0, stage_layers=stage_layers,
                         layers=layer_runs(model, stage_layers, checkpoint=chosen))
        n = block_recompute_layers(plan)
        reproducible = [k for k in range(model.num_layers + 1) if megatron_block(stage_layers, k) == chosen]
        if n is None:
            assert not reproducible, (chosen, reproducible)
        else:
            assert megatron_block(stage_layers, n) == chosen
            assert n > 0 or not chosen


def test_argv_and_file(plan, tmp_path):
    lines = megatron_args(plan)
    argv = megatron_argv(plan)
    assert not any(token.startswith("#") for token in argv)
    assert argv[:4] == ["--tensor-model-parallel-size", str(plan.tp),
                        "--pipeline-model-parallel-size", str(plan.pp)]
    path = write_megatron_args(plan, tmp_path / "megatron_args.txt")
    assert path.read_text().splitlines() == lines
    assert all(line.startswith(("--", "# ")) for line in lines)


def test_flags_parse_with_megatron_lm(plan):
    """Megatron-LM's own parser (when installed; megatron-core alone does not ship it)."""
    arguments = pytest.importorskip("megatron.training.arguments")
    import argparse

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(megatron_argv(plan))
    assert args.tensor_model_parallel_size == plan.tp
    assert args.pipeline_model_parallel_size == plan.pp
    assert args.global_batch_size == plan.global_batch


def test_latent_attention_runs_its_own_yarn_under_rope_positions():
    """Megatron-core's latent attention builds its own rotary embedding (YaRN by --rope-type), and
    GPTModel adds a model-wide one for --position-embedding-type yarn whatever the attention, which
    Megatron-LM's multi-token prediction refuses too: DeepSeek-V3 launches with rope positions, its
    YaRN factor and mscales as the flags MLATransformerConfig reads, and its multi-token-prediction layer."""
    import warnings

    from dsauto.api import make_plan
    from dsauto.emit.megatron import megatron_args
    from dsauto.errors import DsautoWarning
    from dsauto.spec.loaders import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        model = load_model("tests/spec/configs/deepseek-v3.json")
        plan = make_plan(model, "h100-80gb", nodes=128, gpus_per_node=8, global_batch=8192, seq_len=4096,
                         engine="megatron", tp=2, pp=16, ep=64, micro_batch=1)
    lines = megatron_args(plan)
    assert "--position-embedding-type yarn" not in lines and "--mtp-num-layers 1" in lines
    at = lines.index("--position-embedding-type rope")
    assert lines[at:at + 6] == ["--position-embedding-type rope", "--rope-type yarn", "--rotary-base 10000",
                                "--rotary-scaling-factor 40", "--mscale 1", "--mscale-all-dim 1"]
    assert not any(line.startswith("# Not expressed: YaRN") for line in lines)


def test_latent_attention_without_yarn_turns_megatron_lms_rope_fusion_off(tmp_path):
    """MLATransformerConfig refuses Megatron-LM's default rope fusion unless the rope is YaRN: a latent
    model without YaRN scaling launches with --rope-type rope --no-rope-fusion, and the file reads back."""
    import warnings

    from dsauto.api import make_plan
    from dsauto.emit.megatron import megatron_args, write_megatron_args
    from dsauto.engines.megatron_args import read_megatron_args
    from dsauto.errors import DsautoWarning
    from dsauto.spec.loaders import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        model = load_model("tests/spec/configs/deepseek-v2-lite.json")
        plan = make_plan(model, "h100-80gb", nodes=1, gpus_per_node=8, global_batch=64, seq_len=4096,
                         engine="megatron", pp=2, ep=4)
    assert model.latent_attention and not model.rope_scaling
    lines = megatron_args(plan)
    assert "--rope-type rope" in lines and "--no-rope-fusion" in lines
    launch = read_megatron_args(write_megatron_args(plan, tmp_path / "megatron_args.txt"), plan.model)
    assert launch.unknown == []
