"""One rank of the Megatron-core mixture-of-experts test, launched by megatron_launch.launch:

    python tests/runtime/megatron_moe_worker.py JOB.json OUT.json

For each run (a plan of a small MoE GPT) it builds Megatron-core's GPTModel with MoE layers through
the dsauto plugin (expert-parallel groups, the experts in TransformerConfig), gives every weight a
value drawn from (seed, its global name: a local expert's global index), so that every ep trains
the same network, and trains with Megatron's DDP and distributed optimizer on data drawn per
data-parallel rank. Rank 0 writes the losses, averaged over the data-parallel ranks.

The token dispatcher is the one dsauto plans and prices, ``alltoall`` (which ``dsauto.megatron.apply``
sets); a run may name another (``dispatcher``) to compare.
"""

from __future__ import annotations

import re
import zlib

import torch
import torch.distributed as dist

import dsauto.megatron as dm
from megatron_worker import serve


def run(job: dict, spec: dict) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    plan = dm.load_plan(spec["plan"])
    dm.initialize_model_parallel(plan)
    torch.manual_seed(job["seed"])
    model_parallel_cuda_manual_seed(job["seed"])
    config = dm.apply(plan, TransformerConfig(**dm.transformer_config_kwargs(plan.model), use_cpu_initialization=True,
                                              attention_backend=AttnBackend.local))
    if "dispatcher" in spec:
        config.moe_token_dispatcher_type = spec["dispatcher"]
    layer_spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization=config.normalization)
    gpt = GPTModel(config=config, transformer_layer_spec=layer_spec, **dm.gpt_model_kwargs(plan))
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    local_experts = plan.model.num_experts // plan.ep
    for name, param in gpt.named_parameters():
        if param.dim() < 2:
            continue  # norms (ones) and biases (zeros) are built alike in every layout
        full_name = re.sub(r"local_experts\.(\d+)\.",
                           lambda m: f"experts.{ep_rank * local_experts + int(m.group(1))}.", name)
        generator = torch.Generator().manual_seed(zlib.crc32(f"{job['seed']}/{full_name}".encode()))
        param.data.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    model = DistributedDataParallel(config, dm.ddp_config(plan), gpt)
    optimizer = get_megatron_optimizer(dm.optimizer_config(plan, lr=job["lr"]), [model])
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    sequences = plan.micro_batch * plan.grad_accum
    positions = torch.arange(plan.seq_len).unsqueeze(0).expand(sequences, plan.seq_len)
    losses = []
    for _ in range(job["steps"]):
        generator = torch.Generator().manual_seed(dp_rank)  # the same batch each step: it must fit it
        tokens = torch.randint(0, plan.model.vocab_size, (sequences, plan.seq_len + 1), generator=generator)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dp)
    recomputed = bool(gpt.decoder.layers[0].mlp.moe_layer_recompute)
    held = sum(1 for name, _ in gpt.named_parameters() if name.startswith("decoder.layers.0.mlp.experts.")
               and name.endswith("linear_fc1.weight"))
    parallel_state.destroy_model_parallel()
    dispatcher = type(gpt.decoder.layers[0].mlp.token_dispatcher).__name__
    return {"losses": losses, "experts_per_rank": held, "moe_layer_recompute": recomputed, "dispatcher": dispatcher,
            "capacity": [config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity]}


def main() -> None:
    serve(run)


if __name__ == "__main__":
    main()
