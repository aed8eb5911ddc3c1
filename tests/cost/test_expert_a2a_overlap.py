"""Megatron-core's overlap of a mixture of experts' all-to-alls with another micro-batch's compute
(``--overlap-moe-expert-parallel-comm``, its combined 1F1B schedule): the share of paired passes,
the exposed remainder, the plans, flags and refusals around it."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from dsauto.api import make_plan
from dsauto.cli import main
from dsauto.cost.layer import CostModel
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import Passes, expert_dispatch_seconds, overlapped_dispatch, steady_pair_fraction
from dsauto.emit.megatron import megatron_args
from dsauto.parallel import ParallelDims
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.hf import model_from_hf_config
from dsauto.spec.loaders import load_hardware
from dsauto.spec.model import layer_groups
from dsauto.spec.training import TrainSpec

CONFIGS = Path(__file__).parents[1] / "spec" / "configs"
QWEN = str(CONFIGS / "qwen3-30b-a3b.json")
PLAIN = LayerOption(checkpoint=False, shard_params=False, split=1)


def test_the_paired_share_is_what_the_combined_schedule_runs_beside_a_backward():
    # Without pipelining the first forward runs alone, then each beside the previous backward.
    assert steady_pair_fraction(1, 1, 4) == pytest.approx(3 / 4)
    assert steady_pair_fraction(1, 1, 1) == 0.0
    # Interleaved: the first rank's (pp - 1) x 2 + (v - 1) x pp warm-up forwards, and one more under
    # the overlap (schedules.py, get_pp_rank_microbatches), run alone.
    assert steady_pair_fraction(8, 4, 128) == pytest.approx((512 - (7 * 2 + 3 * 8 + 1)) / 512)
    assert steady_pair_fraction(2, 12, 32) == pytest.approx((384 - (2 + 11 * 2 + 1)) / 384)
    assert steady_pair_fraction(8, 2, 4) == 0.0  # all warm-up: nothing pairs


def _costs(overlap: bool):
    import json

    model = model_from_hf_config(json.loads(Path(QWEN).read_text()), "qwen3-30b-a3b")
    cluster = ClusterSpec(load_hardware("h100-80gb"), nodes=2, gpus_per_node=8)
    train = TrainSpec(global_batch=64, seq_len=4096, dtype="bf16")
    strategy = Strategy(dims=ParallelDims(dp=16, ep=16), zero_stage=1, micro_batch=1, grad_accum=4,
                        sequence_parallel=False, engine="megatron", expert_a2a_overlap=overlap)
    cost = CostModel(cluster, train, strategy, model.hidden_size)
    return cost, layer_groups(model, 4096, 2, 1)[1]


def test_a_pair_costs_the_overlap_of_its_compute_and_all_to_alls_and_the_rest_stays_exposed():
    on, block = _costs(True)
    off, _ = _costs(False)
    ctx = on.context
    assert ctx.expert_a2a_overlap_fraction == pytest.approx(3 / 4) and off.context.expert_a2a_overlap_fraction == 0
    dispatch = expert_dispatch_seconds(block, PLAIN, ctx)
    total = dispatch.forward_seconds + dispatch.backward_seconds
    assert total > 0  # ep 16 spans the two nodes
    a, b = on.layer(block, PLAIN), off.layer(block, PLAIN)
    work = b.forward_seconds + b.backward_seconds - total  # the layer's compute without its all-to-alls
    paired = ctx.device.overlapped(work, total) - work
    exposed = total / 4 + 3 / 4 * paired
    assert a.forward_seconds + a.backward_seconds == pytest.approx(work + exposed, rel=1e-9)
    assert a.forward_seconds + a.backward_seconds < b.forward_seconds + b.backward_seconds
    # Nothing paired: the all-to-alls as they were.
    alone = dataclasses.replace(ctx, expert_a2a_overlap_fraction=0.0)
    assert overlapped_dispatch(Passes(1.0, 2.0), dispatch, alone) == dispatch


def _plan(**pins):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_plan(QWEN, "h100-80gb", nodes=2, gpus_per_node=8, global_batch=256, seq_len=4096, ep=8,
                         pp=2, vpp=4, zero_stage=1, engine="megatron", **pins)


def test_a_pinned_overlap_is_priced_emitted_and_applied():
    from megatron.core.transformer import TransformerConfig

    import dsauto.runtime.megatron as dm

    off, on = _plan(), _plan(expert_a2a_overlap=True)
    assert on.expert_a2a_overlap and not off.expert_a2a_overlap
    assert on.prediction.step_seconds < off.prediction.step_seconds
    assert not any(c.checkpoint for c in on.layers)  # Megatron-core refuses full recomputation beside it
    assert "--overlap-moe-expert-parallel-comm" in megatron_args(on)
    assert "--overlap-moe-expert-parallel-comm" not in megatron_args(off)
    config = TransformerConfig(**dm.transformer_config_kwargs(on.model), use_cpu_initialization=True)
    assert dm.apply(on, config).overlap_moe_expert_parallel_comm
    with pytest.raises(ValueError, match="expert_a2a_overlap needs"):
        dataclasses.replace(on, virtual_stages=1)


@pytest.mark.parametrize("model, extra, message", [
    ("gpt-tiny", [], "the model has no experts"),
    (QWEN, ["--engine", "deepspeed"], "plan with --engine megatron"),
    (QWEN, ["--checkpoint", "all"], "refuses full recomputation"),
    (QWEN, ["--ep", "1"], "needs expert parallelism (ep > 1)"),
])
def test_an_overlap_that_cannot_run_is_one_sentence(model, extra, message, tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["tune", "--model", model, "--hardware", "h100-80gb", "--nodes", "2", "--gpus-per-node", "8",
                     "--seq-len", "256", "--moe-a2a-overlap", *extra, "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "--moe-a2a-overlap" in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()
