"""Selective recomputation applied by the DeepSpeed hook (dsauto.runtime.recompute) on real engines:
2 ranks, gloo, CPU accelerator, gpt-tiny in fp32 (learned positions, LayerNorm, GeLU MLP with biases).

One launch of tests/runtime/ds_worker.py trains each case for a few steps from the same seed and data.
Recomputation re-runs the same operations on the same values, so the losses are bit-identical to the
run without it. The tensor bytes the forward leaves alive are compared with the plan's kept
activations, and under ZeRO-3 the parameter elements all-gathered per step with the plan's count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from test_deepspeed import SEED, SEQ_LEN, launch
from torch import nn

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.emit.ds_config import ds_config
from dsauto.errors import DsautoError
from dsauto.models import build_model
from dsauto.models.data import synthetic_batch
from dsauto.parallel import ParallelDims
from dsauto.plan import Plan
from dsauto.profile.memory import MemoryTracker
from dsauto.runtime.deepspeed import plan_from_config, prepare_model
from dsauto.search.planner import Planner
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec

STEPS = 2
MICRO_BATCH = 2
ALL = ("core_attn", "layernorm", "mlp")


def make_plan(zero_stage: int, modules: tuple[str, ...], shard: bool = False) -> Plan:
    """gpt-tiny on 2 CPU ranks, micro-batch 2 x 64 tokens, fp32; every transformer layer recomputes
    ``modules``; under ZeRO-3 ``shard`` shards every layer group."""
    planner = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=1, gpus_per_node=2),
                      TrainSpec(global_batch=4, seq_len=SEQ_LEN, dtype="fp32"))
    strategy = Strategy(dims=ParallelDims(dp=2, tp=1, pp=1), zero_stage=zero_stage, micro_batch=MICRO_BATCH,
                        grad_accum=1, sequence_parallel=False, recompute_modules=modules)
    edge = LayerOption(checkpoint=False, shard_params=shard, split=1)
    return planner.build_plan(strategy, [4], [edge, *[dataclasses.replace(edge, recompute_modules=modules)] * 4, edge])


PLANS = {
    "zero1-selective": make_plan(1, ALL),
    "zero3-none": make_plan(3, (), shard=True),
    "zero3-selective": make_plan(3, ALL, shard=True),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Any]:
    cases = [{"name": name, "config": ds_config(plan), "plan": plan.to_dict(), "api": "dsauto",
              "optimizer": "config", "steps": STEPS, "seed": SEED, "seq_len": SEQ_LEN,
              "vocab_size": plan.padded_vocab_size, "measure": True} for name, plan in PLANS.items()]
    found = launch(cases, tmp_path_factory.mktemp("ds-selective"))
    errors = {name: r["traceback"] for name, r in found.items() if "error" in r}
    assert not errors, errors
    return found


def test_selective_recomputation_keeps_losses_bit_for_bit(results):
    for run in ("zero1-selective", "zero3-selective"):
        assert results[run]["recomputed"] == {str(layer): list(ALL) for layer in range(1, 5)}
        assert results[run]["checkpointed"] == []
    assert results["zero3-selective"]["losses"] == results["zero3-none"]["losses"]


def test_kept_bytes_are_the_predicted_ones(results):
    # The plan's kept activations, plus the loss's fp32 log-softmax (tokens x vocabulary x 4 bytes),
    # which autograd keeps from the forward and the cost model counts among the head's transients
    # (logits_bytes_per_token). Under ZeRO-1: under ZeRO-3 the gathered parameters that outlive the
    # forward (the tied embedding, used again by the head) are counted too.
    plan = PLANS["zero1-selective"]
    measured = results["zero1-selective"]["kept_bytes"]
    predicted = plan.stages[0].activation_bytes + MICRO_BATCH * SEQ_LEN * plan.padded_vocab_size * 4
    print(f"zero1-selective: kept {measured} bytes after forward, predicted {predicted:.0f}")
    assert measured == pytest.approx(predicted, rel=0.10)


def test_the_saving_is_the_modules_priced_share(results):
    # Korthikanti et al. 2022, Sec. 4.1: the two norm outputs (2 x h per token) and the GeLU MLP's
    # input and output (2 x 4h per token), fp32; the fused attention kernel keeps no scores, so the
    # attention core frees only its softmax statistics (4 bytes per head and token, counted as nothing).
    h, tokens, layers = 128, MICRO_BATCH * SEQ_LEN, 4
    predicted = PLANS["zero3-none"].stages[0].activation_bytes - PLANS["zero3-selective"].stages[0].activation_bytes
    assert predicted == layers * tokens * (2 * h + 8 * h) * 4
    measured = results["zero3-none"]["kept_bytes"] - results["zero3-selective"]["kept_bytes"]
    print(f"ZeRO-3: recomputation frees {measured} bytes, predicted {predicted}")
    assert measured == pytest.approx(predicted, rel=0.10)


def test_zero3_gathers_no_more_once_its_trace_is_recorded(results):
    # In the first step, while DeepSpeed records the modules' order, the recomputed MLP's first matrix
    # is all-gathered again for the recomputation inside backward. From the second step on the
    # coordinator's trace keeps it gathered until the module's backward: no more all-gathers than
    # without recomputation, as the cost model prices the steady state.
    none, selective = (results[f"zero3-{r}"]["gathered_per_step"] for r in ("none", "selective"))
    print(f"ZeRO-3 all-gathered elements per step: {none} without recomputation, {selective} with")
    assert selective[0] > none[0]
    assert none[-1] > 0 and selective[-1] == none[-1]


class HfStyleBlock(nn.Module):
    """A Hugging Face-style decoder layer: attention, MLP and norms under their Llama names."""

    def __init__(self, h: int):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(h), nn.LayerNorm(h)
        self.self_attn, self.mlp = nn.Linear(h, h), nn.Linear(h, h)


def test_a_block_without_the_module_is_refused_by_name():
    plan = make_plan(1, ("core_attn",))
    model = build_model(plan.model, vocab_size=plan.padded_vocab_size)
    model.layers[2] = HfStyleBlock(plan.model.hidden_size)  # one block of another class
    with pytest.raises(DsautoError, match=r"recomputes core_attn in transformer layer 3 \(HfStyleBlock\), but "
                                          r"the block has no 'core_attention' submodule"):
        prepare_model(plan, model)
    assert "forward" not in vars(model.layers[0].core_attention)  # nothing was changed


def test_hugging_face_names_are_found():
    plan = make_plan(1, ("layernorm", "mlp"))
    model = build_model(plan.model, vocab_size=plan.padded_vocab_size)
    model.layers = nn.ModuleList(HfStyleBlock(plan.model.hidden_size) for _ in range(4))
    applied = prepare_model(plan, model)
    assert applied.recomputed == {layer: ("layernorm", "mlp") for layer in range(1, 5)}
    assert all("forward" in vars(m) for b in model.layers for m in (b.mlp, b.input_layernorm,
                                                                    b.post_attention_layernorm))


def test_the_plan_rides_in_the_config_block_the_hook_reads():
    plan = PLANS["zero3-selective"]
    config = ds_config(plan)
    assert plan_from_config(config) == plan
    assert [run.recompute_modules for run in plan_from_config(config).layers if run.group == "decoder"] == [ALL]


def test_layers_recompute_what_their_run_says():
    plan = make_plan(1, ("mlp",))
    runs = list(plan.layers)
    decoder = runs[1]
    runs[1:2] = [dataclasses.replace(decoder, last=2),
                 dataclasses.replace(decoder, first=3, recompute_modules=("core_attn", "layernorm"))]
    mixed = dataclasses.replace(plan, layers=tuple(runs))
    model = build_model(plan.model, vocab_size=plan.padded_vocab_size)
    applied = prepare_model(mixed, model)
    assert applied.recomputed == {1: ("mlp",), 2: ("mlp",), 3: ("core_attn", "layernorm"),
                                  4: ("core_attn", "layernorm")}
    assert ["mlp" in vars(block) for block in model.layers] == [True, True, False, False]
    assert ["forward" in vars(block.core_attention) for block in model.layers] == [False, False, True, True]


MOE = ModelSpec(name="moe-tiny", architecture="decoder", num_layers=3, hidden_size=64, num_attention_heads=4,
                ffn_hidden_size=128, vocab_size=100, max_position_embeddings=64, mlp="gelu", norm="rmsnorm",
                position_embedding="rope", linear_bias=False, dropout=False, tied_embeddings=False,
                num_experts=4, moe_top_k=2, moe_ffn_hidden_size=48, shared_expert_ffn_hidden_size=32,
                moe_first_dense_layers=1)


def test_moe_layers_recompute_their_norms_and_the_dense_layer_its_mlp():
    # Like Megatron-core's "mlp", the hook recomputes the dense MLP only; the MoE layers' experts are
    # not recomputed, and the cost model frees the dense layers' MLP activations only. Checked in one
    # process on the reference model: same loss and gradients bit for bit, and the bytes freed. (A GeLU
    # MLP: the reference model's unfused SwiGLU keeps silu(gate) too, f bytes per token more than the
    # gate, up and product the model counts after Megatron-core's fused kernel, and frees it as well.)
    seq, micro, modules = 32, 2, ("layernorm", "mlp")
    planner = Planner(MOE, load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(global_batch=4, seq_len=seq,
                                                                                    dtype="fp32"))
    edge = LayerOption(checkpoint=False, shard_params=False, split=1)
    plain, plan = (planner.build_plan(
        Strategy(dims=ParallelDims(dp=2, tp=1, pp=1), zero_stage=1, micro_batch=micro, grad_accum=1,
                 sequence_parallel=False, recompute_modules=m),
        [3], [edge, *[dataclasses.replace(edge, recompute_modules=m)] * 3, edge]) for m in ((), modules))
    tokens, labels = synthetic_batch(plan.padded_vocab_size, micro, seq, 0, 0, seed=SEED)
    runs = {}
    for name, p in (("plain", plain), ("selective", plan)):
        model = build_model(MOE, seed=SEED, vocab_size=plan.padded_vocab_size)
        runs[name] = prepare_model(p, model), model
    assert ["mlp" in vars(block) for block in runs["selective"][1].layers] == [True, False, False]
    kept, grads, losses = {}, {}, {}
    for name, (_, model) in runs.items():
        with MemoryTracker() as forward:
            loss = model(tokens, labels)
        kept[name], losses[name] = forward.final_bytes(), loss.item()
        loss.backward()
        grads[name] = [p.grad for p in model.parameters()]
    assert losses["plain"] == losses["selective"]
    assert all(torch.equal(a, b) for a, b in zip(grads["plain"], grads["selective"], strict=True))
    h, f, tokens_count = MOE.hidden_size, MOE.ffn_hidden_size, micro * seq
    predicted = plain.stages[0].activation_bytes - plan.stages[0].activation_bytes
    assert predicted == pytest.approx(tokens_count * (3 * 2 * h + 2 * f) * 4)  # 3 layers' norms, 1 GeLU MLP
    assert kept["plain"] - kept["selective"] == pytest.approx(predicted, rel=0.10)
