"""DeepSpeed pipeline plans (pp > 1) through the hook: dsauto.deepspeed.pipeline_module cuts the
PipelineModule where the plan cuts it and wraps the blocks it checkpoints; dsauto.deepspeed.initialize
trains it with DeepSpeed's pipeline engine. On 2 CPU ranks (gloo), an uneven cut (1 + 3 blocks, and 3 + 1 with tied
embeddings) trains like the same layers in one process.

Tolerance: fp32 throughout, SGD; the pipeline runs each micro-batch's forward and backward stage by
stage and sums the micro-batches' gradients in another order than the one-process reference, a
reordering of a few ulps per step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from megatron_launch import launch
from torch import nn

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.errors import DsautoError
from dsauto.parallel import ParallelDims
from dsauto.plan import Plan
from dsauto.runtime.pipeline import block_positions, check_pipeline_module, check_pipeline_plan, stage_parts
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints, layer_options
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec

WORKER = Path(__file__).resolve().parent / "pipeline_worker.py"

LLAMA = ModelSpec(name="llama-pipe", architecture="decoder", num_layers=4, hidden_size=64,
                  num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=128, vocab_size=256,
                  max_position_embeddings=64, mlp="swiglu", norm="rmsnorm", position_embedding="rope",
                  tied_embeddings=False, linear_bias=False, dropout=False)
# The same with tied embeddings (GPT-style: learned positions, LayerNorm, GeLU): TiedLayerSpecs at
# both ends, the final norm a layer of its own before the tied projection.
TIED = dataclasses.replace(LLAMA, name="gpt-pipe", mlp="gelu", norm="layernorm", position_embedding="learned",
                           num_kv_heads=4, tied_embeddings=True, linear_bias=True)
STEPS = 6
PLAIN = LayerOption(checkpoint=False, shard_params=False, split=1)
CHECKPOINTED = LayerOption(checkpoint=True, shard_params=False, split=1)


def pipeline_plan(zero_stage: int, stage_layers: tuple[int, ...] = (1, 3), checkpointed: tuple[int, ...] = (3,),
                  head_split: int = 1, model: ModelSpec = LLAMA) -> Plan:
    train = TrainSpec(global_batch=2, seq_len=32, dtype="fp32")
    strategy = Strategy(dims=ParallelDims(dp=1, tp=1, pp=2), zero_stage=zero_stage, micro_batch=1, grad_accum=2,
                        sequence_parallel=False, engine="deepspeed")
    options = [PLAIN, *(CHECKPOINTED if layer in checkpointed else PLAIN for layer in range(1, model.num_layers + 1)),
               LayerOption(checkpoint=False, shard_params=False, split=head_split)]
    cluster = load_cluster("cpu", nodes=1, gpus_per_node=2)
    return Planner(model, cluster, train).build_plan(strategy, stage_layers, options)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = {"zero0": {"plan": pipeline_plan(0), "engine": "deepspeed"},
            "zero1": {"plan": pipeline_plan(1, checkpointed=(1, 3, 4)), "engine": "deepspeed"},
            "tied": {"plan": pipeline_plan(0, stage_layers=(3, 1), checkpointed=(2,), model=TIED),
                     "engine": "deepspeed"}}
    return launch(2, runs, tmp_path_factory.mktemp("pipeline"), steps=STEPS, seed=5, lr=0.1, worker=WORKER)


@pytest.mark.slow
@pytest.mark.parametrize("name,checkpointed", [("zero0", (3,)), ("zero1", (1, 3, 4))])
def test_uneven_pipeline_trains_like_one_process(results, name, checkpointed):
    run = results[name]
    # List: embedding (0), blocks 1..4 (1..4), logits (5); stage 0 holds block 1, stage 1 blocks 2-4.
    assert run["parts"] == run["engine_parts"] == [0, 2, 6]
    first, last = run["ranks"]
    assert (first["stage"], first["blocks"]) == (0, [1])
    assert (last["stage"], last["blocks"]) == (1, [2, 3, 4])
    assert first["checkpointed_layers"] + last["checkpointed_layers"] == list(checkpointed)
    assert first["checkpointed_blocks"] + last["checkpointed_blocks"] == list(checkpointed)
    assert run["losses"] == pytest.approx(run["reference"], rel=1e-5)
    assert min(run["losses"][1:]) < run["losses"][0] - 0.05  # it learns (the steps' batches differ)


@pytest.mark.slow
def test_tied_embeddings_pipeline_trains_like_one_process(results):
    run = results["tied"]
    # List: tied embedding (0), blocks (1..4), final norm (5), tied projection (6); 3 + 1 blocks.
    assert run["parts"] == run["engine_parts"] == [0, 4, 7]
    first, last = run["ranks"]
    assert (first["blocks"], last["blocks"]) == ([1, 2, 3], [4])
    assert first["checkpointed_layers"] == [2] and last["checkpointed_layers"] == []
    assert run["losses"] == pytest.approx(run["reference"], rel=1e-5)
    assert min(run["losses"][1:]) < run["losses"][0] - 0.05  # it learns (the steps' batches differ)


class Block(nn.Module):
    pass


def test_blocks_are_the_type_occurring_once_per_layer():
    plan = pipeline_plan(0)
    layers = [nn.Embedding(4, 4), *(Block() for _ in range(4)), nn.Linear(4, 4)]
    assert block_positions(plan, layers) == (1, 2, 3, 4)
    assert stage_parts(plan, (1, 2, 3, 4), len(layers)) == (0, 2, 6)
    # Functions between blocks stay with the block before them; block_type names the blocks.
    mixed = [nn.Embedding(4, 4), *(x for _ in range(4) for x in (Block(), abs)), nn.Linear(4, 4)]
    positions = block_positions(plan, mixed, block_type=Block)
    assert positions == (1, 3, 5, 7) and stage_parts(plan, positions, len(mixed)) == (0, 3, 10)
    with pytest.raises(DsautoError, match="no type of the 7 pipeline layers occurs 4 times"):
        block_positions(plan, [nn.Embedding(4, 4), *(Block() for _ in range(5)), nn.Linear(4, 4)])
    with pytest.raises(DsautoError, match="hold 5 Block entries but the plan's model llama-pipe has 4"):
        block_positions(plan, [nn.Embedding(4, 4), *(Block() for _ in range(5))], block_type="Block")


def test_refuses_what_a_deepspeed_pipeline_cannot_run():
    with pytest.raises(DsautoError, match="loss in 2 chunks"):
        check_pipeline_plan(pipeline_plan(0, head_split=2))
    one_stage = Planner(LLAMA, load_cluster("cpu", nodes=1, gpus_per_node=2),
                        TrainSpec(global_batch=2, seq_len=32, dtype="fp32")).build_plan(
        Strategy(dims=ParallelDims(dp=2), zero_stage=0, micro_batch=1, grad_accum=1, sequence_parallel=False),
        (4,), [PLAIN] * 6)
    with pytest.raises(DsautoError, match="no pipeline"):
        check_pipeline_plan(one_stage)
    # The hook takes only the PipelineModule cut for the config's plan.
    with pytest.raises(DsautoError, match=r"2 pipeline stages of \[1, 3\].*dsauto.deepspeed.pipeline_module"):
        check_pipeline_module(pipeline_plan(0), nn.Linear(2, 2))


def test_search_does_not_split_a_deepspeed_pipeline_head():
    pipeline = Strategy(dims=ParallelDims(dp=1, pp=2), zero_stage=1, micro_batch=1, grad_accum=2,
                        sequence_parallel=False, engine="deepspeed")
    assert {o.split for o in layer_options(pipeline)} == {1}
    # one stage splits its head's loss; Megatron-core splits no operator at all (dsauto's plugin runs them whole)
    one_stage = Strategy(dims=ParallelDims(dp=2), zero_stage=1, micro_batch=1, grad_accum=4,
                         sequence_parallel=False, engine="deepspeed")
    assert max(o.split for o in layer_options(one_stage)) > 1
    megatron = dataclasses.replace(pipeline, engine="megatron")
    assert {o.split for o in layer_options(megatron)} == {1}
    # The plans the search returns for a DeepSpeed pipeline keep the head whole.
    planner = Planner(LLAMA, load_cluster("cpu", nodes=1, gpus_per_node=2),
                      TrainSpec(global_batch=8, seq_len=64, dtype="fp32"),
                      pins=Constraints(engine="deepspeed", pp=2))
    plans = planner.search(top_k=3)
    assert plans
    for plan in plans:
        assert plan.pp == 2 and plan.layer_choice(LLAMA.num_layers + 1).split == 1


def test_a_tied_last_stage_holds_the_embedding_module_too():
    # DeepSpeed builds a TiedLayerSpec's module on every stage that uses it: the last stage keeps the
    # embedding (its token and position tables), their gradients and their optimizer state.
    tied, untied = (pipeline_plan(1, stage_layers=(3, 1), checkpointed=(), model=m)
                    for m in (TIED, dataclasses.replace(TIED, tied_embeddings=False)))
    embedding = 4 * (TIED.padded_vocab_size(1) + TIED.max_position_embeddings) * TIED.hidden_size  # fp32
    head = 4 * TIED.padded_vocab_size(1) * TIED.hidden_size  # the untied head's own matrix
    last_tied, last_untied = tied.stages[-1], untied.stages[-1]
    assert last_tied.params_bytes - (last_untied.params_bytes - head) == pytest.approx(embedding, rel=0.01)
    assert last_tied.grads_bytes - (last_untied.grads_bytes - head) == pytest.approx(embedding, rel=0.01)
    per_param = last_untied.optimizer_bytes / (last_untied.params_bytes / 4)
    extra = last_tied.optimizer_bytes - (last_untied.optimizer_bytes - per_param * head / 4)
    assert extra == pytest.approx(per_param * embedding / 4, rel=0.01)
