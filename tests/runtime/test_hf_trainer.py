"""Hugging Face Trainer runs a dsauto plan: 2 CPU ranks (gloo, DeepSpeed's CPU accelerator), a tiny
randomly initialised LlamaForCausalLM built from a config (nothing downloaded), the config written
``for hf`` and the hook installed with one line (``dsauto.deepspeed.install()``).

The plan is ZeRO-3 with mixed per-layer choices: blocks 1 and 3 checkpointed, blocks 1, 2 and the
head replicated (resident), the embedding and blocks 3, 4 sharded. What the worker reads back from
the engine and the model after the Trainer's steps shows each choice in effect: a checkpointed
block runs its attention twice per micro-batch (forward, and again in backward), the others once;
the resident layers hold their whole parameters, the sharded ones only their partition; the
optimizer's fp32 partition is half the model on each rank whatever the residency.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.emit.ds_config import AUTO, ds_config
from dsauto.parallel import ParallelDims
from dsauto.profile.launch import free_port
from dsauto.search.planner import Planner
from dsauto.spec.hf import model_from_hf_config
from dsauto.spec.loaders import load_cluster
from dsauto.spec.training import TrainSpec

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORKER = Path(__file__).with_name("hf_worker.py")
TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
              "tie_word_embeddings": False}
SEQ_LEN, MICRO_BATCH, GRAD_ACCUM, STEPS, SEED = 32, 2, 2, 3, 1234

KEEP = LayerOption(checkpoint=False, shard_params=False, split=1)
SHARD = LayerOption(checkpoint=False, shard_params=True, split=1)
CHECKPOINT_KEEP = LayerOption(checkpoint=True, shard_params=False, split=1)
CHECKPOINT_SHARD = LayerOption(checkpoint=True, shard_params=True, split=1)
OPTIONS = [SHARD, CHECKPOINT_KEEP, KEEP, CHECKPOINT_SHARD, SHARD, KEEP]  # flat layers 0..5


def make_plan():
    from transformers import LlamaConfig

    model = model_from_hf_config(LlamaConfig(**TINY_LLAMA).to_dict(), "tiny LlamaConfig", "tiny-llama")
    planner = Planner(model, load_cluster("cpu", nodes=1, gpus_per_node=2),
                      TrainSpec(global_batch=MICRO_BATCH * GRAD_ACCUM * 2, seq_len=SEQ_LEN, dtype="fp32"))
    strategy = Strategy(dims=ParallelDims(dp=2, tp=1, pp=1), zero_stage=3, micro_batch=MICRO_BATCH,
                        grad_accum=GRAD_ACCUM, sequence_parallel=False)
    return planner.build_plan(strategy, [model.num_layers], OPTIONS)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    plan = make_plan()
    tmp = tmp_path_factory.mktemp("hf")
    case = {"config": ds_config(plan, target="hf"), "model": TINY_LLAMA, "steps": STEPS, "seed": SEED,
            "seq_len": SEQ_LEN, "micro_batch": plan.micro_batch, "grad_accum": plan.grad_accum}
    (tmp / "case.json").write_text(json.dumps(case))
    out = tmp / "results.json"
    launcher = shutil.which("deepspeed")
    assert launcher, "the deepspeed launcher is not on PATH"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, launcher, "--include", "localhost:0,1", "--master_port", str(free_port()), str(WORKER),
         "--case", str(tmp / "case.json"), "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    # DeepSpeed 0.19.8 on CPU now and then aborts in interpreter teardown, after the results are
    # written (see test_deepspeed.py); only a failure before the end counts.
    teardown_abort = result.stderr.rstrip().endswith("terminate called without an active exception")
    assert (result.returncode == 0 or teardown_abort) and out.exists(), result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(out.read_text())


def test_hf_config_leaves_trainer_values_auto():
    config = ds_config(make_plan(), target="hf")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        assert config[key] == AUTO
    assert {config["optimizer"]["params"][k] for k in ("lr", "betas", "eps", "weight_decay")} == {AUTO}
    assert "scheduler" not in config  # TrainingArguments' lr_scheduler_type applies
    assert config["zero_optimization"]["stage"] == 3  # the plan's
    assert config["bf16"] == config["fp16"] == {"enabled": False}  # an fp32 plan, stated


@pytest.mark.slow
def test_trainer_trains_through_the_hook(run):
    assert run["engine"] == "DeepSpeedEngine" and run["hook"]
    assert len(run["losses"]) == STEPS and all(math.isfinite(loss) for loss in run["losses"])
    # HF filled the "auto" batch keys from TrainingArguments, which follow the plan.
    assert (run["zero_stage"], run["micro_batch"], run["grad_accum"]) == (3, MICRO_BATCH, GRAD_ACCUM)


@pytest.mark.slow
def test_planned_blocks_are_checkpointed(run):
    assert run["checkpointed"] == [1, 3]
    # A checkpointed block's attention runs in the forward pass and again in the backward pass.
    assert run["attention_calls_per_micro_step"] == [2.0, 1.0, 2.0, 1.0]


@pytest.mark.slow
def test_zero3_residency_is_the_plan(run):
    assert run["resident_layers"] == [1, 2, 5]
    gathered, full, persistent = run["gathered_per_layer"], run["full_per_layer"], run["persistent_per_layer"]
    for layer in (1, 2, 5):  # replicated: whole and persistent after the steps
        assert gathered[layer] == full[layer] == persistent[layer] > 0
    for layer in (0, 3, 4):  # sharded: at most the norm vectors DeepSpeed's threshold keeps
        assert gathered[layer] <= 0.02 * full[layer]
    # Optimizer states stay sharded whatever the residency: half of the model on each rank.
    assert run["optimizer_partition"] == pytest.approx(run["total_params"] / 2, rel=0.01)
