"""Fits the A100's efficiency constants to the published runs of benchmarks/fidelity.py.

A grid over the fraction of peak FLOP/s large GEMMs reach, the GEMM size at which that halves, and
the fraction of memory bandwidth bandwidth-bound kernels reach; keeps the constants with the least
largest error over the ten runs. The winners go into dsauto/templates/hardware/a100-*.yaml.

Run: python benchmarks/fit_device.py
"""

from __future__ import annotations

import dataclasses
import itertools

from benchmarks.fidelity import RUNS, SEQ, VOCAB, paper_flops
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.loaders import load_hardware
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec


def errors(hardware) -> list[float]:
    out = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, published in RUNS:
        model = ModelSpec(name=f"gpt-{size}b", architecture="decoder", num_layers=layers,
                          hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
                          vocab_size=VOCAB, max_position_embeddings=SEQ)
        cluster = ClusterSpec(hardware, nodes=gpus // 8, gpus_per_node=8)
        train = TrainSpec(global_batch=batch, seq_len=SEQ, dtype="fp16", flash_attention=False)
        plan = Planner(model, cluster, train, Constraints(tp=tp, pp=pp, zero_stage=0,
                                                          sequence_parallel=False,
                                                          checkpoint=True)).search()[0]
        predicted = paper_flops(batch, layers, hidden) / plan.prediction.step_seconds / gpus / 1e12
        out.append(predicted / published - 1)
    return out


def main() -> None:
    base = load_hardware("a100-80gb")
    best = None
    for efficiency, half_dim, bandwidth in itertools.product(
            (0.70, 0.75, 0.80, 0.85), (32.0, 64.0, 128.0), (0.6, 0.7, 0.8, 0.9)):
        device = dataclasses.replace(base.device, matmul_efficiency=efficiency,
                                     matmul_half_dim=half_dim,
                                     memory_bandwidth_efficiency=bandwidth)
        errs = errors(dataclasses.replace(base, device=device))
        worst = max(abs(e) for e in errs)
        print(f"matmul_efficiency={efficiency} matmul_half_dim={half_dim} "
              f"memory_bandwidth_efficiency={bandwidth} max_abs_error={worst:.3f} "
              f"errors={' '.join(f'{e:+.2f}' for e in errs)}", flush=True)
        if best is None or worst < best[0]:
            best = (worst, efficiency, half_dim, bandwidth)
    print("best: max_abs_error=%.3f matmul_efficiency=%s matmul_half_dim=%s memory_bandwidth_efficiency=%s" % best)


if __name__ == "__main__":
    main()
