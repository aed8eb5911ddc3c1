"""Plans written by hand for the emitter tests: a ZeRO-3 plan with mixed per-layer choices, and a
tensor- and pipeline-parallel plan with uneven stages; plus a builder for variants."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dsauto.plan import LayerChoice, Plan, Prediction, StagePrediction
from dsauto.spec.model import ModelSpec

MiB = 1024**2

# A LLaMA-shaped model: grouped-query attention, SwiGLU, RMSNorm, rotary positions, untied head,
# no biases, no dropout.
TINY_LLAMA = ModelSpec(
    name="tiny-llama", architecture="decoder", num_layers=4, hidden_size=256, num_attention_heads=8,
    ffn_hidden_size=688, vocab_size=1000, max_position_embeddings=512, num_kv_heads=4, mlp="swiglu",
    norm="rmsnorm", position_embedding="rope", tied_embeddings=False, linear_bias=False, dropout=False,
)

# A GPT-2-shaped model: GeLU, LayerNorm, learned positions, tied head, biases, dropout.
TINY_GPT = ModelSpec(
    name="tiny-gpt", architecture="decoder", num_layers=6, hidden_size=256, num_attention_heads=8,
    ffn_hidden_size=1024, vocab_size=1000, max_position_embeddings=512,
)


def stage(index: int, first: int, last: int, in_flight: int) -> StagePrediction:
    return StagePrediction(
        stage=index, first_layer=first, last_layer=last, micro_batches_in_flight=in_flight,
        forward_seconds=0.012, backward_seconds=0.025, params_bytes=6 * MiB, grads_bytes=3 * MiB,
        optimizer_bytes=18 * MiB, activation_bytes=40 * MiB, transient_bytes=8 * MiB,
        peak_bytes=75 * MiB,
    )


PREDICTION = Prediction(
    step_seconds=0.31, tokens_per_second=13_200.0, mfu=0.21, tflops_per_device=41.5,
    peak_memory_bytes=75 * MiB, compute_seconds=0.27, bubble_seconds=0.02,
    exposed_comm_seconds=0.015, optimizer_seconds=0.005, basis="analytic",
)


def _make_plan(model: ModelSpec, *, dp: int, tp: int, pp: int, zero_stage: int,
              stage_layers: tuple[int, ...], layers: tuple[LayerChoice, ...], micro_batch: int = 2,
              grad_accum: int = 4, **overrides) -> Plan:
    """A consistent plan around the given parallel layout and per-layer runs."""
    world = dp * tp * pp
    if zero_stage != 3:  # below ZeRO-3 parameters are never sharded
        layers = tuple(replace(run, shard_params=False) for run in layers)
    stages, first = [], 0
    for s, count in enumerate(stage_layers):
        last = first + count + (1 if s == 0 else 0) + (1 if s == pp - 1 else 0) - 1
        stages.append(stage(s, first, last, min(pp - s, grad_accum)))
        first = last + 1
    fields = dict(
        model=model, hardware="a100-80gb", nodes=1, gpus_per_node=world,
        memory_budget_bytes=76 * 1024**3, dp=dp, tp=tp, pp=pp, zero_stage=zero_stage,
        sequence_parallel=tp > 1, micro_batch=micro_batch, grad_accum=grad_accum,
        global_batch=micro_batch * grad_accum * dp, seq_len=256, dtype="bf16", flash_attention=True,
        padded_vocab_size=model.padded_vocab_size(tp), stage_layers=stage_layers,
        reduce_bucket_bytes=64 * MiB, prefetch_bucket_bytes=32 * MiB, layers=layers,
        stages=tuple(stages), prediction=PREDICTION,
    )
    fields.update(overrides)
    return Plan(**fields)


def _per_layer_runs(model: ModelSpec, stage_layers: tuple[int, ...], checkpoint=(), resident=(),
                   split=None) -> tuple[LayerChoice, ...]:
    """One run per layer (0..L+1) with the given checkpointed, resident and split layers."""
    split = split or {}
    stage_of = [0] + [s for s, count in enumerate(stage_layers) for _ in range(count)]
    stage_of.append(len(stage_layers) - 1)
    runs = []
    for layer, st in enumerate(stage_of):
        group = "embedding" if layer == 0 else "head" if layer == model.num_layers + 1 else "decoder"
        runs.append(LayerChoice(layer, layer, group, st, layer in checkpoint, layer not in resident,
                                split.get(layer, 1)))
    return tuple(runs)


@pytest.fixture
def make_plan():
    """The plan builder, for variants of the hand-written plans."""
    return _make_plan


@pytest.fixture
def layer_runs():
    """The per-layer run builder."""
    return _per_layer_runs


@pytest.fixture
def zero3_plan() -> Plan:
    """dp=2 x tp=1 x pp=1, ZeRO-3: layers 1-2 checkpointed and kept resident, the rest sharded, the
    head's logits and loss computed in 4 chunks."""
    layers = (
        LayerChoice(first=0, last=0, group="embedding", stage=0, checkpoint=False, shard_params=True, split=1),
        LayerChoice(first=1, last=2, group="decoder", stage=0, checkpoint=True, shard_params=False, split=1),
        LayerChoice(first=3, last=4, group="decoder", stage=0, checkpoint=False, shard_params=True, split=1),
        LayerChoice(first=5, last=5, group="head", stage=0, checkpoint=False, shard_params=True, split=4),
    )
    return _make_plan(TINY_LLAMA, dp=2, tp=1, pp=1, zero_stage=3, stage_layers=(4,), layers=layers)


@pytest.fixture
def pipeline_plan() -> Plan:
    """dp=2 x tp=2 x pp=2, ZeRO-1, fp16, stages of 2 and 4 layers; the first 2 layers of each stage
    checkpointed."""
    layers = (
        LayerChoice(first=0, last=0, group="embedding", stage=0, checkpoint=False, shard_params=False, split=1),
        LayerChoice(first=1, last=2, group="decoder", stage=0, checkpoint=True, shard_params=False, split=1),
        LayerChoice(first=3, last=4, group="decoder", stage=1, checkpoint=True, shard_params=False, split=1),
        LayerChoice(first=5, last=6, group="decoder", stage=1, checkpoint=False, shard_params=False, split=1),
        LayerChoice(first=7, last=7, group="head", stage=1, checkpoint=False, shard_params=False, split=1),
    )
    return _make_plan(TINY_GPT, dp=2, tp=2, pp=2, zero_stage=1, stage_layers=(2, 4), layers=layers,
                     micro_batch=1, grad_accum=8, dtype="fp16")


@pytest.fixture(params=["zero3_plan", "pipeline_plan"])
def plan(request) -> Plan:
    """Each hand-written plan in turn."""
    return request.getfixturevalue(request.param)
