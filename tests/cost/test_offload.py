"""Offload and ZeRO++ hierarchical partitioning: the terms against hand-computed values, the search's
choice, the emitted spellings (checked by DeepSpeed's and Megatron-core's own config classes) and the
plan's round trip. The offloaded DeepSpeed runs train in tests/runtime/test_deepspeed.py."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import warnings
from pathlib import Path

import pytest

from dsauto.api import find_plans, make_problem
from dsauto.cost.collectives import Group
from dsauto.cost.layer import CostModel
from dsauto.cost.offload import host_bytes, offloaded_step_seconds, param_fetch_seconds
from dsauto.cost.step import predict_step
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import Passes, data_parallel_cost
from dsauto.describe import describe_plan
from dsauto.emit.ds_config import ds_config, validate_ds_config
from dsauto.emit.megatron import megatron_args
from dsauto.engines.deepspeed import config_contradictions
from dsauto.errors import DsautoError, DsautoWarning
from dsauto.parallel import ParallelDims
from dsauto.plan import Offload, Plan
from dsauto.plan_io import read_plan, write_plan_yaml
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints, allowed, layer_options, strategies
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.loaders import load_cluster, load_hardware, load_model
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import TrainSpec

MIXTRAL = Path(__file__).parents[1] / "spec" / "configs" / "mixtral-8x7b.json"
KEEP = LayerOption(checkpoint=False, shard_params=False, split=1)
SHARD = LayerOption(checkpoint=False, shard_params=True, split=1)


def test_offloaded_step_by_hand():
    # a100 preset, 8 GPUs a node: PCIe Gen4 31.5 GB/s x 0.8 = 25.2 GB/s per GPU; host DRAM 409.6 GB/s / 8.
    cluster = load_cluster("a100-80gb", nodes=1, gpus_per_node=8)
    down = 1e9 * 4 / 25.2e9 + 1e-5  # fp32 gradients of 1e9 parameters
    up = 1e9 * 2 / 25.2e9 + 1e-5  # bf16 parameters back
    update = 1e9 * 30 / 51.2e9  # 30 bytes of Adam traffic per parameter over the GPU's share of DRAM
    assert offloaded_step_seconds(1e9, 2, "deepspeed", cluster) == pytest.approx(down + update + up)  # 0.824 s
    assert offloaded_step_seconds(1e9, 2, "megatron", cluster) == pytest.approx(max(down, update, up))  # overlapped
    # a measured CPU optimizer replaces the bandwidth bound
    assert offloaded_step_seconds(1e9, 2, "deepspeed", cluster, 2e-9) == pytest.approx(down + 2.0 + up)
    # host memory: 12 B of optimizer state + 4 B fp32 gradient + 2 B bf16 copy; offload_param adds 2 B a parameter
    assert host_bytes(1e9, 0, 2, "optimizer") == 18e9
    assert host_bytes(1e9, 5e8, 2, "optimizer+params") == 19e9
    assert host_bytes(1e9, 5e8, 2, "none") == 0
    assert param_fetch_seconds(1e9, 2, cluster) == pytest.approx(2e9 / 25.2e9 + 1e-5)


def _block_cost(strategy: Strategy, cluster: ClusterSpec, option: LayerOption):
    model = load_model("llama2-7b")
    train = TrainSpec(global_batch=64, seq_len=2048, dtype="bf16")
    cost = CostModel(cluster, train, strategy, model.hidden_size)
    block = next(g for g in layer_groups(model, 2048, 2, strategy.tp) if g.kind == "transformer")
    return cost, block, cost.layer(block, option)


@pytest.mark.parametrize("engine,zero", [("deepspeed", 2), ("megatron", 1)])
def test_offload_moves_the_optimizer_state_and_prices_the_host(engine, zero):
    cluster = load_cluster("a100-80gb", nodes=1, gpus_per_node=8)
    plain = Strategy(ParallelDims(dp=8), zero_stage=zero, micro_batch=1, grad_accum=8, sequence_parallel=False,
                     engine=engine)
    _, block, before = _block_cost(plain, cluster, KEEP)
    cost, _, after = _block_cost(dataclasses.replace(plain, offload="optimizer"), cluster, KEEP)
    assert before.optimizer_bytes > 0 and after.optimizer_bytes == 0  # fp32 master and moments leave the device
    assert (after.params_bytes, after.grads_bytes) == (before.params_bytes, before.grads_bytes)
    owned = block.params / 8  # this rank's optimizer partition
    assert after.offloaded_bytes == pytest.approx(owned * 18)
    assert after.optimizer_seconds == pytest.approx(offloaded_step_seconds(owned, 2, engine, cluster))
    assert after.optimizer_seconds > 10 * before.optimizer_seconds  # the host is far slower than HBM


def test_offload_param_moves_the_sharded_partition_and_fetches_it_per_use():
    cluster = load_cluster("a100-80gb", nodes=1, gpus_per_node=8)
    zero3 = Strategy(ParallelDims(dp=8), zero_stage=3, micro_batch=1, grad_accum=8, sequence_parallel=False)
    _, block, before = _block_cost(dataclasses.replace(zero3, offload="optimizer"), cluster, SHARD)
    _, _, after = _block_cost(dataclasses.replace(zero3, offload="optimizer+params"), cluster, SHARD)
    partition = block.params / 8
    assert before.params_bytes - after.params_bytes == pytest.approx(partition * 2)
    fetch = param_fetch_seconds(partition, 2, cluster)
    assert after.forward_seconds - before.forward_seconds == pytest.approx(fetch)
    assert after.backward_seconds - before.backward_seconds == pytest.approx(fetch)
    assert after.offloaded_bytes - before.offloaded_bytes == pytest.approx(partition * 2)
    # ZeRO-3's gradient partitions live on the optimizer's device, the host (stage3.py,
    # grad_partitions_flat_buffer), where ZeRO-2's stay on the device (the test above)
    _, _, on_device = _block_cost(zero3, cluster, SHARD)
    assert on_device.grads_bytes > 0 and before.grads_bytes == after.grads_bytes == 0
    # a resident layer keeps its parameters on the device
    _, _, resident = _block_cost(dataclasses.replace(zero3, offload="optimizer+params"), cluster, KEEP)
    assert resident.params_bytes > after.params_bytes


def test_hpz_secondary_partition_and_intra_node_backward_gather():
    cluster = load_cluster("a100-80gb", nodes=2, gpus_per_node=8)
    zero3 = Strategy(ParallelDims(dp=16), zero_stage=3, micro_batch=1, grad_accum=4, sequence_parallel=False)
    _, block, plain = _block_cost(zero3, cluster, SHARD)
    cost, _, hpz = _block_cost(dataclasses.replace(zero3, hpz=8), cluster, SHARD)
    # ZeRO++ Sec. 3.2: each rank also holds 1/hpz of the layer's bf16 parameters
    assert hpz.params_bytes - plain.params_bytes == pytest.approx(block.params * 2 / 8)
    assert hpz.backward_seconds < plain.backward_seconds and hpz.forward_seconds == plain.forward_seconds
    # By hand, with no compute to hide behind: forward gathers over the 16 dp ranks at 1 GB/s, backward
    # over the 8 hpz ranks at 10 GB/s, and the gradients are reduce-scattered over all 16.
    ctx = dataclasses.replace(cost.context, dp_group=Group(16, 1e9, 0.0), hpz_group=Group(8, 1e10, 0.0))
    volume = block.params * 2
    got = data_parallel_cost(block, SHARD, ctx, Passes(0.0, 0.0), hooks_measured=False)
    assert got.forward_seconds == pytest.approx(15 / 16 * volume / 1e9)
    assert got.backward_seconds == pytest.approx(7 / 8 * volume / 1e10 + 15 / 16 * volume / 1e9)


def test_search_offloads_only_what_fits_only_so():
    # llama2-7b (6.7e9 parameters) on one A100-80GB (77 GiB budget): its model state alone is 16 B a
    # parameter under DeepSpeed (2 param + 2 grad + 12 Adam) and 18 B under Megatron (fp32 gradients),
    # over 100 GB; with the optimizer on the host, 4 B (DeepSpeed ZeRO-2) or 6 B (Megatron) = 27-40 GB.
    n = load_model("llama2-7b").num_parameters()
    budget = load_cluster("a100-80gb", nodes=1, gpus_per_node=1).memory_budget_bytes
    assert 16 * n > budget > 6 * n + 20 * 2**30
    kw = dict(nodes=1, gpus_per_node=1, global_batch=8, seq_len=2048)
    plan = find_plans(make_problem("llama2-7b", "a100-80gb", **kw))[0]
    assert plan.offload == "optimizer" and plan.zero_stage >= 1 and plan.dp == 1
    assert plan.prediction.optimizer_seconds > 0.1  # the host link and the CPU's update are priced
    assert plan.prediction.offloaded_bytes == pytest.approx(18 * n, rel=0.01)
    with pytest.raises(DsautoError, match="does not fit"):
        find_plans(make_problem("llama2-7b", "a100-80gb", offload="none", **kw))
    # The host must hold it: 113 GiB of offloaded state does not fit a node with 64 GiB.
    small_host = dataclasses.replace(load_hardware("a100-80gb"), host_memory_bytes=64 * 2**30)
    with pytest.raises(DsautoError, match="does not fit"):
        find_plans(make_problem("llama2-7b", ClusterSpec(small_host, nodes=1, gpus_per_node=1), **kw))
    # Where the plain plans fit, nothing is offloaded: the same model on a node of eight.
    assert find_plans(make_problem("llama2-7b", "a100-80gb", nodes=1, gpus_per_node=8, global_batch=64,
                                   seq_len=2048))[0].offload == "none"


def test_pins_reach_the_plan():
    plan = find_plans(make_problem("gpt-tiny", "a100-80gb", gpus_per_node=2, offload="optimizer",
                                   engine="deepspeed"))[0]
    assert plan.offload == "optimizer" and plan.zero_stage >= 1
    plan = find_plans(make_problem("gpt-tiny", "cpu", nodes=2, hpz=2))[0]
    assert plan.hpz == 2 and plan.zero_stage == 3 and plan.engine == "deepspeed"
    with pytest.raises(DsautoError, match="--offload optimizer\\+params cannot run: parameter offload"):
        find_plans(make_problem("gpt-tiny", "a100-80gb", offload="optimizer+params", engine="megatron"))
    # Pinned on one GPU: ZeRO-Offload's single-GPU setting, ZeRO-2, where a step is one micro-batch;
    # accumulating micro-batches, ZeRO-1, which keeps their sum on the device
    plan = find_plans(make_problem("llama2-7b", "a100-80gb", nodes=1, gpus_per_node=1, global_batch=8, seq_len=2048,
                                   offload="optimizer", engine="deepspeed", micro_batch=8))[0]
    assert (plan.offload, plan.zero_stage, plan.dp, plan.grad_accum) == ("optimizer", 2, 1, 1)
    plan = find_plans(make_problem("llama2-7b", "a100-80gb", nodes=1, gpus_per_node=1, global_batch=8, seq_len=2048,
                                   offload="optimizer", engine="deepspeed", micro_batch=1))[0]
    assert (plan.offload, plan.zero_stage, plan.dp, plan.grad_accum) == ("optimizer", 1, 1, 8)
    # On CPU ranks the device memory is the host's: nothing to gain, and said so.
    with pytest.raises(DsautoError, match="--offload optimizer cannot run: on CPU ranks the device memory is the host"):
        find_plans(make_problem("gpt-tiny", "cpu", offload="optimizer"))


def test_pins_that_move_nothing_are_named():
    """A ZeRO-3 plan that keeps every layer resident gathers no partition: a pinned parameter offload
    and hpZ then do nothing, which a warning says with the pins that give the same plan; where
    layers are sharded (a 20 GiB limit), neither is named."""
    shape = dict(model="llama2-7b", hardware="a100-80gb", gpus_per_node=8, zero_stage=3, engine="deepspeed")
    with pytest.warns(DsautoWarning, match=r"--offload optimizer\+params offloads no parameter and --hpz 2 partitions "
                                           r"no gather: .* --offload optimizer and no --hpz give the same plan"):
        plan = find_plans(make_problem(**shape, offload="optimizer+params", hpz=2))[0]
    assert not any(run.shard_params for run in plan.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DsautoWarning)
        plan = find_plans(make_problem(**shape, offload="optimizer+params", memory_limit="20GiB"))[0]
    assert any(run.shard_params for run in plan.layers)


def _plan(engine: str, zero: int, offload: Offload, hpz: int = 1, nodes: int = 1) -> Plan:
    planner = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=nodes, gpus_per_node=2),
                      TrainSpec(global_batch=8, seq_len=64, dtype="fp32"))
    dp = 2 * nodes
    strategy = Strategy(ParallelDims(dp=dp), zero_stage=zero, micro_batch=1, grad_accum=8 // dp,
                        sequence_parallel=False, engine=engine, offload=offload, hpz=hpz)  # type: ignore[arg-type]
    option = SHARD if zero == 3 else KEEP
    return planner.build_plan(strategy, [4], [option] * 6)


def test_deepspeed_parses_the_emitted_offload_and_hpz():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero2 = _plan("deepspeed", 2, "optimizer")
    config = ds_config(zero2)
    validate_ds_config(config, zero2.dp)
    parsed = DeepSpeedZeroConfig(**config["zero_optimization"])
    assert parsed.offload_optimizer.device == "cpu" and parsed.offload_param is None
    assert config["optimizer"]["params"]["torch_adam"] is False  # DeepSpeedCPUAdam, as priced

    zero3 = _plan("deepspeed", 3, "optimizer+params", hpz=2, nodes=2)
    config = ds_config(zero3)
    validate_ds_config(config, zero3.dp)
    parsed = DeepSpeedZeroConfig(**config["zero_optimization"])
    assert parsed.offload_param.device == "cpu" and parsed.offload_optimizer.device == "cpu"
    assert parsed.zero_hpz_partition_size == 2
    assert "offload_optimizer" not in ds_config(_plan("deepspeed", 2, "none"))["zero_optimization"]


def test_a_config_edited_away_from_its_plans_offload_is_refused():
    plan = _plan("deepspeed", 3, "optimizer+params", hpz=2, nodes=2)
    config = ds_config(plan)
    assert config_contradictions(config, plan) == []
    edited = copy.deepcopy(config)
    del edited["zero_optimization"]["offload_param"]
    edited["zero_optimization"]["zero_hpz_partition_size"] = 1
    assert config_contradictions(edited, plan) == [
        "zero_optimization.offload_param is off but the plan's offload is 'optimizer+params'",
        "zero_optimization.zero_hpz_partition_size is 1 but the plan's hpz is 2"]
    plain = _plan("deepspeed", 2, "none")
    config = ds_config(plain)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert config_contradictions(config, plain) == [
        "zero_optimization.offload_optimizer is on but the plan's offload is 'none'"]


def test_megatron_spells_the_optimizer_offload():
    from dsauto.runtime.megatron import optimizer_config

    plan = _plan("megatron", 1, "optimizer")
    args = megatron_args(plan)
    for flag in ("--use-distributed-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction 1.0",
                 "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"):
        assert flag in args
    if importlib.util.find_spec("transformer_engine") is None:  # as on the CPU test machines
        with pytest.raises(DsautoError, match="needs Transformer Engine"):
            optimizer_config(plan)
    else:  # megatron-core's OptimizerConfig accepts the combination
        config = optimizer_config(plan)
        assert config.optimizer_cpu_offload and config.optimizer_offload_fraction == 1.0
    assert "--optimizer-cpu-offload" not in megatron_args(_plan("megatron", 1, "none"))


def test_plan_round_trip_and_description(tmp_path):
    plan = _plan("deepspeed", 3, "optimizer+params", hpz=2, nodes=2)
    assert read_plan(write_plan_yaml(plan, tmp_path / "plan.yaml")) == plan
    text = describe_plan(plan)
    assert "offload optimizer+params" in text and "hpZ" in text
    with pytest.raises(ValueError, match="offload 'optimizer' needs ZeRO stage 1"):
        dataclasses.replace(_plan("deepspeed", 2, "optimizer"), zero_stage=0)
    with pytest.raises(ValueError, match="hpz 2 needs ZeRO stage 3"):
        dataclasses.replace(_plan("deepspeed", 2, "none", nodes=2), hpz=2)


def test_hpz_search_against_brute_force_and_its_bound():
    """ZeRO-3 over 2 nodes of 2 CPU ranks, hpz 1 or 2: whenever some plan of the space fits a budget,
    the search finds one no slower than the fastest beyond the DP's memory rounding, and the lower
    bound ordering the strategies never exceeds the plan solving them (branch and bound stays exact)."""
    model = ModelSpec(name="narrow", architecture="decoder", num_layers=2, hidden_size=64, num_attention_heads=2,
                      ffn_hidden_size=256, vocab_size=2048, max_position_embeddings=64, dropout=False)
    train = TrainSpec(global_batch=8, seq_len=64, dtype="fp32")
    pins = Constraints(engine="deepspeed", zero_stage=3, offload="none", micro_batch=1)
    full = load_cluster("cpu", nodes=2, gpus_per_node=2)
    space = strategies(model, full, train, pins)
    assert sorted(s.hpz for s in space) == [1, 2]
    priced = []
    for strategy in space:
        options = layer_options(strategy)
        ends = [o for o in options if allowed("head", o, pins)]
        blocks = [o for o in options if allowed("transformer", o, pins)]
        for e, h in itertools.product([o for o in options if allowed("embedding", o, pins)], ends):
            for pair in itertools.combinations_with_replacement(blocks, 2):
                got = predict_step(model, full, train, strategy, (2,), (e, *pair, h)).prediction
                priced.append((got.step_seconds, got.peak_memory_bytes))
    peaks = sorted({peak for _, peak in priced})
    # Budgets just below the smallest peak and 0.2% above peaks across the range (clear of the DP's
    # memory rounding, which is a 4096th of the range of a stage's choices).
    budgets = [int(peaks[0] * 0.99)] + [int(peaks[int(q * (len(peaks) - 1))] * 1.002) for q in (0, 0.1, 0.3, 0.6, 1)]
    for budget in budgets:
        fitting = [step for step, peak in priced if peak <= budget]
        planner = Planner(model, load_cluster("cpu", nodes=2, gpus_per_node=2, memory_limit=f"{budget}B"), train, pins)
        if not fitting:
            with pytest.raises(DsautoError):
                planner.search()
            continue
        plan = planner.search()[0]
        assert plan.prediction.peak_memory_bytes <= budget
        assert plan.prediction.step_seconds <= min(fitting) * 1.05
    planner = Planner(model, full, train, pins)
    for strategy in space:
        bound = planner._price(strategy)
        solved = planner._solve(bound)
        plan = planner.build_plan(solved.strategy, solved.stage_layers, solved.options)
        assert bound.lower_bound(model.num_layers) <= plan.prediction.step_seconds * (1 + 1e-12)


def test_megatron_offloads_beside_fp8_weight_gathers_only_under_delayed_scaling():
    """Megatron-LM's validate_args: with --fp8-param-gather the optimizer's CPU offload needs
    --fp8-recipe delayed. Pinned, tensorwise is refused in one sentence; unpinned, the search never
    reaches for the offload there (Mixtral on 8 H100s fits only offloaded), and delayed runs it."""
    shape = dict(model=str(MIXTRAL), hardware="h100-80gb", global_batch=64, seq_len=4096, engine="megatron",
                 fp8=True, fp8_param_gather=True, micro_batch=1)
    with pytest.raises(DsautoError, match=r"--offload optimizer cannot run: Megatron-LM offloads the optimizer beside "
                                          r"--fp8-param-gather only under --fp8-recipe delayed, not tensorwise\."):
        find_plans(make_problem(**shape, fp8_recipe="tensorwise", offload="optimizer"))
    with pytest.raises(DsautoError, match="does not fit"):
        find_plans(make_problem(**shape, fp8_recipe="tensorwise"))
    assert find_plans(make_problem(**shape, fp8_recipe="delayed"))[0].offload == "optimizer"


def test_zero2_accumulating_offloaded_gradients_pays_the_host_link_every_micro_batch():
    """DeepSpeed's ZeRO-2 with offload_optimizer carries the sum of a step's gradients through host
    memory: each micro-batch copies its partition down, and from the second on the sum so far up
    first; ZeRO-1 copies once a step. On one H100 (no data parallelism) with 8 micro-batches the
    search then keeps ZeRO-1, and a pinned ZeRO-2 is priced 15 partition copies slower."""
    from dsauto.cost.offload import host_link

    common = dict(global_batch=8, seq_len=4096, engine="deepspeed", offload="optimizer", micro_batch=1)
    [searched] = find_plans(make_problem("llama3-8b", "h100-80gb", gpus_per_node=1, **common))
    assert searched.zero_stage == 1
    [zero2] = find_plans(make_problem("llama3-8b", "h100-80gb", gpus_per_node=1, zero_stage=2, **common))
    link, latency = host_link(load_cluster("h100-80gb", nodes=1, gpus_per_node=1))
    params = sum(g.count * g.params for g in layer_groups(searched.model, 4096, 2, 1))
    copies = 8 + 7  # down every micro-batch, up from the second on
    extra = zero2.prediction.step_seconds - searched.prediction.step_seconds
    assert extra == pytest.approx(copies * params * 2 / link, rel=0.02)
