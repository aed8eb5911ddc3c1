"""One rank of the Megatron-core runtime tests, launched by torchrun on CPU processes with gloo.

    torchrun --nproc_per_node N tests/runtime/megatron_worker.py JOB.json OUT.json

JOB.json holds ``seed``, ``steps``, ``lr`` and a list of ``runs``: {"name", "plan", "measure"},
{"name", "plan", "expect_error": true}, or {"name", "plan": a ds_config.json, "engine":
"deepspeed"}. Each run trains the GPT of examples/megatron/train_gpt.py (its model, data, wrapper
and train step; with "deepspeed", DeepSpeed ZeRO with dsauto's mpu instead of Megatron's DDP and
optimizer) under one plan, after giving the weights values that do not depend on the parallel
layout, so that every layout trains the same network on the same global batch. Rank 0 writes, per
run, the losses of the last stage, the transformer layers each pipeline stage (and each model chunk,
with virtual stages) built and the bytes each stage kept for backward.
One launch serves several runs because starting Megatron-core processes costs most of the time.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import traceback
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

import dsauto.megatron as dm
from dsauto.compat import megatron_cpu
from dsauto.errors import DsautoError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "train_gpt.py"


def seeded_chunks(example, plan, seed: int) -> list:
    """The plan's model chunks built by the example on CPU after the plan's process groups, with
    weights that do not depend on the layout (:func:`layout_free_init`)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    dm.initialize_model_parallel(plan)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    chunks = example.build_model(plan, on_cpu=True)
    for chunk in chunks:
        layout_free_init(chunk, seed)
    return chunks


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layout_free_init(model: torch.nn.Module, seed: int) -> None:
    """Sets every weight matrix to a slice of a full tensor drawn from (seed, global name), so that
    the values do not depend on tp, pp or the layout. Megatron's own CPU initialisation draws
    layers in construction order, which differs per pipeline stage. Norm weights (ones) and biases
    (zeros) are initialised alike in every layout already and are left as built."""
    from megatron.core import parallel_state

    config = model.config
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    number = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
              for i, layer in enumerate(model.decoder.layers)}
    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue
        full_name = re.sub(r"^decoder\.layers\.\d+\.", lambda m: number[m.group(0)], name)
        if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            full_name = "embedding.word_embeddings.weight"  # the tied head: the same tensor
        split = getattr(param, "tensor_model_parallel", False)
        dim = param.partition_dim if split else 0
        shape = list(param.shape)
        shape[dim] *= tp if split else 1
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{full_name}".encode()))
        full = torch.randn(shape, generator=generator) * 0.02
        if not split:
            shard = full
        elif config.gated_linear_unit and name.endswith("mlp.linear_fc1.weight"):
            # The fused gate/up matrix: each TP rank holds its slice of the gate and of the up half.
            gate, up = full.chunk(2, dim=0)
            shard = torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])
        else:
            shard = full.chunk(tp, dim=dim)[tp_rank]
        param.data.copy_(shard)


class SavedBytes:
    """Bytes of the storages that autograd keeps for backward during a forward pass (parameters
    excluded), per forward pass of a model chunk over a micro-batch: the activation memory the
    recomputation settings change."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        self.params = {p.untyped_storage().data_ptr() for chunk in chunks for p in chunk.parameters()}
        self.per_micro_batch: list[int] = []

    def forward_step(self, forward_step):
        def measured(data_iterator, model):
            kept: dict[int, int] = {}

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in self.params:
                    kept[storage.data_ptr()] = storage.nbytes()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                result = forward_step(data_iterator, model)
            self.per_micro_batch.append(sum(kept.values()))
            return result

        return measured


def run(example, job: dict, spec: dict) -> dict:
    from megatron.core import parallel_state

    plan = dm.load_plan(spec["plan"])
    if spec.get("expect_error"):
        try:
            dm.initialize_model_parallel(plan)
        except DsautoError as error:
            return {"error": str(error)}
        return {"error": None}
    chunks = seeded_chunks(example, plan, job["seed"])
    layers = [[layer.layer_number for layer in chunk.decoder.layers] for chunk in chunks]
    measure = SavedBytes(chunks) if spec.get("measure") else None
    model, optimizer = example.wrap(plan, chunks, lr=job["lr"], weight_decay=0.0)
    data = [example.batches(plan, job["seed"]) for _ in model]
    forward_step = measure.forward_step(example.forward_step) if measure else example.forward_step
    losses = [example.train_step(plan, model, optimizer, data, forward_step) for _ in range(job["steps"])]
    config = model[0].config
    mine = {
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "layers": layers,
        "losses": losses if parallel_state.is_pipeline_last_stage() else None,
        "saved_bytes": max(measure.per_micro_batch) if measure else None,
        "recompute": [config.recompute_granularity, config.recompute_method, config.recompute_num_layers],
    }
    ranks: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(ranks, mine)
    parallel_state.destroy_model_parallel()
    stages = sorted({r["pp_rank"] for r in ranks})
    chunks_of = [next(r["layers"] for r in ranks if r["pp_rank"] == s) for s in stages]
    return {
        "losses": next(r["losses"] for r in ranks if r["losses"] is not None),
        # The transformer layers of each pipeline rank (over its chunks), and of each model chunk in
        # Megatron's order (chunk i * pp + r is rank r's i-th).
        "stage_layers": [[layer for chunk in chunks for layer in chunk] for chunks in chunks_of],
        "chunk_layers": [chunks[i] for i in range(plan.virtual_stages) for chunks in chunks_of],
        "saved_bytes": [max(r["saved_bytes"] for r in ranks if r["pp_rank"] == s) for s in stages]
        if measure else None,
        "recompute": ranks[0]["recompute"],
    }


def run_deepspeed(example, job: dict, spec: dict) -> dict:
    """ZeRO from the plan's ds_config.json over the Megatron-core model, DeepSpeed told the
    tensor-parallel layout by dsauto's mpu. The optimizer matches the Megatron runs (Adam, betas
    0.9 / 0.999, no weight decay, gradients clipped at 1.0) so that the losses can be compared."""
    import deepspeed
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    plan = dm.load_plan(spec["plan"])  # the "dsauto" block of ds_config.json
    ds_config = json.loads(Path(spec["plan"]).read_text())
    ds_config["optimizer"]["params"].update(lr=job["lr"], betas=[0.9, 0.999], weight_decay=0.0)
    dm.initialize_model_parallel(plan)
    torch.manual_seed(job["seed"])
    model_parallel_cuda_manual_seed(job["seed"])
    [model] = example.build_model(plan, on_cpu=True)
    layout_free_init(model, job["seed"])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=ds_config, mpu=dm.deepspeed_mpu())
    data = example.batches(plan, job["seed"])
    losses, grad_norms = [], []
    for _ in range(job["steps"]):
        step_losses = []
        for _ in range(plan.grad_accum):
            batch = next(data)
            loss = engine(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float().mean()
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        loss = torch.tensor(sum(step_losses) / len(step_losses))
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())  # over the global batch
        losses.append(loss.item() / parallel_state.get_data_parallel_world_size())
        grad_norms.append(float(engine.get_global_grad_norm()))
    result = {"losses": losses, "grad_norms": grad_norms, "zero_stage": engine.zero_optimization_stage(),
              "dp_world_size": engine.dp_world_size,
              "tp_world_size": parallel_state.get_tensor_model_parallel_world_size()}
    parallel_state.destroy_model_parallel()
    return result


def serve(run_one) -> None:
    """One rank of a job: ``run_one(job, spec)`` for each run of the job file (argv[1]) on gloo with
    the CPU shim, each failure kept as its traceback; rank 0 writes the results to argv[2]."""
    job_path, out_path = sys.argv[1:3]
    job = json.loads(Path(job_path).read_text())
    shim = megatron_cpu.enable()
    dist.init_process_group("gloo")
    results = {}
    for spec in job["runs"]:
        try:
            results[spec["name"]] = run_one(job, spec)
        except Exception:  # noqa: BLE001 (each failure goes to the test, which shows its traceback)
            results[spec["name"]] = {"traceback": traceback.format_exc()}
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    if any(spec.get("engine") == "deepspeed" for spec in job["runs"]):
        import deepspeed

        deepspeed.comm.destroy_process_group()  # DeepSpeed's own teardown, or ranks can abort at exit
    else:
        dist.destroy_process_group()
    shim.disable()


def main() -> None:
    example = load_example()
    serve(lambda job, spec: (run_deepspeed if spec.get("engine") == "deepspeed" else run)(example, job, spec))


if __name__ == "__main__":
    main()
