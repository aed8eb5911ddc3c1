"""Planning from Python: the same search as `dsauto tune`, with the objects it is made of.

    python examples/plan_api.py                      # llama3-8b on 2 x 8 H100, 4 plans
    python examples/plan_api.py --model gpt-tiny --hardware cpu --nodes 1 --gpus-per-node 2

Prints the best plans side by side, then writes the artifacts of the best one to out/api/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dsauto.emit import write_artifacts
from dsauto.report import describe_alternatives, describe_plan
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints
from dsauto.spec.loaders import load_cluster, load_model
from dsauto.spec.training import TrainSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--hardware", default="h100-80gb")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--out", default="out/api")
    args = parser.parse_args()

    model = load_model(args.model)
    cluster = load_cluster(args.hardware, nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    train = TrainSpec(global_batch=args.global_batch,
                      seq_len=args.seq_len or min(4096, model.max_position_embeddings),
                      dtype=cluster.hardware.dtype)
    # Users with a fixed tensor-parallel degree pin it here, e.g. Constraints(tp=8).
    plans = Planner(model, cluster, train, Constraints()).search(top_k=4)
    print(describe_plan(plans[0]))
    print(describe_alternatives(plans))
    for path in write_artifacts(plans[0], Path(args.out)):
        print("wrote", path)


if __name__ == "__main__":
    main()
