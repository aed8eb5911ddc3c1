"""The host's optimizer update, measured: what an offloaded plan's step waits for
(:func:`dsauto.cost.offload.offloaded_step_seconds` uses the rate when a profile carries it).

DeepSpeed runs the offloaded update with ``DeepSpeedCPUAdam`` (a C++ extension, vectorised and
multi-threaded with OpenMP: csrc/adam/cpu_adam_impl.cpp), Megatron-core with its hybrid device
optimizer's CPU Adam, which is torch's AdamW with ``fused=True`` (megatron/core/optimizer/__init__.py:
``from torch.optim import AdamW as CPUAdam`` and ``fused=True`` "to improve the performance of the cpu
optimizer"). DeepSpeed's extension is built on first use, which takes minutes; for DeepSpeed the
profiler times it when it is already built (installed with ``DS_BUILD_CPU_ADAM=1`` or compiled by an
earlier run, found in torch's extension cache) and otherwise times torch's fused AdamW, the nearest
(the unfused one runs several times slower), and says which one it timed. Each runs with this
process's threads (``OMP_NUM_THREADS``): set them to one rank's share of the host's cores to measure
what one GPU's offloaded update gets.
"""

from __future__ import annotations

import os

import torch

from dsauto.profile.layers import median_seconds

DEEPSPEED_CPU_ADAM = "DeepSpeedCPUAdam"
TORCH_ADAMW = "torch AdamW (fused)"


def cpu_adam_built() -> bool:
    """Whether DeepSpeed's CPU Adam loads without compiling: installed prebuilt, or in torch's
    extension cache from an earlier build."""
    try:
        from deepspeed.git_version_info import installed_ops
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return False
    if installed_ops.get("cpu_adam"):
        return True
    return os.path.exists(os.path.join(_get_build_directory("cpu_adam", verbose=False), "cpu_adam.so"))


def measure_cpu_optimizer(num_params: int, warmup: int = 2, repeats: int = 5,
                          build: bool = False, engine: str = "deepspeed") -> tuple[float, str]:
    """(seconds per parameter, which optimizer) of one Adam update of ``num_params`` fp32 host
    parameters (at most 2^24: the update is bandwidth-bound, so the rate holds beyond it): for
    ``engine`` deepspeed DeepSpeedCPUAdam when it is built (or ``build`` asks to compile it), else and
    for megatron torch's fused AdamW."""
    n = max(1, min(num_params, 2**24))
    param = torch.nn.Parameter(torch.zeros(n, dtype=torch.float32))
    param.grad = torch.randn(n, dtype=torch.float32)
    optimizer: torch.optim.Optimizer
    if engine == "deepspeed" and (build or cpu_adam_built()):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer, name = DeepSpeedCPUAdam([param], lr=1e-4, adamw_mode=True), DEEPSPEED_CPU_ADAM
    else:
        optimizer, name = torch.optim.AdamW([param], lr=1e-4, fused=True), TORCH_ADAMW
    return median_seconds(optimizer.step, torch.device("cpu"), warmup, repeats) / n, name
