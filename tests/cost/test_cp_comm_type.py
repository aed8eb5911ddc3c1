"""Megatron-core's three ways for context parallelism to exchange a sequence's shards
(``--cp-comm-type``: Transformer Engine's ring, all-gather and all-to-all): each priced as Transformer
Engine runs it, chosen by the search or pinned, emitted, applied, and refused where it cannot run."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import yaml

from dsauto.api import make_plan, make_problem
from dsauto.cli import main
from dsauto.cost.layer import CostModel
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import attention_passes, context_parallel_seconds, ulysses_seconds
from dsauto.emit.megatron import megatron_args
from dsauto.errors import DsautoError
from dsauto.parallel import ParallelDims
from dsauto.plan_io import plan_from_data, plan_yaml_text
from dsauto.search.space import strategies
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.loaders import load_hardware, load_model
from dsauto.spec.model import layer_groups
from dsauto.spec.training import TrainSpec

CONFIGS = Path(__file__).parents[1] / "spec" / "configs"
PLAIN = LayerOption(checkpoint=False, shard_params=False, split=1)
CHECKPOINTED = LayerOption(checkpoint=True, shard_params=False, split=1)
SEQ = 65536
CP = 8


def costs(cp_comm_type: str, engine: str = "megatron"):
    """llama3-8b at 64K tokens on two nodes of H100s, cp 8 (a node) x dp 2."""
    cluster = ClusterSpec(load_hardware("h100-80gb"), nodes=2, gpus_per_node=8)
    train = TrainSpec(global_batch=2, seq_len=SEQ, dtype="bf16")
    strategy = Strategy(dims=ParallelDims(dp=2, cp=CP), zero_stage=1, micro_batch=1, grad_accum=1,
                        sequence_parallel=False, engine=engine, cp_comm_type=cp_comm_type)
    model = load_model("llama3-8b")
    cost = CostModel(cluster, train, strategy, model.hidden_size)
    (_, block, _) = layer_groups(model, SEQ, 2, 1)
    return cost, block


def test_all_gather_gathers_keys_and_values_before_attention_and_scatters_their_gradients_exposed():
    cost, block = costs("all_gather")
    ctx = cost.context
    # This rank's share: 8192 of the 65536 tokens, keys and values of 8 heads of 128, in bf16.
    share = SEQ // CP * 2 * 8 * 128 * 2
    assert cost.tokens * block.kv_bytes_per_token == share
    gather = ctx.cp_group.all_gather(CP * share)
    scatter = ctx.cp_group.reduce_scatter(CP * share)
    assert gather > 0 and scatter > 0
    plain = context_parallel_seconds(block, PLAIN, ctx)
    assert (plain.forward_seconds, plain.backward_seconds) == pytest.approx((gather, 2 * gather))
    # A checkpointed layer's recomputed forward gathers once more.
    assert context_parallel_seconds(block, CHECKPOINTED, ctx).backward_seconds == pytest.approx(3 * gather)
    # The gathered keys and values, and their full-length gradients, are a transient of the layer.
    ring, _ = costs("p2p")
    assert (cost.layer(block, PLAIN).transient_bytes - ring.layer(block, PLAIN).transient_bytes
            == pytest.approx(2 * CP * share))


def test_the_ring_hides_its_sends_under_attention_and_exposes_them_again_when_recomputed():
    cost, block = costs("p2p")
    ctx = cost.context
    share = cost.tokens * block.kv_bytes_per_token
    sends = (CP - 1) * ctx.cp_ring.send_recv(share)
    attention = attention_passes(block, ctx)
    plain = context_parallel_seconds(block, PLAIN, ctx)
    expected = ctx.device.overlapped(attention.forward_seconds, sends) - attention.forward_seconds
    assert plain.forward_seconds == pytest.approx(expected)
    again = context_parallel_seconds(block, CHECKPOINTED, ctx)
    assert again.backward_seconds == pytest.approx(plain.backward_seconds + plain.forward_seconds)


def test_a2a_is_priced_as_ulysses_all_to_alls_over_the_cp_group():
    cost, block = costs("a2a")
    ctx = cost.context
    assert ctx.cp_all_to_all is not None and ctx.cp_group is not None
    a2a = context_parallel_seconds(block, PLAIN, ctx)
    assert a2a.forward_seconds > 0 and a2a == ulysses_seconds(block, PLAIN, ctx)
    # DeepSpeed's cp is DeepSpeed-Ulysses over the same group, whatever the field says.
    ds, _ = costs("p2p", engine="deepspeed")
    assert context_parallel_seconds(block, PLAIN, ds.context) == pytest.approx(a2a)
    # The three compute the same; only their exchanges differ.
    ring, _ = costs("p2p")
    gathered, _ = costs("all_gather")
    steps = [c.layer(block, PLAIN).forward_seconds for c in (ring, gathered, cost)]
    compute = ring.layer(block, PLAIN).forward_seconds - context_parallel_seconds(block, PLAIN, ring.context).forward_seconds
    for c, step in zip((ring, gathered, cost), steps):
        assert step - context_parallel_seconds(block, PLAIN, c.context).forward_seconds == pytest.approx(compute)


def _plan(**pins):
    return make_plan("llama3-8b", "h100-80gb", nodes=2, gpus_per_node=8, global_batch=32, seq_len=SEQ,
                     engine="megatron", tp=1, zero_stage=1, micro_batch=1, **{"cp": CP, **pins})


def test_the_search_tries_each_way_that_runs_and_keeps_the_fastest():
    def tried(cp: int) -> set[str]:
        problem = make_problem("llama3-8b", "h100-80gb", nodes=2, gpus_per_node=8, global_batch=32, seq_len=SEQ,
                               engine="megatron", tp=1, cp=cp, zero_stage=1, micro_batch=1)
        return {s.cp_comm_type for s in strategies(problem.model, problem.cluster, problem.train, problem.pins)}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # a2a splits llama3-8b's 8 key/value heads over cp: 8 of them, not 16.
        assert tried(CP) == {"p2p", "all_gather", "a2a"} and tried(16) == {"p2p", "all_gather"}
        chosen = _plan()
        pinned = {t: _plan(cp_comm_type=t) for t in ("p2p", "all_gather", "a2a")}
    fastest = min(pinned.values(), key=lambda p: p.prediction.step_seconds)
    assert chosen.cp_comm_type == fastest.cp_comm_type
    assert chosen.prediction.step_seconds == pytest.approx(fastest.prediction.step_seconds)
    # Pinned, emitted and kept in plan.yaml.
    plan = pinned["all_gather"]
    assert plan.cp_comm_type == "all_gather" and "--cp-comm-type all_gather" in megatron_args(plan)
    assert plan_from_data(yaml.safe_load(plan_yaml_text(plan)), "plan.yaml").cp_comm_type == "all_gather"
    assert "--cp-comm-type p2p" in megatron_args(pinned["p2p"])
    assert pinned["all_gather"].prediction.step_seconds > pinned["p2p"].prediction.step_seconds


def test_the_megatron_plugin_gives_the_config_the_plans_way():
    from megatron.core.transformer import TransformerConfig

    import dsauto.runtime.megatron as dm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan("llama3-8b", "h100-80gb", nodes=2, gpus_per_node=8, global_batch=32, seq_len=SEQ,
                         engine="megatron", tp=1, cp=CP, zero_stage=1, micro_batch=1, cp_comm_type="all_gather")
        config = TransformerConfig(**dm.transformer_config_kwargs(plan.model), use_cpu_initialization=True)
        assert dm.apply(plan, config).cp_comm_type == "all_gather"


def test_sliding_window_attention_is_not_given_the_ring():
    model = str(CONFIGS / "mistral-7b-v0.1.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(model, "h100-80gb", nodes=2, gpus_per_node=8, global_batch=32, seq_len=32768,
                         engine="megatron", cp=4)
        assert plan.cp == 4 and plan.cp_comm_type in ("all_gather", "a2a")
        with pytest.raises(DsautoError, match=r"^--cp-comm-type p2p cannot run with --cp 4: Transformer Engine's "
                                              r"ring \(cp_comm_type p2p\) does not run sliding-window attention"):
            make_plan(model, "h100-80gb", nodes=2, gpus_per_node=8, global_batch=32, seq_len=32768,
                      engine="megatron", cp=4, cp_comm_type="p2p")


@pytest.mark.parametrize("extra, message", [
    (["--engine", "deepspeed", "--cp-comm-type", "a2a"], "under DeepSpeed cp is DeepSpeed-Ulysses"),
    (["--engine", "deepspeed", "--cp-comm-type", "p2p"], "under DeepSpeed cp is DeepSpeed-Ulysses"),
    (["--cp", "1", "--cp-comm-type", "all_gather"], "--cp 1 has none"),
    (["--cp", "16", "--tp", "1", "--cp-comm-type", "a2a"], "splits the 8 key/value heads over tp x cp = 1 x 16"),
])
def test_a_way_that_cannot_run_is_one_sentence(extra, message, tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["tune", "--model", "llama3-8b", "--hardware", "h100-80gb", "--nodes", "2", "--gpus-per-node",
                     "8", "--seq-len", str(SEQ), "--global-batch", "32", *extra, "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "--cp-comm-type" in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_a_plan_built_by_hand_keeps_the_rule():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = _plan(cp_comm_type="all_gather")
    with pytest.raises(ValueError, match="cp_comm_type all_gather needs a Megatron-core plan"):
        dataclasses.replace(plan, engine="deepspeed", attention_kernel="flash")
    with pytest.raises(ValueError, match="cp_comm_type must be one of p2p, all_gather, a2a"):
        dataclasses.replace(plan, cp_comm_type="ring")


def test_the_search_drops_an_exchange_its_twin_beats_in_time_and_memory_before_solving():
    from dsauto.search.planner import Planner, _without_dominated_exchanges

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problem = make_problem("llama3-8b", "h100-80gb", nodes=2, gpus_per_node=8, global_batch=32, seq_len=SEQ,
                               engine="megatron", tp=1, pp=1, cp=CP, zero_stage=1, micro_batch=1,
                               recompute_modules="none")
    planner = Planner(problem.model, problem.cluster, problem.train, problem.pins)
    space = [s for s in strategies(problem.model, problem.cluster, problem.train, problem.pins)
             if s.dist_opt_instances == 1]
    assert sorted(s.cp_comm_type for s in space) == ["a2a", "all_gather", "p2p"]
    priced = [planner._price(s) for s in space]
    kept, kept_prices = _without_dominated_exchanges(space, priced)
    by_type = {s.cp_comm_type: p for s, p in zip(space, priced)}
    # all_gather exposes its gathers and holds the gathered keys and values: the ring beats it on both.
    assert (by_type["all_gather"].time >= by_type["p2p"].time).all()
    assert (by_type["all_gather"].transient >= by_type["p2p"].transient).all()
    assert "all_gather" not in {s.cp_comm_type for s in kept} and "p2p" in {s.cp_comm_type for s in kept}
    assert [p.strategy for p in kept_prices] == kept
    # Twins that cost the same keep the first.
    twin = dataclasses.replace(space[0], cp_comm_type="all_gather" if space[0].cp_comm_type != "all_gather" else "p2p")
    same, _ = _without_dominated_exchanges([space[0], twin], [priced[0], dataclasses.replace(priced[0], strategy=twin)])
    assert same == [space[0]]
