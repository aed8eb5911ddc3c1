"""The planner: engine rules, the memory budget, determinism, and optimality against alternatives."""

import dataclasses
import itertools
import re

import pytest

from dsauto.cost.step import predict_step
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.errors import DsautoError
from dsauto.parallel import ParallelDims
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints, allowed, layer_options, strategies
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.loaders import load_hardware, load_model
from dsauto.spec.training import TrainSpec


def setup(model="llama2-7b", hardware="a100-80gb", nodes=2, per_node=8, batch=64, seq=4096,
          memory_limit=0):
    return (load_model(model),
            ClusterSpec(load_hardware(hardware), nodes=nodes, gpus_per_node=per_node,
                        memory_limit_bytes=memory_limit),
            TrainSpec(global_batch=batch, seq_len=seq))


def test_plans_obey_engine_rules_and_fit():
    model, cluster, train = setup()
    plans = Planner(model, cluster, train).search(top_k=8)
    assert len(plans) == 8
    times = [p.prediction.step_seconds for p in plans]
    assert times == sorted(times)
    for plan in plans:
        assert plan.micro_batch * plan.grad_accum * plan.dp == train.global_batch
        assert plan.dp * plan.tp * plan.pp == cluster.world_size
        assert model.num_attention_heads % plan.tp == 0 and model.kv_heads % plan.tp == 0
        assert plan.padded_vocab_size % plan.tp == 0
        assert plan.pp == 1 or plan.zero_stage <= 1  # DeepSpeed's pipeline engine
        assert plan.prediction.peak_memory_bytes <= cluster.memory_budget_bytes
        assert all(st.peak_bytes <= cluster.memory_budget_bytes for st in plan.stages)


def test_search_is_deterministic():
    model, cluster, train = setup()
    first = Planner(model, cluster, train).search(top_k=3)
    second = Planner(model, cluster, train).search(top_k=3)
    assert first == second


def test_pins_are_respected():
    model, cluster, train = setup()
    plan = Planner(model, cluster, train, Constraints(tp=2, pp=2, zero_stage=1)).search()[0]
    assert (plan.tp, plan.pp, plan.zero_stage) == (2, 2, 1)
    plan = Planner(model, cluster, train, Constraints(micro_batch=1, checkpoint=True)).search()[0]
    assert plan.micro_batch == 1
    assert len(plan.checkpointed_layers()) == model.num_layers


def test_a_tighter_budget_trades_time_for_memory():
    model, _, train = setup()
    roomy = Planner(model, *setup(memory_limit=70 * 2**30)[1:]).search()[0]
    tight = Planner(model, *setup(memory_limit=12 * 2**30)[1:]).search()[0]
    assert tight.prediction.peak_memory_bytes <= 12 * 2**30
    assert tight.prediction.step_seconds >= roomy.prediction.step_seconds


def test_impossible_budget_names_the_smallest_need():
    model, cluster, train = setup(model="llama2-70b", nodes=1, per_node=2, batch=8,
                                  memory_limit=4 * 2**30)
    with pytest.raises(DsautoError, match=r"does not fit .* needs at least [0-9.]+ GiB per device") as caught:
        Planner(model, cluster, train, Constraints(offload="none")).search()
    assert "--memory-limit" not in str(caught.value)  # more than the device holds: no limit would fit it
    # its offloaded strategies' bound is quoted too: with parameters and optimizer on the host a higher
    # limit could hold it
    with pytest.raises(DsautoError, match=r"needs at least ([0-9.]+) GiB per device;") as caught:
        Planner(model, cluster, train).search()
    assert 4 < float(caught.value.args[0].split("needs at least ")[1].split(" GiB")[0]) < 80
    assert "raise --memory-limit" in str(caught.value)
    # With its optimizer and parameters offloaded llama2-7b fits 3 GiB a device (a recomputed layer's
    # activations as Hugging Face's Llama keeps them), so at 2 GiB no bound above the limit is quoted
    # (the offloaded strategies' bounds count too)
    model, cluster, train = setup(model="llama2-7b", nodes=1, per_node=8, batch=8, memory_limit=2 * 2**30)
    with pytest.raises(DsautoError, match=r"does not fit .*: no plan priced stays within it") as caught:
        Planner(model, cluster, train).search()
    assert "raise --memory-limit" in str(caught.value)  # 2 GiB set, the device holds more
    Planner(model, dataclasses.replace(cluster, memory_limit_bytes=6 * 2**29), train).search()


def test_an_impossible_budget_says_whether_the_state_or_the_activations_overflow():
    """The no-fit sentence bounds the model state apart: llama3-70b on 8 A100s at tp 2 without
    more sharding holds about 296 GiB of state a device, over the 77 GiB budget alone; on 16 A100s
    at tp 8, pp 2 with micro-batches of 8 x 8192 tokens and no checkpointing the state (about
    74 GiB) fits and the activations are what overflows. The state bound is never above the state
    of a plan the same strategy's search finds under a roomy limit."""
    from dsauto.api import make_plan, make_problem

    with pytest.raises(DsautoError, match=r"needs at least ([0-9.]+) GiB per device, its model state alone at "
                                          r"least ([0-9.]+) GiB;") as caught:
        make_plan("llama3-70b", "a100-80gb", nodes=1, tp=2, pp=1, zero_stage=1, engine="megatron")
    least, state = map(float, re.search(r"at least ([0-9.]+) GiB per device, its model state alone at least "
                                        r"([0-9.]+) GiB", str(caught.value)).groups())
    assert 77 < state <= least
    pins = dict(tp=8, pp=2, micro_batch=8, checkpoint=False, engine="megatron", seq_len=8192, global_batch=16)
    with pytest.raises(DsautoError, match=r"of which its model state at least ([0-9.]+) GiB, the rest activations "
                                          r"and buffers;") as caught:
        make_plan("llama3-70b", "a100-80gb", nodes=2, **pins)
    state = float(re.search(r"model state at least ([0-9.]+) GiB", str(caught.value)).group(1)) * 2**30
    a100 = load_hardware("a100-80gb")
    roomy = dataclasses.replace(a100, device=dataclasses.replace(a100.device, memory_bytes=2**42))
    problem = make_problem("llama3-70b", roomy, nodes=2, **pins)
    plan = Planner(problem.model, problem.cluster, problem.train, problem.pins).search()[0]
    held = max(st.params_bytes + st.grads_bytes + st.optimizer_bytes for st in plan.stages)
    assert state <= held * (1 + 1e-3) < plan.prediction.peak_memory_bytes


def test_a_pin_that_holds_the_searchs_own_choice_is_not_offered_to_unpin():
    """Sequence parallelism pinned on (a launch that sets --sequence-parallel) is what the search does
    anyway, and --no-sequence-parallel, the option that pins it, would turn it off: the no-fit
    sentence does not offer it; pinned off, it does."""
    model, cluster, train = setup(model="llama2-70b", nodes=1, per_node=2, batch=8, memory_limit=4 * 2**30)
    for pinned, offered in ((True, False), (False, True)):
        with pytest.raises(DsautoError) as caught:
            Planner(model, cluster, train, Constraints(tp=2, sequence_parallel=pinned)).search()
        assert ("--no-sequence-parallel" in str(caught.value)) is offered, caught.value


def test_a_lower_bound_within_the_budget_is_not_quoted_as_what_a_plan_needs():
    """A two-layer model on two CPU ranks, its budget 95% of the smallest peak any plan of the space
    reaches (tests/search/test_memory_oracle.py enumerates them): the plans go over at moments the
    layers' bound leaves out, the bound stays within the budget, and the error quotes no figure."""
    from dsauto.spec.model import ModelSpec

    model = ModelSpec(name="wide-vocab", architecture="decoder", num_layers=2, hidden_size=128,
                      num_attention_heads=4, ffn_hidden_size=256, vocab_size=8192,
                      max_position_embeddings=64, dropout=False)
    budget = int(0.95 * 14_850_048)  # the smallest predicted peak of the space, 14.16 MiB
    cluster = ClusterSpec(load_hardware("cpu"), nodes=1, gpus_per_node=2, memory_limit_bytes=budget)
    planner = Planner(model, cluster, TrainSpec(global_batch=4, seq_len=64, dtype="fp32"))
    with pytest.raises(DsautoError) as caught:
        planner.search()
    message = str(caught.value)
    assert "no plan priced stays within it" in message and "needs at least" not in message


def test_a_pipeline_stage_bound_counts_its_own_gradients_not_the_models():
    """DeepSpeed's pipeline engine: the layers' bound leaves out each stage's gradients (its first
    micro-batch's loss comes before any exists), not the whole model's, and the end of backward
    holds them all: llama3-405b's ZeRO-0 pipeline over 32 A100s holds 18 bytes a parameter (16-bit
    weights and gradients, BF16_Optimizer's 16-bit accumulator and 12 bytes of fp32 state) over 32
    stages, 212.6 GiB, above ZeRO-3's bound over 32 ranks, which the refusal quotes (16 bytes a
    parameter, 189 GiB, and its gathered layers); and every pipeline strategy's bound on any
    layout is positive and below the peak of the plan its search finds."""
    from dsauto.api import make_plan, make_problem

    with pytest.raises(DsautoError, match=r"the smallest plan needs at least 207\.[0-9] GiB per device, its model "
                                          r"state alone at least 189\.0 GiB") as caught:
        make_plan("llama3-405b", "a100-80gb", nodes=4, engine="deepspeed", offload="none", memory_limit="80GiB")
    assert "--memory-limit" not in str(caught.value)  # more than the device holds
    problem = make_problem("llama3-405b", "a100-80gb", nodes=4, engine="deepspeed", offload="none",
                           memory_limit="80GiB", pp=32, zero_stage=0)
    priced = Planner(problem.model, problem.cluster, problem.train, problem.pins)._price(
        next(iter(strategies(problem.model, problem.cluster, problem.train, problem.pins))))
    assert priced.least_memory(problem.model.num_layers) / 2**30 == pytest.approx(
        problem.model.num_parameters() * 18 / 32 / 2**30, rel=0.01)
    problem = make_problem("llama2-13b", "a100-80gb", nodes=1, engine="deepspeed", global_batch=64, seq_len=4096)
    planner = Planner(problem.model, problem.cluster, problem.train, problem.pins)
    checked = 0
    for strategy in strategies(problem.model, problem.cluster, problem.train, problem.pins):
        if strategy.pp == 1 or strategy.offload != "none":
            continue
        priced = planner._price(strategy)
        solved = planner._solve(priced)
        if solved is None:
            continue
        peak = planner.build_plan(solved.strategy, solved.stage_layers, solved.options).prediction.peak_memory_bytes
        least = priced.least_memory(problem.model.num_layers)  # any layout's
        assert 0 < least <= peak, (strategy, least, peak)
        checked += 1
    assert checked >= 4


def test_no_strategy_explains_the_rule():
    model, cluster, train = setup(batch=7)  # 16 devices: no data-parallel degree divides 7 except 1
    with pytest.raises(DsautoError, match="ZeRO stage 3 cannot run with pipeline"):
        Planner(model, cluster, train, Constraints(zero_stage=3, pp=2)).search()


def uniform_assignments(model, strategy, pins):
    """Every plan that gives all transformer layers one option, the embedding and head one each."""
    options = layer_options(strategy)
    for emb, block, head in itertools.product(options, repeat=3):
        if allowed("embedding", emb, pins) and allowed("decoder", block, pins) and allowed("head", head, pins):
            yield [emb] + [block] * model.num_layers + [head]


@pytest.mark.parametrize("zero, limit_gib", [(3, 40), (3, 20), (2, 30), (1, 60)])
def test_single_stage_plan_beats_every_uniform_plan_that_fits(zero, limit_gib):
    model, cluster, train = setup(nodes=1, batch=32, memory_limit=limit_gib * 2**30)
    pins = Constraints(tp=1, pp=1, zero_stage=zero, micro_batch=2)
    plan = Planner(model, cluster, train, pins).search()[0]
    strategy = Strategy(dims=ParallelDims(dp=8, tp=1, pp=1), zero_stage=zero, micro_batch=2, grad_accum=2,
                        sequence_parallel=False)
    best_uniform = min(
        (s.prediction.step_seconds for options in uniform_assignments(model, strategy, pins)
         for s in [predict_step(model, cluster, train, strategy, (model.num_layers,), options)]
         if s.prediction.peak_memory_bytes <= cluster.memory_budget_bytes),
        default=float("inf"))
    assert plan.prediction.step_seconds <= best_uniform * (1 + 1e-9)


def test_pipeline_layout_beats_every_first_last_layout_by_brute_force():
    model, cluster, train = setup(model="gpt2-xl", nodes=1, per_node=8, batch=32, seq=1024)
    pins = Constraints(tp=1, pp=4, zero_stage=0, micro_batch=1, checkpoint=False)
    planner = Planner(model, cluster, train, pins)
    plan = planner.search()[0]
    strategy = Strategy(dims=ParallelDims(dp=2, tp=1, pp=4), zero_stage=0, micro_batch=1, grad_accum=16,
                        sequence_parallel=False, engine="megatron")
    plain = LayerOption(checkpoint=False, shard_params=False, split=1)
    best = float("inf")
    L = model.num_layers
    for first in range(1, L):
        for mid in range(1, L):
            last = L - first - 2 * mid
            if last < 1:
                continue
            # Plain options everywhere, but let the head pick its split: the only per-layer choice.
            for split in (1, 2, 4, 8, 16):
                options = [plain] * (L + 1) + [dataclasses.replace(plain, split=split)]
                step = predict_step(model, cluster, train, strategy, (first, mid, mid, last), options)
                if step.prediction.peak_memory_bytes <= cluster.memory_budget_bytes:
                    best = min(best, step.prediction.step_seconds)
    assert plan.prediction.step_seconds <= best * (1 + 1e-9)
    assert sum(plan.stage_layers) == L and len(set(plan.stage_layers[1:-1])) == 1


def test_strategy_space_rules():
    model, cluster, train = setup(model="gpt2-xl")  # 25 heads: only TP 1 divides them
    space = strategies(model, cluster, train, Constraints())
    assert {s.tp for s in space} == {1}
    assert all(s.zero_stage <= 1 for s in space if s.pp > 1)
    assert all(s.micro_batch * s.grad_accum * s.dp == train.global_batch for s in space)


@pytest.mark.parametrize("pins", [Constraints(), Constraints(pp=2), Constraints(pp=4, zero_stage=1),
                                  Constraints(zero_stage=3, pp=1)])
def test_lower_bound_never_exceeds_the_plan_it_bounds(pins):
    # Branch and bound is only exact if every bound is below what solving the strategy predicts.
    model, cluster, train = setup(nodes=1, batch=32)
    planner = Planner(model, cluster, train, pins)
    checked = 0
    for strategy in strategies(model, cluster, train, pins):
        priced = planner._price(strategy)
        solved = planner._solve(priced)
        if solved is None:
            continue
        plan = planner.build_plan(solved.strategy, solved.stage_layers, solved.options)
        assert priced.lower_bound(model.num_layers) <= plan.prediction.step_seconds * (1 + 1e-12)
        checked += 1
    assert checked > 0


def test_branch_and_bound_finds_the_same_best_as_solving_everything():
    model, cluster, train = setup(model="gpt2-xl", nodes=1, batch=32, seq=1024, memory_limit=20 * 2**30)
    planner = Planner(model, cluster, train)
    best = min((planner.build_plan(s.strategy, s.stage_layers, s.options).prediction.step_seconds
                for s in (planner._solve(planner._price(st))
                          for st in strategies(model, cluster, train, Constraints())) if s),
               default=None)
    assert planner.search()[0].prediction.step_seconds == pytest.approx(best, rel=1e-12)


def test_plans_that_fit_the_devices_but_not_the_hosts_say_so():
    """Offloaded plans need the node's host memory; where none fits it, the error names host memory
    with its numbers, not the devices'."""
    hardware = dataclasses.replace(load_hardware("a100-80gb"), host_memory_bytes=256 * 2**30)
    cluster = ClusterSpec(hardware, nodes=4, gpus_per_node=8)
    train = TrainSpec(global_batch=512, seq_len=4096)
    with pytest.raises(DsautoError, match=r"does not fit on 32 x A100-SXM4-80GB: its plans that fit the devices "
                                          r"offload [0-9.]+ GiB a node, more than the 256.0 GiB of host memory"):
        Planner(load_model("llama2-70b"), cluster, train, Constraints(engine="deepspeed", offload="optimizer")).search()


def test_a_plan_that_does_not_fit_names_the_pins_to_undo():
    """The error offers to unpin only what was pinned, by its options; with nothing pinned it does not."""
    from dsauto.api import make_plan

    with pytest.raises(DsautoError) as caught:
        make_plan("llama2-70b", "h100-80gb", nodes=8, seq_len=4096, global_batch=64, tp=1, pp=1, checkpoint=False)
    assert str(caught.value).endswith("; add devices or unpin --tp, --pp, --checkpoint.")
    with pytest.raises(DsautoError) as caught:
        make_plan("gpt-tiny", "cpu", memory_limit="1MiB")
    assert str(caught.value).endswith("; add devices or raise --memory-limit.")
