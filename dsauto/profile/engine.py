"""What DeepSpeed's ZeRO-3 machinery costs per module, measured on this machine.

ZeRO-3 hooks every submodule (``DeepSpeedZeRoOffload`` registers pre- and post-forward and
-backward hooks): before a module runs its parameters are fetched through the partitioned-parameter
coordinator, afterwards they are released, and the gradients go to the reduction bucket. On a GPU
those hooks hide behind the kernels; on a CPU, or with small layers, their Python time is a real part
of the step. It does not follow from any device spec, so the profile measures it: one transformer
layer trained through a ZeRO-3 engine against the same layer trained plainly, on the ranks of the
current job. The difference, less the collectives' bandwidth time the cost model prices anyway, is
divided by the layer's modules.
"""

from __future__ import annotations

import atexit
import os
import tempfile

import torch
from torch import nn

from dsauto.models.gpt import Block
from dsauto.profile.layers import median_seconds
from dsauto.spec.model import ModelSpec


class _Loss(nn.Module):
    """A transformer layer with a scalar loss, so that an engine can train it alone."""

    def __init__(self, model: ModelSpec):
        super().__init__()
        self.block = Block(model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).float().pow(2).mean()


def _ensure_process_group() -> None:
    """Use the current distributed job, or start a one-rank gloo group for the measurement.

    The one-rank group lives until the process exits: DeepSpeed caches the groups it derives from
    the world group (deepspeed/utils/groups.py), so a second group would not match them.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    # DeepSpeed reads the launcher's variables even for one rank (DeepSpeedEngine._set_distributed_vars).
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        os.environ.setdefault(name, value)
    store = tempfile.NamedTemporaryFile(prefix="dsauto-store-", delete=False)
    store.close()
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    atexit.register(dist.destroy_process_group)
    atexit.register(os.unlink, store.name)


def modules_per_layer(model: ModelSpec, splits: tuple[int, ...] = (1, 2, 4, 8, 16)) -> dict[str, int]:
    """Modules whose ZeRO-3 hooks run in one transformer layer of the reference implementation, by
    operator splitting factor (the hook replaces each large Linear by its slices: dsauto.runtime.split)."""
    from dsauto.runtime.split import split_block

    # A mixture of experts' layers average its dense and MoE layers, as its layer group does
    # (LayerGroup.moe_layer_fraction).
    moe_fraction = len(model.moe_layers()) / model.num_layers
    counts = {}
    with torch.device("meta"):
        for split in splits:
            hooked = []
            for moe in (False, True) if moe_fraction else (False,):
                block = Block(model, moe=moe)
                if split > 1:
                    split_block(block, split)
                hooked.append(_hooked(block))
            counts[str(split)] = round((1 - moe_fraction) * hooked[0] + moe_fraction * hooked[-1])
    return counts


def _hooked(module: nn.Module) -> int:
    """Modules whose forward runs, so that ZeRO-3's hooks fire: containers that are only indexed
    (ModuleList, ModuleDict) are hooked but never called."""
    return sum(1 for m in module.modules() if not isinstance(m, (nn.ModuleList, nn.ModuleDict)))


def measure_zero3_module_seconds(model: ModelSpec, seq_len: int, dtype: torch.dtype,
                                 device: torch.device, bandwidth_seconds: float = 0.0,
                                 warmup: int = 3, repeats: int = 15) -> float:
    """Seconds ZeRO-3 adds per hooked module to one micro-batch's forward and backward.

    ``bandwidth_seconds``: what the cost model already prices for gathering the layer's parameters
    and reduce-scattering its gradients on this job, subtracted from the measured difference.
    Every rank of the current job must call it.
    """
    import deepspeed
    import torch.distributed as dist

    _ensure_process_group()

    world = dist.get_world_size()
    torch.manual_seed(0)
    plain = _Loss(model).to(device=device, dtype=dtype)
    x = torch.randn(1, seq_len, model.hidden_size, device=device, dtype=dtype)

    def plain_step() -> None:
        plain(x).backward()
        plain.zero_grad(set_to_none=True)

    plain_seconds = median_seconds(plain_step, device, warmup, repeats)
    largest = max(p.numel() for p in plain.parameters())
    config = {
        "train_batch_size": world, "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}},
        # As dsauto emits ZeRO-3: parameters released after use, one matrix prefetched.
        "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0,
                              "stage3_prefetch_bucket_size": largest,
                              "stage3_max_live_parameters": 2 * largest},
    }
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=_Loss(model).to(device=device, dtype=dtype),
                                      config=config, dist_init_required=False)

    def engine_step() -> None:
        engine.backward(engine(x))

    engine_seconds = median_seconds(engine_step, device, warmup, repeats)
    modules = _hooked(engine.module)
    engine.destroy()
    return max(0.0, engine_seconds - plain_seconds - bandwidth_seconds) / modules
