"""The ZeRO-3 per-module cost is measured on a real DeepSpeed engine (here one gloo rank)."""

import dataclasses

import torch

from dsauto.profile.engine import measure_zero3_module_seconds, modules_per_layer
from dsauto.spec.loaders import load_model


def test_zero3_hook_cost_is_measured_per_module():
    tiny = load_model("gpt-tiny")
    seconds = measure_zero3_module_seconds(tiny, seq_len=32, dtype=torch.float32, device=torch.device("cpu"),
                                           warmup=1, repeats=3)
    assert 0.0 <= seconds < 0.05  # a module's hooks cost well under 50 ms, even on a loaded CPU
    counts = modules_per_layer(tiny)
    assert counts["1"] == 9  # the layer, two norms, four matrices, the attention core, dropout
    # Split in two, each of the three matrices over half the largest becomes a SplitLinear calling
    # two slices (the list holding them is never called, so its hooks never run).
    assert counts["2"] == 9 + 3 * 2
    llama = dataclasses.replace(tiny, mlp="swiglu", norm="rmsnorm", position_embedding="rope")
    assert modules_per_layer(llama)["1"] == 9
