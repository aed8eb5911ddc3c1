"""DeepSpeed's ``mpu`` over Megatron-core's process groups: ZeRO on a tensor-parallel model.

``deepspeed.initialize(model=..., mpu=...)`` learns the model-parallel layout from an ``mpu`` object
(the module interface of the old Megatron ``mpu`` package). Megatron-core's ``parallel_state`` has
most of its methods but not ``get_model_parallel_rank`` and ``get_model_parallel_world_size``, which
ZeRO calls (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, runtime/utils.py,
runtime/engine.py for checkpoint names), so it cannot be passed as is. :class:`MegatronCoreMpu`
answers every method DeepSpeed 0.19 calls from Megatron-core's groups.

"Model parallel" in DeepSpeed means the ranks that hold different parts of one model replica:
gradient norms are summed over ``get_model_parallel_group()`` after each rank counted its
tensor-parallel parameters and, if ``get_model_parallel_rank() == 0``, its replicated ones
(runtime/utils.py, get_grad_norm; zero/stage_1_and_2.py, complete_grad_norm_calculation...). So the
group is Megatron-core's model-parallel group (tensor x pipeline ranks), and the rank is the
tensor-parallel rank: each pipeline stage has its own replicated parameters, and its TP rank 0 must
count them. With pipeline size 1 (DeepSpeed's ZeRO-2 and 3 refuse its own pipeline engine) the two
coincide.

Methods DeepSpeed only probes for with ``hasattr`` and that would change its behaviour are absent on
purpose: ``get_sequence_parallel_*`` and ``initialize_sequence_parallel`` are DeepSpeed-Ulysses
sequence parallelism (a different scheme from Megatron's), and DeepSpeed would divide its
data-parallel world by them.

Megatron sequence parallelism leaves partial gradients of the norm weights on each TP rank, which
Megatron-core's ``finalize_model_grads`` all-reduces and DeepSpeed does not; build the model with
``sequence_parallel=False`` when DeepSpeed owns the optimizer step.
"""

from __future__ import annotations

from typing import Any

from dsauto.errors import DsautoError


class MegatronCoreMpu:
    """DeepSpeed's ``mpu`` interface answered by ``megatron.core.parallel_state``.

    Create it after ``parallel_state.initialize_model_parallel`` (or
    :func:`dsauto.runtime.megatron.initialize_model_parallel`); every call reads the live groups.
    """

    def __init__(self) -> None:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            raise DsautoError("Megatron-core's model-parallel groups do not exist yet; call "
                              "initialize_model_parallel(plan) before creating the DeepSpeed mpu.")
        self._ps = parallel_state

    # Model parallel: the ranks of one model replica (tensor x pipeline).
    def get_model_parallel_group(self) -> Any:
        return self._ps.get_model_parallel_group()

    def get_model_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(group=self._ps.get_model_parallel_group())

    def get_model_parallel_rank(self) -> int:
        # The TP rank, not the rank in the group: see the module docstring.
        return self._ps.get_tensor_model_parallel_rank()

    # Tensor parallel.
    def get_tensor_model_parallel_group(self) -> Any:
        return self._ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_src_rank()

    # Pipeline parallel.
    def get_pipeline_model_parallel_group(self) -> Any:
        return self._ps.get_pipeline_model_parallel_group()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._ps.get_pipeline_model_parallel_world_size()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._ps.get_pipeline_model_parallel_rank()

    # Data parallel: the ranks ZeRO partitions over.
    def get_data_parallel_group(self) -> Any:
        return self._ps.get_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        return self._ps.get_data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        return self._ps.get_data_parallel_rank()

    def get_data_parallel_group_ranks(self) -> list[int]:
        import torch.distributed as dist

        return dist.get_process_group_ranks(self._ps.get_data_parallel_group())


def deepspeed_mpu() -> MegatronCoreMpu:
    """The ``mpu`` to pass to ``deepspeed.initialize`` for a Megatron-core model."""
    return MegatronCoreMpu()
