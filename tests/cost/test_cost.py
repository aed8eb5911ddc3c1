"""The cost model against the published formulas it implements."""

import dataclasses

import pytest

from dsauto.cost.collectives import Group, dp_group, tp_group
from dsauto.cost.layer import CostModel
from dsauto.cost.step import predict_step
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.parallel import ParallelDims
from dsauto.plan import stage_bounds
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.loaders import load_hardware, load_model
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import TrainSpec

GPT = ModelSpec(name="gpt-test", architecture="decoder", num_layers=8, hidden_size=1024,
                num_attention_heads=16, ffn_hidden_size=4096, vocab_size=51200,
                max_position_embeddings=2048)
PLAIN = LayerOption(checkpoint=False, shard_params=False, split=1)


def cluster(nodes=1, per_node=8, hardware="a100-80gb"):
    return ClusterSpec(load_hardware(hardware), nodes=nodes, gpus_per_node=per_node)


def strategy(tp=1, pp=1, dp=8, zero=0, mb=1, accum=1, sp=False):
    return Strategy(dims=ParallelDims(dp=dp, tp=tp, pp=pp), zero_stage=zero, micro_batch=mb, grad_accum=accum,
                    sequence_parallel=sp)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_activation_bytes_match_korthikanti(tp, sp):
    # Korthikanti et al. 2022, Table 2: per layer s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes without
    # sequence parallelism, s*b*h*(34/t + 5*a*s/(h*t)) with it (16-bit, dropout, eager attention).
    s, b, h, a = 2048, 2, GPT.hidden_size, GPT.num_attention_heads
    train = TrainSpec(global_batch=16, seq_len=s, dtype="fp16", flash_attention=False)
    model = CostModel(cluster(), train, strategy(tp=tp, dp=8 // tp, mb=b, sp=sp), h)
    block = layer_groups(GPT, s, 2, tp)[1]
    got = model.layer(block, PLAIN).activation_bytes
    if sp and tp > 1:
        expected = s * b * h * (34 / tp + 5 * a * s / (h * tp))
    else:
        expected = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    # The only addition to the paper's count is the flash-style logsumexp (4 bytes x heads / t).
    assert got == pytest.approx(expected + s * b * 4 * a / tp, rel=1e-12)


def test_checkpointed_layer_keeps_only_its_input_and_recomputes():
    train = TrainSpec(global_batch=8, seq_len=1024, dtype="bf16")
    model = CostModel(cluster(), train, strategy(mb=2), GPT.hidden_size)
    block = layer_groups(GPT, 1024, 2, 1)[1]
    plain = model.layer(block, PLAIN)
    ckpt = model.layer(block, dataclasses.replace(PLAIN, checkpoint=True))
    assert ckpt.activation_bytes == 2 * 1024 * GPT.hidden_size * 2  # 2 sequences x s x h x 2 bytes
    assert ckpt.transient_bytes == pytest.approx(plain.activation_bytes)
    assert ckpt.backward_seconds == pytest.approx(plain.backward_seconds + plain.forward_seconds)


@pytest.mark.parametrize("zero, per_param", [(0, 16), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)])
def test_model_state_bytes_follow_zero(zero, per_param):
    # ZeRO (Rajbhandari et al. 2020), Fig. 1: 16 bytes per parameter without partitioning,
    # (4 + 12/Nd), (2 + 14/Nd) and 16/Nd with stages 1, 2 and 3 (mixed-precision Adam).
    train = TrainSpec(global_batch=8, seq_len=1024, dtype="bf16")
    model = CostModel(cluster(), train, strategy(zero=zero), GPT.hidden_size)
    block = layer_groups(GPT, 1024, 2, 1)[1]
    option = dataclasses.replace(PLAIN, shard_params=zero == 3)
    assert model.layer(block, option).static_bytes == pytest.approx(per_param * block.params)


def test_resident_params_under_zero3_keep_16_bit_copy_but_shard_the_rest():
    train = TrainSpec(global_batch=8, seq_len=1024, dtype="bf16")
    model = CostModel(cluster(), train, strategy(zero=3), GPT.hidden_size)
    block = layer_groups(GPT, 1024, 2, 1)[1]
    resident = model.layer(block, PLAIN)
    # The full 16-bit copy, plus DeepSpeed's own partition of it (2/8), plus the sharded rest.
    assert resident.static_bytes == pytest.approx((2 + 2 / 8 + 14 / 8) * block.params)
    assert resident.step_seconds > 0  # the updated copy is gathered once per step


def test_ring_collectives():
    g = Group(size=4, bandwidth_bytes_per_second=1e9, latency_seconds=1e-5)
    assert g.all_reduce(1e9) == pytest.approx(2 * 3 / 4 + 6e-5)
    assert g.all_gather(1e9) == pytest.approx(3 / 4 + 3e-5)
    assert g.reduce_scatter(1e9) == g.all_gather(1e9)
    assert Group(1, 1e9, 1e-5).all_reduce(1e9) == 0.0


def test_groups_inside_a_node_use_the_fast_link_and_span_nodes_hierarchically():
    c = cluster(nodes=4)
    hw = c.hardware
    intra = hw.intra_node.bandwidth_gbps * 1e9 * hw.intra_node.efficiency
    nic = hw.inter_node.bandwidth_gbps * 1e9 * hw.inter_node.efficiency
    assert tp_group(c, 8).bandwidth_bytes_per_second == intra
    assert dp_group(c, tp=1, dp=8).bandwidth_bytes_per_second == intra  # one node
    assert dp_group(c, tp=8, dp=4).bandwidth_bytes_per_second == pytest.approx(nic)  # 1 per node
    assert dp_group(c, tp=2, dp=16).bandwidth_bytes_per_second == pytest.approx(4 * nic)


def test_1f1b_step_of_equal_stages_is_m_plus_p_minus_1_stage_times():
    # Narayanan et al. 2021, Sec. 2.2: (m + p - 1) * (t_f + t_b) for balanced stages.
    model = dataclasses.replace(GPT, num_layers=8)
    train = TrainSpec(global_batch=16, seq_len=1024, dtype="bf16")
    c = cluster(per_node=4)
    s = strategy(pp=4, dp=1, mb=1, accum=16)
    step = predict_step(model, c, train, s, (2, 2, 2, 2), [PLAIN] * 10)
    middle = step.stages[1]
    t = middle.forward_seconds + middle.backward_seconds
    pred = step.prediction
    slowest = max(st.forward_seconds + st.backward_seconds for st in step.stages)
    assert pred.compute_seconds == pytest.approx(16 * slowest)
    assert pred.bubble_seconds == pytest.approx(
        sum(st.forward_seconds + st.backward_seconds for st in step.stages) - slowest)
    assert pred.bubble_seconds >= 3 * t * 0.99
    # Activations in flight: stage i holds min(p - i, m) micro-batches.
    assert [st.micro_batches_in_flight for st in step.stages] == [4, 3, 2, 1]


def test_stage_bounds_put_embedding_first_and_head_last():
    assert stage_bounds((3, 2, 3)) == [(0, 3), (4, 5), (6, 9)]
    assert stage_bounds((4,)) == [(0, 5)]


def test_flash_attention_removes_the_quadratic_activation_term():
    model = load_model("llama2-7b")
    eager = TrainSpec(global_batch=8, seq_len=4096, flash_attention=False)
    flash = TrainSpec(global_batch=8, seq_len=4096, flash_attention=True)
    block_eager = layer_groups(model, 4096, 2, 1)[1]
    a = CostModel(cluster(), eager, strategy(), model.hidden_size).layer(block_eager, PLAIN)
    b = CostModel(cluster(), flash, strategy(), model.hidden_size).layer(block_eager, PLAIN)
    assert a.activation_bytes - b.activation_bytes == pytest.approx(
        4096 * block_eager.attention_score_bytes_per_token)
    assert b.forward_seconds < a.forward_seconds


def test_splitting_the_head_divides_the_logits_peak():
    model = load_model("llama3-8b")
    train = TrainSpec(global_batch=8, seq_len=4096)
    cm = CostModel(cluster(), train, strategy(), model.hidden_size)
    head = layer_groups(model, 4096, 2, 1)[2]
    whole = cm.layer(head, PLAIN).transient_bytes
    quarter = cm.layer(head, dataclasses.replace(PLAIN, split=4)).transient_bytes
    assert quarter == pytest.approx(whole / 4)


# A 17M-parameter GPT on two CPU ranks in fp32, the shape the memory terms below were measured on
# (DeepSpeed 0.19.8, torch 2.13; see dsauto/cost/step.py).
WIDE = ModelSpec(name="wide", architecture="decoder", num_layers=4, hidden_size=512, num_attention_heads=8,
                 ffn_hidden_size=2048, vocab_size=8192, max_position_embeddings=128, dropout=False)
MiB = 2**20


def _wide_step(zero, mb, accum):
    from dsauto.spec.loaders import load_cluster

    cpu = load_cluster("cpu", nodes=1, gpus_per_node=2)
    options = [LayerOption(checkpoint=False, shard_params=zero == 3, split=1)] * (WIDE.num_layers + 2)
    return predict_step(WIDE, cpu, TrainSpec(2 * mb * accum, 128, "fp32"), strategy(dp=2, zero=zero, mb=mb, accum=accum),
                        [WIDE.num_layers], options)


def test_gradients_awaiting_zero_are_priced_by_stage():
    from dsauto.cost.step import gradient_transient_bytes

    largest, bucket, grads = 16 * MiB, 16 * MiB, 64 * MiB
    assert gradient_transient_bytes(strategy(dp=2, zero=0, accum=4), bucket, largest, grads) == 0
    assert gradient_transient_bytes(strategy(dp=2, zero=1, accum=1), bucket, largest, grads) == 0
    # ZeRO-1/2 on one pipeline stage: priced moment by moment (deepspeed_moment_peak); ZeRO-1 under
    # the pipeline engine keeps the bound
    assert gradient_transient_bytes(strategy(dp=2, zero=1, accum=4), bucket, largest, grads) == 0
    assert gradient_transient_bytes(strategy(dp=2, zero=2, accum=1), bucket, largest, grads) == 0
    assert gradient_transient_bytes(strategy(dp=2, pp=2, zero=1, accum=4), bucket, largest, grads) == largest
    # ZeRO-3 on one stage: by moment too (dsauto.cost.zero3); with the optimizer offloaded, the bound
    assert gradient_transient_bytes(strategy(dp=2, zero=3, accum=1), bucket, largest, grads) == 0
    offloaded = dataclasses.replace(strategy(dp=2, zero=3, accum=1), offload="optimizer")
    assert gradient_transient_bytes(offloaded, bucket, largest, grads) == largest
    assert gradient_transient_bytes(strategy(dp=1, zero=3, accum=1), bucket, largest, grads) == 0
    # a model with fewer gradients than the buckets hold cannot have more awaiting
    assert gradient_transient_bytes(offloaded, bucket, largest, 4 * MiB) == 4 * MiB


@pytest.mark.parametrize("zero, measured_mib", [(1, 225.4), (2, 225.4), (3, 209.1)])
def test_the_optimizer_update_matches_the_measured_moment(zero, measured_mib):
    # Measured with the emitted config (torch's fused AdamW), a tracker region around the update.
    from dsauto.cost.step import optimizer_step_bytes

    stage = _wide_step(zero, 1, 8).stages[0]
    bucket = 16 * MiB
    for single_tensor in (True, False):  # the fused update is the same on a CPU and on CUDA
        update = optimizer_step_bytes(strategy(dp=2, zero=zero, accum=8), stage.params_bytes, stage.grads_bytes,
                                      stage.optimizer_bytes, bucket, single_tensor=single_tensor)
        assert update / MiB == pytest.approx(measured_mib, rel=0.01)
    assert stage.peak_bytes >= update


def test_zero_backward_peaks_are_within_a_few_percent_of_measured():
    # Measured peaks (MiB) of ZeRO-1 and -2 at micro-batch 1 with 8 accumulation steps, and ZeRO-3
    # at micro-batch 2 with 4: 305.2, 305.5 and 281.8. The analytic activations differ a little from
    # the profiled ones the measurement was compared with, hence the 6%.
    for (zero, mb, accum), measured in {(1, 1, 8): 305.2, (2, 1, 8): 305.5, (3, 2, 4): 281.8}.items():
        predicted = _wide_step(zero, mb, accum).prediction.peak_memory_bytes / MiB
        assert predicted == pytest.approx(measured, rel=0.06), (zero, predicted)
