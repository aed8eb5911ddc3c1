"""Megatron-core 0.16 on CPU processes with the gloo backend.

Megatron-core builds its models on the CPU (``TransformerConfig(use_cpu_initialization=True)``) and
its process groups with gloo, but its forward pass, pipeline schedules, DDP buffers and optimizers
still call CUDA in a few places. This module redirects exactly those calls to the CPU, so that the
real Megatron-core modules (GPTModel, the 1F1B schedule, the distributed optimizer) run unchanged in
tests and CPU dry runs. What it patches (:data:`PATCHES`), all undone by :meth:`MegatronCpuShim.disable`:

1. ``torch.cuda.current_device()`` returns device index 0. Megatron passes it as ``device=`` when it
   allocates buffers (tensor_parallel/mappings.py, layers.py, p2p_communication.py,
   distributed/param_and_grad_buffer.py); the device mode below maps that index to the CPU.
2. ``torch.cuda.synchronize()`` does nothing (p2p_communication.py calls it after batched sends;
   CPU work is already synchronous).
3. The CUDA random generator is the CPU default generator: ``torch.cuda.get_rng_state``,
   ``set_rng_state`` and ``manual_seed`` (also under ``torch.cuda.random``), and Megatron's own
   ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``, which read
   ``torch.cuda.default_generators``. Megatron's RNG tracker (``get_cuda_rng_tracker().fork()``)
   then swaps the CPU generator's state in and out exactly as it swaps the CUDA one on a GPU, so
   dropout inside tensor-parallel regions differs per TP rank as it does there, and activation
   recomputation (``tensor_parallel.checkpoint``) replays the same random numbers.
4. The tracker's warning "CPU RNG state changed within GPU RNG context" is filtered: with (3) the
   two generators are one, so the warning would fire on every forked dropout without meaning
   anything.
5. A ``TorchFunctionMode`` maps CUDA devices to the CPU in every torch call: ``device="cuda"``,
   ``device=torch.device("cuda", i)`` and integer ``device=i`` (schedules.py, clip_grads.py,
   optimizer.py allocate with them), ``Tensor.to("cuda")`` / ``Tensor.to(i)``, ``Tensor.cuda()``
   (returns the tensor itself), ``pin_memory=True`` and ``Tensor.pin_memory()`` (pinning needs
   an accelerator). ``Tensor.type()`` without arguments answers the CUDA type name
   (``torch.cuda.FloatTensor``): Megatron's optimizers accept only those names
   (optimizer/optimizer.py and distrib_optimizer.py check ``param.type()``).
6. ``WrappedTorchNorm`` (the torch LayerNorm / RMSNorm that the local layer spec falls back to
   without Apex, transformer/torch_norm.py) accepts ``sequence_parallel=True`` and marks its
   parameters ``sequence_parallel`` as Apex's ``FusedLayerNorm`` does (fusions/fused_layer_norm.py),
   so that ``finalize_model_grads`` all-reduces their gradients over the TP group. Unpatched it
   refuses sequence parallelism, which the CUDA-only Apex and Transformer Engine norms provide.

7. CUDA streams: ``torch.cuda.Stream(...)``, ``torch.cuda.default_stream()`` and
   ``torch.cuda.current_stream()`` return a CPU stand-in whose ``wait_stream`` / ``wait_event`` /
   ``synchronize`` do nothing and whose ``record_event()`` gives an event that is already complete,
   and ``torch.cuda.stream(s)`` is an empty context. Megatron-core's
   partial distributed optimizer (``num_distributed_optimizer_instances > 1``) creates a
   communication stream for its buckets (distributed/distributed_data_parallel.py) and runs the
   gradient reduce-scatter and the all-reduce across instances under it, synchronously
   (distributed/param_and_grad_buffer.py, ``start_grad_sync`` / ``finish_grad_sync``); on the CPU
   that work is already in order. The MoE alltoall dispatcher copies its split sizes to the host on
   a side stream and waits on an event (transformer/moe/token_dispatcher.py,
   ``_maybe_dtoh_and_synchronize``).
8. That copy (``maybe_move_tensor_to_cpu``, moe_utils.py) leaves CPU tensors alone, so the split
   sizes would reach ``all_to_all_single`` as tensors, which it refuses; in the dispatcher's module
   it returns what a GPU gets, numpy arrays where asked. With 7, Megatron-core's alltoall dispatcher,
   the one dsauto plans, runs on gloo ranks.

The pipeline schedules, the interleaved one included, need nothing more: their CUDA calls are the
``device="cuda"`` token counter and p2p shape buffers on ``current_device()`` (items 1 and 5), and the
interleaved schedule's overlapped sends (``overlap_p2p_comm``, which ``dsauto.megatron.apply`` sets
for it) are plain ``isend`` / ``irecv``, which gloo runs.

Not covered, because no CPU run needs them: CUDA events and streams beyond item 7 (activation
offloading), ``torch.autocast("cuda")``
(fp16/bf16 autocast; CPU runs train in fp32), CUDA graphs, NCCL user buffers, Transformer Engine.

While the mode is on, a warning that torch raises inside a call (such as the one for reading
``.grad`` of a non-leaf tensor, which Megatron's optimizer ``zero_grad`` triggers on GPUs too) points
at the mode's handler in this file rather than at the Megatron line that made the call.

Torch function modes live on the calling thread's mode stack; on the CPU autograd runs backward on
the thread that calls ``backward()``, so one ``enable()`` on the training thread covers forward,
backward and the optimizer step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

PATCHES: tuple[str, ...] = (
    "torch.cuda.current_device -> 0 (mapped to the CPU by the device mode)",
    "torch.cuda.synchronize -> no-op",
    "torch.cuda.get_rng_state / set_rng_state / manual_seed (and torch.cuda.random.*) -> CPU generator",
    "megatron.core.tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state -> CPU generator",
    "megatron.core.tensor_parallel.random logger: drop 'CPU RNG state changed within GPU RNG context'",
    ("TorchFunctionMode: device='cuda' / cuda:i / int -> cpu; Tensor.to(cuda), Tensor.cuda(), "
     "pin_memory -> cpu, unpinned; Tensor.type() -> 'torch.cuda.<T>'"),
    ("megatron.core.transformer.torch_norm.WrappedTorchNorm: accepts sequence_parallel, marks its "
     "parameters sequence_parallel as Apex's FusedLayerNorm does"),
    ("torch.cuda.Stream / default_stream / current_stream -> a CPU stand-in whose waits do nothing "
     "and whose recorded events are complete; torch.cuda.stream(s) -> an empty context"),
    ("megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu -> host copies as on a "
     "GPU (numpy split sizes for the alltoall dispatcher)"),
)
"""What :meth:`MegatronCpuShim.enable` changes, one line each (the module docstring says why)."""

_CPU = torch.device("cpu")
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


def _is_cuda_device(device: Any) -> bool:
    """Whether ``device`` names a CUDA device (a string, a torch.device or a bare index)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_RUNS_USER_CODE = (torch.autograd.backward, torch.Tensor.backward, torch.autograd.grad)
"""Torch functions that run arbitrary Python (autograd Functions' backward, hooks) inside them."""

_redispatch = getattr(torch.overrides, "redispatch_function", None)
"""Calls a torch function without dispatching it to the current mode again. Torch versions without
it do not dispatch ``torch.autograd.backward`` to modes, so a plain call keeps the mode on for the
backward pass there (``torch.autograd.grad`` then runs without it; Megatron's training never calls it)."""


class _CudaDevicesToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to the CPU (item 5 of the module docstring)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            # "torch.FloatTensor" -> "torch.cuda.FloatTensor", as a CUDA parameter would answer.
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func in _RUNS_USER_CODE and _redispatch is not None:
            # A mode is popped while its handler runs, so a backward pass started here would run
            # Megatron's backward functions (which allocate on torch.cuda.current_device()) without
            # it: torch 2.13 dispatches torch.autograd.backward to modes. Redispatching it with the
            # mode pushed again keeps the mode on for everything backward calls.
            with self:
                return _redispatch(func, types, args, kwargs)
        return func(*args, **kwargs)


class _DropRngWarning(logging.Filter):
    """Drops Megatron's RNG-tracker warning that item 3 makes meaningless (item 4)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _RNG_WARNING not in record.getMessage()


class _WithoutSequenceParallel:
    """A TransformerConfig seen with ``sequence_parallel=False``, for WrappedTorchNorm's checks."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return False if name == "sequence_parallel" else getattr(self._config, name)


def _sequence_parallel_norm(original_new: Callable) -> Callable:
    """WrappedTorchNorm.__new__ that also serves sequence parallelism (item 6)."""

    def new(cls: type, config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        norm = original_new(cls, _WithoutSequenceParallel(config), *args, **kwargs)
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm

    return new


class _CpuStream:
    """A CUDA stream as the CPU sees it (item 7): work runs in program order, so waiting does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()


class _CpuEvent:
    """A CUDA event as the CPU sees it (item 7): the work before it is done when it is recorded."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """Megatron-core's ``maybe_move_tensor_to_cpu`` (moe_utils.py) as it acts on a GPU, where the
    alltoall dispatcher's split sizes are device tensors: host copies, as numpy arrays where asked
    (which ``all_to_all_single`` takes as split sizes; the CPU tensors the unpatched function
    leaves alone, it refuses)."""
    if torch.is_tensor(tensor):
        return tensor.numpy() if as_numpy else tensor
    return tensor


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


class MegatronCpuShim:
    """The patches of this module as one object: :meth:`enable` applies them, :meth:`disable`
    restores every patched attribute and leaves the device mode."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode: _CudaDevicesToCpu | None = None
        self._filter: _DropRngWarning | None = None

    @property
    def enabled(self) -> bool:
        return self._mode is not None

    def enable(self) -> MegatronCpuShim:
        """Applies the patches; returns self. Enabling an enabled shim does nothing."""
        if self.enabled:
            return self
        # Imported here, not at module import: the shim must not pull in Megatron until it is used.
        from megatron.core.tensor_parallel import random as mcore_random
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        self._patch(torch.cuda, "current_device", lambda: 0)
        self._patch(torch.cuda, "synchronize", lambda device=None: None)
        self._patch(torch.cuda, "Stream", _CpuStream)
        self._patch(torch.cuda, "default_stream", lambda device=None: _CpuStream())
        self._patch(torch.cuda, "current_stream", lambda device=None: _CpuStream())
        self._patch(torch.cuda, "stream", lambda stream=None: nullcontext())
        for module in (torch.cuda, torch.cuda.random):
            self._patch(module, "get_rng_state", lambda device="cuda": torch.get_rng_state())
            self._patch(module, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state))
            self._patch(module, "manual_seed", lambda seed: torch.manual_seed(seed))
        # Megatron-core's fusions (megatron/core/jit.py: jit_fuser is torch.compile) run eagerly:
        # the same arithmetic and kept tensors, without compiling kernels per process and shape.
        from torch._dynamo import config as dynamo_config

        self._patch(dynamo_config, "disable", True)
        self._patch(mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state)
        self._patch(mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state)
        original_new = vars(WrappedTorchNorm)["__new__"]
        self._patch(WrappedTorchNorm, "__new__", staticmethod(_sequence_parallel_norm(original_new.__func__)))
        self._filter = _DropRngWarning()
        logging.getLogger(mcore_random.__name__).addFilter(self._filter)
        self._mode = _CudaDevicesToCpu()
        self._mode.__enter__()
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            # The MoE router's GEMM reads this Transformer Engine name, which Megatron-core leaves
            # undefined without Transformer Engine (moe_utils.RouterGatingLinearFunction); None is
            # its own test for "use torch". Left set on disable: it is what the module means.
            moe_utils.te_general_gemm = None
        from megatron.core.transformer.moe import token_dispatcher

        self._patch(token_dispatcher, "maybe_move_tensor_to_cpu", _host_copy)
        return self

    def disable(self) -> None:
        """Undoes :meth:`enable`; call it on the thread that enabled the shim."""
        if not self.enabled:
            return
        assert self._mode is not None and self._filter is not None
        self._mode.__exit__(None, None, None)
        self._mode = None
        from megatron.core.tensor_parallel import random as mcore_random

        logging.getLogger(mcore_random.__name__).removeFilter(self._filter)
        self._filter = None
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        # A class attribute is saved as stored (a staticmethod stays one), not as looked up.
        self._saved.append((owner, name, vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> MegatronCpuShim:
        return self.enable()

    def __exit__(self, *exc: object) -> None:
        self.disable()


def enable() -> MegatronCpuShim:
    """Applies the patches until the returned shim's ``disable()``; for scripts that run to the end."""
    return MegatronCpuShim().enable()


@contextmanager
def megatron_on_cpu() -> Iterator[MegatronCpuShim]:
    """``with megatron_on_cpu(): ...`` runs Megatron-core on the CPU inside the block only."""
    with MegatronCpuShim() as shim:
        yield shim
