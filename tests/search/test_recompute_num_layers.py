"""--recompute-num-layers N pins Megatron's block recomputation: the first N transformer layers of
every pipeline stage (of every model chunk with virtual stages) checkpointed whole, the others not.
The search still chooses the layout and everything else, prices and bounds memory with exactly
those layers, and emits the same N; pins it cannot go with are refused in one sentence."""

from __future__ import annotations

import itertools
import re

import pytest

from dsauto.api import find_plans, make_plan, make_problem
from dsauto.cli import main
from dsauto.cost.strategy import LayerOption
from dsauto.emit.megatron import megatron_args
from dsauto.engines.megatron import block_recompute_layers
from dsauto.errors import DsautoError
from dsauto.plan_io import read_plan
from dsauto.refine.space import candidates, options_of, strategy_of
from dsauto.search.planner import Planner
from dsauto.search.space import SPLITS

# Llama 3 8B (32 layers) on 8 H100s at 8K tokens: without a pin the search checkpoints some layers.
LLAMA = dict(nodes=1, global_batch=64, seq_len=8192, micro_batch=1, engine="megatron", tp=2)


def recompute_flags(plan) -> list[str]:
    return [line for line in megatron_args(plan) if line.startswith("--recompute")]


def assert_block(plan, n: int) -> None:
    """``plan`` checkpoints the first ``n`` layers of each model chunk and nothing else."""
    checkpointed = set(plan.checkpointed_layers())
    wanted = {layer for chunk in plan.stage_ranges() for layer in list(chunk)[:n]}
    assert checkpointed == wanted
    longest = max(len(chunk) for chunk in plan.stage_ranges())
    assert block_recompute_layers(plan) == min(n, longest)
    assert recompute_flags(plan) == ["--recompute-granularity full", "--recompute-method block",
                                     f"--recompute-num-layers {min(n, longest)}"]


@pytest.mark.parametrize("pp, vpp, n", [(1, 1, 5), (4, 1, 3), (4, 2, 2), (2, 4, 1), (4, 2, 40)])
def test_the_first_n_layers_of_every_chunk_are_checkpointed(pp, vpp, n):
    plan = make_plan("llama3-8b", "h100-80gb", **LLAMA, pp=pp, vpp=vpp, recompute_num_layers=n)
    assert (plan.pp, plan.virtual_stages) == (pp, vpp)
    assert_block(plan, n)
    assert plan.prediction.peak_memory_bytes <= plan.memory_budget_bytes
    # the prediction is that of the plan's own choices
    problem = make_problem("llama3-8b", "h100-80gb", **LLAMA, pp=pp, vpp=vpp, recompute_num_layers=n)
    rebuilt = Planner(problem.model, problem.cluster, problem.train, problem.pins).build_plan(
        strategy_of(plan), plan.stage_layers, options_of(plan))
    assert rebuilt.prediction.step_seconds == pytest.approx(plan.prediction.step_seconds)
    assert rebuilt.prediction.peak_memory_bytes == pytest.approx(plan.prediction.peak_memory_bytes)


def test_pinning_the_block_the_search_chose_reproduces_its_plan():
    # micro-batches of 2 x 8K tokens on one unsharded-activation rank: the search checkpoints most layers
    pins = dict(nodes=1, global_batch=64, seq_len=8192, micro_batch=2, engine="megatron", tp=1, pp=1, zero_stage=1)
    chosen = make_plan("llama3-8b", "h100-80gb", **pins)
    n = block_recompute_layers(chosen)
    assert n and 0 < len(chosen.checkpointed_layers()) < 32
    pinned = make_plan("llama3-8b", "h100-80gb", **pins, recompute_num_layers=n)
    assert pinned.checkpointed_layers() == chosen.checkpointed_layers()
    assert pinned.prediction.step_seconds == pytest.approx(chosen.prediction.step_seconds)
    # a block of one layer fewer or more either does not fit or is not faster
    for other in (n - 1, n + 1):
        try:
            plan = make_plan("llama3-8b", "h100-80gb", **pins, recompute_num_layers=other)
        except DsautoError as error:
            assert "does not fit" in str(error)
            continue
        assert plan.prediction.step_seconds >= chosen.prediction.step_seconds * (1 - 1e-9)


def test_n_covering_every_chunk_is_checkpoint_all():
    every = make_plan("llama3-8b", "h100-80gb", **LLAMA, pp=4, vpp=2, checkpoint=True)
    block = make_plan("llama3-8b", "h100-80gb", **LLAMA, pp=4, vpp=2, recompute_num_layers=32)
    assert block.stage_layers == every.stage_layers
    assert block.checkpointed_layers() == tuple(range(1, 33))
    assert block.prediction.step_seconds == pytest.approx(every.prediction.step_seconds)
    assert block.prediction.peak_memory_bytes == pytest.approx(every.prediction.peak_memory_bytes)


@pytest.mark.parametrize("n, limit", [(1, "12MiB"), (2, "9MiB")])
def test_the_search_finds_the_fastest_block_plan_that_fits(n, limit):
    """Brute force on a small pipeline: every layout of gpt-tiny's 4 layers on pp 2 with the pinned
    block and every split of the head's loss, priced by build_plan; the search's plan is the fastest
    of those that fit, under a budget that rules out some of them."""
    pins = dict(gpus_per_node=4, pp=2, vpp=1, engine="megatron", zero_stage=1, micro_batch=2, global_batch=16,
                memory_limit=limit)
    problem = make_problem("gpt-tiny", "cpu", **pins, recompute_num_layers=n)
    planner = Planner(problem.model, problem.cluster, problem.train, problem.pins)
    plan = find_plans(problem)[0]
    strategy, L = strategy_of(plan), problem.model.num_layers
    plain = LayerOption(checkpoint=False, shard_params=False, split=1)
    best, fitting, over = None, 0, 0
    for first, split in itertools.product(range(1, L), SPLITS):
        layout = (first, L - first)
        checkpointed = {layer for start, count in ((1, first), (first + 1, L - first))
                        for layer in range(start, start + min(n, count))}
        options = ([plain] + [LayerOption(j in checkpointed, False, 1) for j in range(1, L + 1)]
                   + [LayerOption(False, False, split)])
        priced = planner.build_plan(strategy, layout, options)
        if priced.prediction.peak_memory_bytes > problem.cluster.memory_budget_bytes:
            over += 1
            continue
        fitting += 1
        if best is None or priced.prediction.step_seconds < best.prediction.step_seconds:
            best = priced
    assert fitting and over  # the budget binds
    assert_block(plan, n)
    assert plan.prediction.step_seconds == pytest.approx(best.prediction.step_seconds, rel=1e-9)


def test_a_block_too_small_to_fit_says_so_with_the_memory_it_needs():
    with pytest.raises(DsautoError, match="does not fit") as caught:
        make_plan("llama3-8b", "h100-80gb", nodes=1, global_batch=64, seq_len=8192, micro_batch=2, engine="megatron",
                  tp=1, pp=1, zero_stage=1, recompute_num_layers=16)
    needed = float(re.search(r"needs at least ([\d.]+) GiB", str(caught.value)).group(1))
    assert needed > 77.0  # a lower bound with at most 16 layers checkpointed, above the 77 GiB budget
    # with the search's own choice it fits, checkpointing more layers
    free = make_plan("llama3-8b", "h100-80gb", nodes=1, global_batch=64, seq_len=8192, micro_batch=2,
                     engine="megatron", tp=1, pp=1, zero_stage=1)
    assert len(free.checkpointed_layers()) > 16


def test_deepspeed_plans_checkpoint_the_first_layers_of_each_stage():
    plan = make_plan("gpt-tiny", "cpu", gpus_per_node=4, pp=2, engine="deepspeed", stage_layers="2,2",
                     recompute_num_layers=1)
    assert plan.checkpointed_layers() == (1, 3)


def test_the_refinement_keeps_the_pinned_layers():
    problem = make_problem("gpt-tiny", "cpu", gpus_per_node=4, pp=2, engine="megatron", recompute_num_layers=1)
    planner = Planner(problem.model, problem.cluster, problem.train, problem.pins)
    space = candidates(planner, find_plans(problem, top_k=2))
    assert space and {c.knobs.checkpoint_delta for c in space} == {0}


GPT = ["--model", "gpt-tiny", "--gpus-per-node", "4", "--pp", "2"]


@pytest.mark.parametrize("argv, said", [
    ([*GPT, "--recompute-num-layers", "2", "--checkpoint", "all"],
     "--recompute-num-layers 2 and --checkpoint all both say which transformer layers to checkpoint"),
    ([*GPT, "--recompute-num-layers", "2", "--checkpoint", "none"],
     "--recompute-num-layers 2 and --checkpoint none both say which transformer layers to checkpoint"),
    ([*GPT, "--recompute-num-layers", "1", "--recompute-modules", "core_attn"],
     "--recompute-num-layers 1 checkpoints whole layers and --recompute-modules core_attn recomputes parts of "
     "every layer"),
    ([*GPT, "--recompute-num-layers", "1", "--moe-a2a-overlap"],
     "which Megatron-core refuses beside the expert all-to-alls' overlap"),
    ([*GPT, "--recompute-num-layers", "0"], "expected a positive number, got 0"),
])
def test_pins_it_cannot_go_with_are_one_sentence_exit_2_and_no_files(tmp_path, capsys, argv, said):
    code = main(["tune", *argv, "--out", str(tmp_path)])
    error = capsys.readouterr().err.strip()
    assert code == 2, error
    assert len(error.splitlines()) == 1 and said in error
    assert not list(tmp_path.iterdir())


def test_the_api_refuses_zero():
    with pytest.raises(DsautoError, match=r"recompute_num_layers=0 is not a pin .* a whole number from 1"):
        make_plan("gpt-tiny", "cpu", recompute_num_layers=0)


def test_the_pin_reaches_the_emitted_flags_and_plan_yaml(tmp_path):
    assert main(["tune", *GPT, "--vpp", "1", "--engine", "megatron", "--recompute-num-layers", "1",
                 "--out", str(tmp_path)]) == 0
    plan = read_plan(tmp_path / "plan.yaml")
    assert_block(plan, 1)
    assert "--recompute-num-layers 1" in (tmp_path / "megatron_args.txt").read_text()


def test_a_count_above_every_chunk_is_written_as_the_chunks_and_said():
    """Megatron-core checkpoints all of a block's layers when N exceeds them: a pinned 50 over chunks of
    at most 5 layers is written as 5, and a warning says so."""
    from dsauto.errors import DsautoWarning

    problem = make_problem("llama3-70b", "h100-80gb", nodes=4, engine="megatron", pp=4, vpp=4,
                           recompute_num_layers=50)
    with pytest.warns(DsautoWarning, match=r"--recompute-num-layers 50 checkpoints every layer of the plan's model "
                                           r"chunks, which hold 5 at most: its files write --recompute-num-layers 5"):
        plan = find_plans(problem)[0]
    assert "--recompute-num-layers 5" in megatron_args(plan)
