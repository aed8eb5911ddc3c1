"""The step's breakdown by term on plans priced from a profile: the tensor-parallel collectives of
every pass (a recomputed forward's included) and the pipeline's transfers, priced from the
profile's fitted gloo collectives."""

from __future__ import annotations

import pytest

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.profile.collectives import CollectiveFit
from dsauto.profile.layers import LayerMeasurement
from dsauto.profile.store import Profile
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.model import layer_groups
from dsauto.spec.training import TrainSpec

SEQ = 256
ALL_REDUCE = CollectiveFit(op="all_reduce", group_size=2, scope="intra_node", latency_seconds=2e-4,
                           bandwidth_gbps=1.5, samples=((65536, 3e-4),))
SEND_RECV = CollectiveFit(op="send_recv", group_size=2, scope="intra_node", latency_seconds=1e-4,
                          bandwidth_gbps=2.0, samples=((65536, 1.3e-4),))


def profile() -> Profile:
    """gpt-tiny measured at TP shards 1 and 2 (a recomputed layer's backward 1.5 times longer),
    with fitted gloo all-reduce and send/recv of two ranks."""
    model = load_model("gpt-tiny")
    layers = tuple(LayerMeasurement(group=group, tp=tp, micro_batch=2, checkpoint=ckpt,
                                    forward_seconds=0.01 / tp, backward_seconds=0.02 / tp * (1.5 if ckpt else 1),
                                    activation_bytes=100_000, peak_bytes=200_000, params_bytes=4096)
                   for tp in (1, 2) for group in ("embedding", model.architecture, "head")
                   for ckpt in ((False, True) if group == model.architecture else (False,)))
    return Profile(model=model, device="cpu", dtype="fp32", seq_len=SEQ, threads=1, versions={"torch": "2.0"},
                   layers=layers, optimizer_seconds_per_param=2e-9, collectives=(ALL_REDUCE, SEND_RECV),
                   world_size=2)


def predict(tp: int, pp: int, checkpoint: bool):
    model = load_model("gpt-tiny")
    planner = Planner(model, load_cluster("cpu", nodes=1, gpus_per_node=2), TrainSpec(8, SEQ, "fp32"),
                      Constraints(engine="megatron"), profile=profile())
    strategy = Strategy(dims=ParallelDims(tp=tp, pp=pp), zero_stage=0, micro_batch=2, grad_accum=4,
                        sequence_parallel=False, engine="megatron")
    options = [LayerOption(checkpoint=checkpoint and 1 <= j <= model.num_layers, shard_params=False, split=1)
               for j in range(model.num_layers + 2)]
    return planner.build_plan(strategy, [model.num_layers // pp] * pp, options).prediction


def all_reduces_seconds(group) -> float:
    """A pass of ``group``'s layers: each of its collectives one measured all-reduce of its share."""
    calls = group.tp_collectives
    return group.count * calls * ALL_REDUCE.predict_seconds(group.tp_comm_bytes_per_token * 2 * SEQ / calls)


def test_tensor_parallel_collectives_come_from_the_measured_all_reduce_and_recompute_adds_a_pass():
    groups = layer_groups(load_model("gpt-tiny"), SEQ, 4, 2)
    # Megatron-core's calls: two per transformer layer and pass, the embedding's and the output
    # layer's, and the vocabulary-parallel loss's three of one fp32 value per token in forward
    assert [g.tp_collectives for g in groups] == [1, 2, 1] and groups[-1].tp_loss_collectives == 3
    per_pass = sum(all_reduces_seconds(g) for g in groups)
    loss = 3 * ALL_REDUCE.predict_seconds(4 * 2 * SEQ)
    plain, recomputed = predict(2, 1, False), predict(2, 1, True)
    assert plain.basis == "measured" and plain.p2p_seconds == 0.0
    # forward and backward of 4 micro-batches, and the recomputed forward of the 4 blocks again
    assert plain.tp_comm_seconds == pytest.approx(4 * (2 * per_pass + loss))
    blocks = sum(all_reduces_seconds(g) for g in groups if g.kind == "transformer")
    assert recomputed.tp_comm_seconds == pytest.approx(plain.tp_comm_seconds + 4 * blocks)
    # the step grows by the recomputation the profile measured plus the recomputed collectives
    measured_recompute = 4 * 4 * 0.02 / 2 * 0.5
    assert recomputed.step_seconds - plain.step_seconds == pytest.approx(measured_recompute + 4 * blocks)


def test_pipeline_transfers_come_from_the_measured_send_recv():
    plan = predict(1, 2, False)
    boundary = 2 * SEQ * load_model("gpt-tiny").hidden_size * 4  # a micro-batch's fp32 activations
    # each of 4 micro-batches crosses the stage boundary once forward and once backward per stage
    assert plan.p2p_seconds == pytest.approx(4 * 2 * SEND_RECV.predict_seconds(boundary))
    assert plan.tp_comm_seconds == 0.0 and plan.bubble_seconds > 0
    assert plan.compute_seconds + plan.bubble_seconds + plan.exposed_comm_seconds + plan.optimizer_seconds == \
        pytest.approx(plan.step_seconds)
