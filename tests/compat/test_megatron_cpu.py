"""dsauto.compat.megatron_cpu: the CUDA calls of Megatron-core redirected to the CPU, and undone.

In this process, no process group needed; the training runs that rely on the shim are in
tests/runtime/test_megatron.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from dsauto.compat import MegatronCpuShim, megatron_on_cpu

# TransformerConfig warns about a CUDA-graph default that has nothing to do with these tests.
pytestmark = pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning")

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def patched_attributes():
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return {
        "current_device": torch.cuda.current_device, "synchronize": torch.cuda.synchronize,
        "get_rng_state": torch.cuda.get_rng_state, "random.set_rng_state": torch.cuda.random.set_rng_state,
        "manual_seed": torch.cuda.manual_seed, "_get_cuda_rng_state": mcore_random._get_cuda_rng_state,
        "_set_cuda_rng_state": mcore_random._set_cuda_rng_state,
        "WrappedTorchNorm.__new__": vars(WrappedTorchNorm)["__new__"],
    }


def test_importing_changes_nothing():
    code = ("import sys, torch; before = torch.cuda.current_device; import dsauto.compat; "
            "print(torch.cuda.current_device is before, 'megatron' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


def test_disable_restores_every_patch_and_the_mode_stack():
    before, modes = patched_attributes(), torch._C._len_torch_function_stack()
    with megatron_on_cpu() as shim:
        assert shim.enabled
        during = patched_attributes()
        assert all(during[name] is not before[name] for name in before)
        assert torch._C._len_torch_function_stack() == modes + 1
    assert all(value is before[name] for name, value in patched_attributes().items())
    assert torch._C._len_torch_function_stack() == modes


@needs_no_cuda
def test_cuda_devices_become_the_cpu():
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")
    with megatron_on_cpu():
        cpu = torch.device("cpu")
        assert torch.empty(2, device="cuda").device == cpu
        assert torch.zeros(2, device=torch.cuda.current_device()).device == cpu
        assert torch.ones(1, device=torch.device("cuda", 0)).device == cpu
        t = torch.ones(3)
        assert t.cuda() is t and t.to("cuda:0").device == cpu and t.to(torch.cuda.current_device()).device == cpu
        assert not torch.empty(2, pin_memory=True).is_pinned()
        # Megatron's optimizers accept parameters by their CUDA type names only.
        assert t.type() == "torch.cuda.FloatTensor" and t.type(torch.float64).dtype == torch.float64
        torch.cuda.synchronize()


@needs_no_cuda
def test_the_mode_stays_on_in_backward():
    class AllocatesInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            # As tensor_parallel/layers.py does in its backward (all-gather buffers).
            out = torch.empty(grad.shape, dtype=grad.dtype, device=torch.cuda.current_device())
            return out.copy_(grad * 2)

    with megatron_on_cpu():
        x = torch.ones(3, requires_grad=True)
        AllocatesInBackward.apply(x).sum().backward()
        assert x.grad.tolist() == [2.0, 2.0, 2.0]
        y = torch.ones(3, requires_grad=True)
        (grad,) = torch.autograd.grad(AllocatesInBackward.apply(y).sum(), [y])
        assert grad.tolist() == [2.0, 2.0, 2.0]


def test_the_rng_tracker_forks_the_cpu_generator(caplog):
    from megatron.core.tensor_parallel import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    with megatron_on_cpu():
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
        torch.manual_seed(1)
        outside = torch.rand(2)
        torch.manual_seed(1)
        with get_cuda_rng_tracker().fork():
            first = torch.rand(2)  # dropout in a tensor-parallel region draws here
        assert torch.equal(torch.rand(2), outside)  # the default stream did not move
        with get_cuda_rng_tracker().fork():
            second = torch.rand(2)
        assert not torch.equal(first, second)  # the tracked stream moved on
        model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
        with get_cuda_rng_tracker().fork():
            assert torch.equal(torch.rand(2), first)  # and replays from its seed
    assert not any("RNG state changed" in r.getMessage() for r in caplog.records)


def test_recomputation_replays_dropout():
    from megatron.core.tensor_parallel import (
        checkpoint,
        model_parallel_cuda_manual_seed,
    )

    def layer(x, w):
        return torch.nn.functional.dropout(x @ w, p=0.5, training=True).tanh()

    x = torch.randn(4, 8)
    grads = []
    with megatron_on_cpu():
        model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0)
        for recompute in (False, True):
            w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
            torch.manual_seed(11)
            out = checkpoint(layer, False, x, w) if recompute else layer(x, w)
            out.sum().backward()
            grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


def test_torch_norms_serve_sequence_parallelism():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(config, 8)
    with MegatronCpuShim():
        norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.LayerNorm)
    # finalize_model_grads all-reduces the gradients of parameters marked so over the TP group.
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
