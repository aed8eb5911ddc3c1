"""Engine behaviours of published runs that dsauto's own plans do not use, priced against hand counts:
pipeline scatter/gather (Megatron-LM 2021-22), gradients reduced in bf16, and PyTorch's
non-reentrant checkpoint stopping its recomputation early (checked on the real torch.utils.checkpoint),
and cuDNN's fused attention on Hopper."""

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from dsauto.cost.layer import CostModel
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import attention_passes, tp_comm_seconds
from dsauto.parallel import ParallelDims
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.loaders import load_hardware
from dsauto.spec.model import ModelSpec, layer_groups
from dsauto.spec.training import TrainSpec

S, B, H = 2048, 1, 4096
GPT = ModelSpec(name="gpt-test", architecture="decoder", num_layers=8, hidden_size=H, num_attention_heads=32,
                ffn_hidden_size=4 * H, vocab_size=51200, max_position_embeddings=S)
CHECKPOINTED = LayerOption(checkpoint=True, shard_params=True, split=1)


def cost_model(nodes=1, tp=1, pp=1, zero=0, sp=False, hardware=None, **options) -> CostModel:
    cluster = ClusterSpec(hardware or load_hardware("a100-80gb"), nodes=nodes, gpus_per_node=8)
    dp = nodes * 8 // (tp * pp)
    strategy = Strategy(dims=ParallelDims(dp=dp, tp=tp, pp=pp), zero_stage=zero, micro_batch=B, grad_accum=4,
                        sequence_parallel=sp, engine="megatron", **options)
    return CostModel(cluster, TrainSpec(global_batch=4 * dp, seq_len=S, dtype="bf16", flash_attention=True),
                     strategy, H)


def test_scatter_gather_sends_one_tp_share_across_nodes_and_gathers_it_over_nvlink():
    # tp 8 fills a node, so every stage boundary crosses the network (Narayanan et al. 2021, Sec. 4.1).
    plain = cost_model(nodes=2, tp=8, pp=2)
    scattered = cost_model(nodes=2, tp=8, pp=2, pipeline_scatter_gather=True)
    boundary = B * S * H * 2
    expected = plain.pp.send_recv(boundary / 8) + plain.context.tp_group.all_gather(boundary)
    assert scattered.p2p_seconds() == pytest.approx(expected)
    assert scattered.p2p_seconds() < plain.p2p_seconds() / 3
    # Under sequence parallelism the boundary is already split over the tp ranks: nothing changes.
    assert (cost_model(nodes=2, tp=8, pp=2, sp=True, pipeline_scatter_gather=True).p2p_seconds()
            == pytest.approx(cost_model(nodes=2, tp=8, pp=2, sp=True).p2p_seconds()))


def test_bf16_reduction_halves_megatrons_gradient_bytes_and_their_traffic():
    block = layer_groups(GPT, S, 2, 1)[1]
    option = dataclasses.replace(CHECKPOINTED, checkpoint=False)
    fp32 = cost_model(zero=3).layer(block, option)
    bf16 = cost_model(zero=3, grad_reduce_in_fp32=False).layer(block, option)
    assert fp32.grads_bytes == pytest.approx(2 * bf16.grads_bytes)
    assert bf16.grads_bytes == pytest.approx(block.params * 2 / 8)  # ZeRO-3 shards them over 8 ranks
    assert bf16.backward_seconds <= fp32.backward_seconds
    # Parameters and optimizer state are the same.
    assert (bf16.params_bytes, bf16.optimizer_bytes) == pytest.approx((fp32.params_bytes, fp32.optimizer_bytes))


def test_early_stop_skips_the_output_projection_in_the_recomputation():
    block = layer_groups(GPT, S, 2, 1)[1]
    full = cost_model().layer(block, CHECKPOINTED)
    early = cost_model(recompute_early_stop=True)
    stopped = early.layer(block, CHECKPOINTED)
    # The MLP output projection: 2 * 4h * h FLOPs per token, at the GEMM roofline of its smallest
    # dimension (the 2048 tokens here, below h = 4096).
    projection = early.device.matmul_seconds(2 * 4 * H * H * B * S, min(H, B * S))
    assert full.backward_seconds - stopped.backward_seconds == pytest.approx(projection)
    assert stopped.forward_seconds == pytest.approx(full.forward_seconds)
    plain = dataclasses.replace(CHECKPOINTED, checkpoint=False)
    unchanged = cost_model().layer(block, plain).backward_seconds
    assert early.layer(block, plain).backward_seconds == pytest.approx(unchanged)


class _Matmuls(TorchDispatchMode):
    """Counts the matrix multiplies autograd runs."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm):
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Block(nn.Module):
    """A pre-norm transformer block's matrix multiplies: QKV, output, MLP in and MLP out."""

    def __init__(self, h=32):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.dropout(self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)))
        return x + self.dropout(self.down(nn.functional.gelu(self.up(self.norm2(x)))))


def test_torch_non_reentrant_checkpoint_does_not_rerun_the_last_linear():
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(2, 8, 32, requires_grad=True)
    counts = {}
    for name, run in (("plain", block), ("checkpointed", lambda t: checkpoint(block, t, use_reentrant=False))):
        out = run(x).sum()
        with _Matmuls() as mode:
            out.backward()
        counts[name] = mode.count
    # Backward: two matrix multiplies per linear layer (input and weight gradients); the
    # recomputation re-runs QKV, the output projection and the MLP input, not the MLP output.
    assert counts["plain"] == 8
    assert counts["checkpointed"] == 8 + 3


def test_tp_comm_overlap_hides_the_collectives_under_the_linear_layers():
    block = layer_groups(GPT, S, 2, 8)[1]
    option = dataclasses.replace(CHECKPOINTED, checkpoint=False, shard_params=False)
    exposed = cost_model(tp=8, sp=True).layer(block, option)
    model = cost_model(tp=8, sp=True, tp_comm_overlap=True)
    overlapped = model.layer(block, option)
    tp_comm = tp_comm_seconds(block, model.context)  # its two all-reduces
    gemms = model.device.matmul_seconds(block.matmul_flops_per_token * B * S / 8, min(H / 8, B * S))
    hidden = model.device.comm_overlap_efficiency
    # Forward: the collectives' share the GEMMs hide (DeviceModel.overlapped) is gone; backward hides
    # them under twice the GEMMs.
    assert exposed.forward_seconds - overlapped.forward_seconds == pytest.approx(hidden * min(gemms, tp_comm))
    assert exposed.backward_seconds - overlapped.backward_seconds == pytest.approx(hidden * min(2 * gemms, tp_comm))
    # Megatron-core refuses the flag without sequence parallelism: nothing is hidden then.
    assert (cost_model(tp=8, tp_comm_overlap=True).layer(block, option).forward_seconds
            == pytest.approx(cost_model(tp=8).layer(block, option).forward_seconds))


def test_cudnn_attention_runs_at_the_devices_fused_attention_efficiency_where_it_has_one():
    block = layer_groups(GPT, S, 2, 1)[1]
    h100 = load_hardware("h100-80gb")
    hopper = dataclasses.replace(h100, device=dataclasses.replace(
        h100.device, attention_efficiency=0.25, fused_attention_efficiency=0.5))
    flash = attention_passes(block, cost_model(hardware=hopper).context)
    cudnn = attention_passes(block, cost_model(hardware=hopper, attention_kernel="cudnn").context)
    # Twice the fraction of peak: half the time, forward and backward (2.5x the forward both).
    assert cudnn.forward_seconds == pytest.approx(flash.forward_seconds / 2)
    assert cudnn.backward_seconds == pytest.approx(2.5 * cudnn.forward_seconds)
    # A device without the kernel (the A100 preset) prices it as FlashAttention.
    assert load_hardware("a100-80gb").device.fused_attention_efficiency is None
    assert (attention_passes(block, cost_model(attention_kernel="cudnn").context)
            == attention_passes(block, cost_model().context))
