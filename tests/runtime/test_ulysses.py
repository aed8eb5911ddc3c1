"""DeepSpeed-Ulysses on 2 CPU ranks (gloo has the all-to-all it needs): a cp=2 plan through the
DeepSpeed hook trains the same network as one process on the whole sequences.

Tolerance: fp32 throughout; the sp=2 run sums each gradient from two halves of the sequence (and
DeepSpeed all-reduces them) where the reference sums it at once, a reordering of a few ulps per
step that plain SGD carries on without amplifying. A wrong gradient scale (each rank's loss not
divided by cp) doubles every update and moves the second loss by about 1e-3 relative."""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron_launch import launch

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.plan import Plan
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_cluster
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec

WORKER = Path(__file__).resolve().parent / "ulysses_worker.py"

# A LLaMA-style decoder (rotary positions, grouped-query attention: 4 query and 2 key/value heads,
# both split over cp = 2), small enough to train in seconds.
LLAMA = ModelSpec(name="llama-test", architecture="decoder", num_layers=2, hidden_size=64,
                  num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=128, vocab_size=256,
                  max_position_embeddings=64, mlp="swiglu", norm="rmsnorm", position_embedding="rope",
                  tied_embeddings=False, linear_bias=False, dropout=False)
STEPS = 4


def ulysses_plan(zero_stage: int, checkpoint: bool = False) -> Plan:
    train = TrainSpec(global_batch=2, seq_len=64, dtype="fp32")
    strategy = Strategy(dims=ParallelDims(dp=1, tp=1, pp=1, cp=2), zero_stage=zero_stage, micro_batch=2,
                        grad_accum=1, sequence_parallel=False, engine="deepspeed")
    option = LayerOption(checkpoint=False, shard_params=False, split=1)
    options = [option, *[LayerOption(checkpoint=checkpoint, shard_params=False, split=1)] * 2, option]
    return Planner(LLAMA, load_cluster("cpu", nodes=1, gpus_per_node=2), train).build_plan(strategy, (2,), options)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = {"zero0": {"plan": ulysses_plan(0), "engine": "deepspeed"},
            "zero1-checkpointed": {"plan": ulysses_plan(1, checkpoint=True), "engine": "deepspeed"}}
    return launch(2, runs, tmp_path_factory.mktemp("ulysses"), steps=STEPS, seed=3, lr=0.5, worker=WORKER)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero0", "zero1-checkpointed"])
def test_sp2_trains_like_one_process(results, name):
    run = results[name]
    assert run["sequence_parallel_size"] == 2 and run["seq_dp_world_size"] == 2
    assert run["wrapped"] == LLAMA.num_layers  # every block's attention runs DistributedAttention
    assert run["losses"] == pytest.approx(run["reference"], rel=1e-5)
    assert run["losses"][-1] < run["losses"][0]
    assert run["weight_difference"] < 1e-5


def test_models_ulysses_cannot_run_are_refused_in_one_sentence():
    from dsauto.errors import DsautoError
    from dsauto.models import build_model
    from dsauto.runtime.layers import find_layers
    from dsauto.runtime.ulysses import sequence_shard, wrap_attention
    from dsauto.spec.loaders import load_model

    plan = ulysses_plan(0)
    gpt = build_model(load_model("gpt-tiny"))  # learned positions, indexed within the input
    with pytest.raises(DsautoError, match="learned position embeddings"):
        wrap_attention(find_layers(gpt), plan, mpu=None)
    llama = build_model(LLAMA)
    del llama.layers[1].core_attention  # a block whose attention dsauto cannot find
    with pytest.raises(DsautoError, match="transformer layer 2 .* neither a DistributedAttention nor"):
        wrap_attention(find_layers(llama), plan, mpu=None)
    import torch

    tokens = torch.arange(2 * 64).view(2, 64)
    assert sequence_shard(tokens, plan, 1).tolist() == tokens[:, 32:].tolist()
    with pytest.raises(DsautoError, match="63 tokens does not split into cp=2"):
        sequence_shard(tokens[:, :63], plan, 0)
