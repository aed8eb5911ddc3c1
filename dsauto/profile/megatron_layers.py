"""Megatron-core's own transformer layer, built as one tensor-parallel rank's shard for the profiler.

A plan for engine ``megatron`` trains Megatron-core's ``TransformerLayer`` of the local layer spec
(``get_gpt_layer_local_spec``, as :func:`dsauto.profile.megatron_steps.build` and the plugin's CPU
runs build it), whose kernels differ from the reference layers' (:mod:`dsauto.models`): its unfused
``DotProductAttention`` (``baddbmm`` into a preallocated buffer, a separate mask and softmax) is
slower than ``scaled_dot_product_attention``. ``dsauto profile --engine megatron`` times this layer.

The shard of a TP-t layer is the layer Megatron-core builds with ``tensor_model_parallel_size=1`` and
1/t of the heads, of the key/value groups and of the MLP width (the head width kept): what
``ColumnParallelLinear`` and ``RowParallelLinear`` hold on one rank of t
(megatron/core/tensor_parallel/layers.py, ``output_size_per_partition`` /
``input_size_per_partition``, megatron-core 0.16), without the collectives, which the cost model
prices from the bandwidth table, as for the reference layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from dsauto.engines.megatron import qk_layernorm
from dsauto.spec.model import ModelSpec


class MegatronLayer(nn.Module):
    """Megatron-core's layer as a module of its hidden input only, ``[sequence, batch, hidden]``
    (Megatron's layout), returning the layer's output; with rotary positions, their table made as
    GPTModel.forward makes it for its layers (``RotaryEmbedding``), once per micro-batch."""

    def __init__(self, layer: nn.Module, rotary: nn.Module | None = None):
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rotary = self.rotary(x.shape[0]) if self.rotary is not None else None
        out, _ = self.layer(x, attention_mask=None, rotary_pos_emb=rotary)
        return out


def megatron_layer(model: ModelSpec, tp: int, dtype: torch.dtype, **fields: Any) -> MegatronLayer:
    """The per-rank shard of one of Megatron-core's transformer layers of ``model`` at TP ``tp`` (build
    it inside :func:`megatron_layer_state`); ``fields``: TransformerConfig fields to set besides the
    model's (``attention_softmax_in_fp32=False``, ...)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.distributed import HashStore, ProcessGroupGloo

    from dsauto.runtime.megatron import transformer_config_kwargs

    kwargs = transformer_config_kwargs(model)
    kwargs.update(fields)
    kwargs.update(num_layers=1, num_attention_heads=model.num_attention_heads // tp,
                  num_query_groups=model.kv_heads // tp, ffn_hidden_size=model.ffn_hidden_size // tp)
    config = TransformerConfig(**kwargs, use_cpu_initialization=True, attention_backend=AttnBackend.local,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm(model), normalization=config.normalization)
    # A one-rank group of this process alone, registered nowhere: the shard's tp, cp and pp groups
    # (one rank each), so that building it needs no initialize_model_parallel.
    alone = ProcessGroupGloo(HashStore(), 0, 1)
    groups = ProcessGroupCollection(tp=alone, cp=alone, pp=alone)
    rotary = None
    if model.position_embedding == "rope":
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        # As GPTModel builds it (megatron/core/models/gpt/gpt_model.py, 0.16), without rope scaling.
        rotary = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=model.rotary_percent,
                                 rotary_base=model.rotary_base, use_cpu_initialization=True, cp_group=alone)
    return MegatronLayer(build_module(spec, config=config, layer_number=1, pg_collection=groups), rotary)


@contextmanager
def megatron_layer_state(device: torch.device, seed: int = 0) -> Iterator[None]:
    """Megatron-core's process-wide state that its layer reads while it runs, set for the block where
    not set already, and taken back after it: on a CPU the device shim
    (:mod:`dsauto.compat.megatron_cpu`), the global memory buffer ``DotProductAttention`` takes its
    score buffer from (parallel_state.get_global_memory_buffer) and the model-parallel RNG state its
    dropout forks (tensor_parallel.random.CudaRNGStatesTracker.fork), as
    ``initialize_model_parallel`` and ``model_parallel_cuda_manual_seed`` set them; and, in a process
    outside a distributed job, a one-process default group: without one, the parallel linears drop
    the group they are given and refuse to run (megatron/core/utils.py,
    ``get_tensor_model_parallel_group_if_none``, 0.16)."""
    import torch.distributed as dist

    from dsauto.compat.megatron_cpu import MegatronCpuShim

    with ExitStack() as stack:
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            stack.callback(dist.destroy_process_group)
        if device.type == "cpu":
            stack.enter_context(MegatronCpuShim())
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME, get_cuda_rng_tracker

        if parallel_state._GLOBAL_MEMORY_BUFFER is None:
            parallel_state._set_global_memory_buffer()
            stack.callback(parallel_state.destroy_global_memory_buffer)
        tracker = get_cuda_rng_tracker()
        if _MODEL_PARALLEL_RNG_TRACKER_NAME not in tracker.get_states():
            saved = tracker.get_states()
            tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed)

            def restore() -> None:
                tracker.reset()
                if saved:
                    tracker.set_states(saved)
            stack.callback(restore)
        yield
