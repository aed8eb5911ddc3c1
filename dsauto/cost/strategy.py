"""The choices the cost model prices: global ones (:class:`Strategy`) and per-layer ones (:class:`LayerOption`)."""

from __future__ import annotations

from dataclasses import dataclass

from dsauto.parallel import ParallelDims
from dsauto.plan import AttentionKernel, CpCommType, Engine, ExpertDispatcher, Fp8Recipe, MomentsDtype, Offload


@dataclass(frozen=True)
class Strategy:
    """The global part of a plan: degrees, ZeRO stage and batch split."""

    dims: ParallelDims
    """The parallel degrees (data, tensor, pipeline)."""
    zero_stage: int
    """ZeRO stage 0-3."""
    micro_batch: int
    """Sequences per micro-batch per data-parallel rank."""
    grad_accum: int
    """Micro-batches per step per data-parallel rank."""
    sequence_parallel: bool
    """Megatron sequence parallelism (only meaningful with tp > 1)."""
    engine: Engine = "deepspeed"
    """The engine that runs it, which decides how memory and overlap are priced."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (Megatron's interleaved 1F1B when more than 1)."""
    chunk_layout: tuple[int, ...] | None = None
    """Transformer layers of each model chunk in chunk order where a pinned layout splits a rank's
    layers otherwise than evenly (:attr:`dsauto.plan.Plan.chunk_layout`); None: the even split."""
    recompute_modules: tuple[str, ...] = ()
    """Megatron-core: the modules every transformer layer recomputes (``recompute_granularity``
    selective), which then rules out checkpointing whole layers (the engine has one granularity per
    run); empty: whole layers checkpointed or not, per layer."""
    offload: Offload = "none"
    """What the optimizer (and under ZeRO-3 the parameters' partitions) keeps in host memory."""
    hpz: int = 1
    """ZeRO++ hierarchical partition size (DeepSpeed ZeRO-3): ranks of a node sharing a secondary
    copy of the sharded parameters; 1 is plain ZeRO-3."""
    dist_opt_instances: int = 1
    """Megatron-core's partial distributed optimizer (``num_distributed_optimizer_instances``):
    instances of dp x cp / this many consecutive replicas, each sharding the optimizer state over
    its own ranks; 1 shards over all of dp x cp (:attr:`dsauto.plan.Plan.dist_opt_instances`)."""
    grad_reduce_in_fp32: bool = True
    """Megatron-core under bf16: gradients accumulated and reduced in fp32 (DistributedDataParallel
    Config.grad_reduce_in_fp32, which dsauto's plans set); False: in bf16, as PyTorch FSDP's
    mixed precision with ``reduce_dtype`` bf16 does, and as a plan pinned with
    ``--grad-reduce-in-bf16`` emits."""
    overlap_grad_reduce: bool = True
    """Megatron-core's ``--overlap-grad-reduce`` (DistributedDataParallelConfig.overlap_grad_reduce), which
    dsauto's plans set: each gradient bucket is reduced as soon as the last micro-batch's backward has
    filled it, beside the rest of that backward. False, Megatron-LM's default: every bucket is reduced
    at once after the backward, exposed whole (param_and_grad_buffer.py, ``finish_grad_sync`` calls
    ``start_grad_sync`` synchronously). Read only for Megatron-core's own data parallelism (ZeRO 0-1)."""
    overlap_param_gather: bool = True
    """Megatron-core's ``--overlap-param-gather`` under the distributed optimizer, which dsauto's plans
    set: the updated parameters are gathered bucket by bucket ahead of the next step's forward. False:
    gathered at once right after the optimizer step, exposed whole (distrib_optimizer.py,
    ``step_with_ready_grads`` calls ``start_param_sync`` synchronously). Megatron-LM refuses it
    overlapped without ``overlap_grad_reduce``. Read only under ZeRO 1 on Megatron-core."""
    pipeline_scatter_gather: bool = False
    """Megatron-LM 2021-22's pipeline scatter/gather (``--scatter-gather-tensors-in-pipeline``, on by
    default then, off under sequence parallelism): each tensor-parallel rank sends 1/tp of a stage
    boundary to the next stage and the receivers all-gather it over the node's links (Narayanan
    et al. 2021, Sec. 4.1; megatron/p2p_communication.py, ``_communicate``). Megatron-core has no
    such option: plans dsauto emits keep the default; it prices published runs of that engine."""
    p2p_overlap: bool = True
    """Megatron-core's interleaved schedule with ``overlap_p2p_comm`` (Megatron-LM's
    ``--overlap-p2p-communication``, on by default, and dsauto's plugin sets it): a model chunk's
    sends and receives run beside the next chunk's compute in the steady state
    (megatron/core/pipeline_parallel/schedules.py, ``forward_backward_pipelining_with_interleaving``:
    the ``wait_handles`` of a step's transfers are waited on only before their tensors are needed;
    :func:`dsauto.cost.step.p2p_exposed_seconds`). Read only for Megatron-core with virtual stages:
    the 1F1B schedule and DeepSpeed's pipeline block on each transfer. False: Megatron-LM 2021-22,
    whose interleaved schedule waited on each batch of transfers; it prices published runs of it."""
    recompute_early_stop: bool = False
    """PyTorch's non-reentrant activation checkpointing (``torch.utils.checkpoint`` with
    ``use_reentrant=False``, early stop on by default since PyTorch 2.1): the recomputation stops
    once it has re-created the last tensor backward needs, so a checkpointed layer does not re-run
    its last matrix multiply (the MLP output projection). Megatron-core and DeepSpeed recompute
    the whole forward: plans dsauto emits keep the default; it prices published FSDP runs."""
    expert_dispatcher: ExpertDispatcher = "alltoall"
    """Megatron-core's MoE token dispatcher: ``alltoall`` (``--moe-token-dispatcher-type alltoall``,
    what dsauto's plans emit: an NCCL all-to-all of every routed copy of each token), or ``deepep``
    (``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep``, DeepSeek's DeepEP
    kernels): across nodes a token goes over the network once per node that holds any of its experts
    and is forwarded over NVLink inside it (DeepSeek-V3 technical report, Sec. 3.2.2;
    :func:`dsauto.cost.terms.expert_dispatch_seconds`). The search never picks DeepEP (it is a
    separate install): a plan runs it when pinned (``--moe-dispatcher deepep``)."""
    experts_gathered_whole: bool = False
    """True: the model is a ``transformers`` model (a plan for Hugging Face's Trainer), whose MoE layers ZeRO-3
    gathers whole: transformers 5 keeps every expert's matrix in one 3-D parameter
    (``MixtralExperts.gate_up_proj``), DeepSpeed gathers a module's parameters together
    (deepspeed/runtime/zero/partitioned_param_coordinator.py, ``fetch_sub_module``), and its default
    leaf modules are whole sparse blocks, router and shared expert included (Mixtral, Qwen2-MoE,
    Qwen3-MoE: deepspeed/runtime/zero/leaf_module_config.py, DeepSpeed 0.19). False: one expert's
    matrix at a time (dsauto's own model, DeepSpeed-MoE's experts)."""
    expert_load_balanced: bool = False
    """Megatron-core's ``--moe-router-force-load-balancing``, a benchmarking option: the router
    ignores its scores and spreads the tokens evenly over the experts, so the busiest
    expert-parallel rank carries the mean load (:func:`dsauto.cost.terms.expert_load_factor`).
    It changes what the model learns: plans dsauto emits never set it; it prices published
    benchmarks that did (NVIDIA's Megatron-Bridge MoE tables)."""
    expert_capacity_factor: float | None = None
    """Megatron-core's ``--moe-expert-capacity-factor``: each expert takes at most this times its mean
    share of a rank's routed copies (``ceil(tokens x top-k / experts x factor)``, moe_utils.py
    ``get_capacity``) and the router drops the rest (``apply_router_token_dropping``); None: dropless.
    The busiest expert-parallel rank then carries at most the factor times the mean
    (:func:`dsauto.cost.terms.expert_load_factor`)."""
    expert_pad_to_capacity: bool = False
    """Megatron-core's ``--moe-pad-expert-input-to-capacity``: every expert takes exactly its capacity,
    the highest-scored tokens up to it whether they chose the expert or not (``apply_router_token_dropping``
    with ``pad_to_capacity``), so every rank carries the factor times the mean."""
    attention_softmax_in_fp32: bool = True
    """Megatron-core's unfused attention (TrainSpec.flash_attention False) in 16 bits computes its
    softmax on an fp32 copy of the scores and keeps the fp32 output for backward (TransformerConfig's
    ``attention_softmax_in_fp32``, True by default and in dsauto's plugin); False: the softmax keeps
    its 16-bit output, as Megatron-LM's launches run it by default (``--attention-softmax-in-fp32``
    is opt-in, and its fused masked-softmax kernel keeps 16 bits either way). Memory only:
    :func:`dsauto.cost.terms.megatron_softmax_fp32_bytes_per_token`."""
    precision_aware_optimizer: MomentsDtype | None = None
    """Megatron-core's ``--use-precision-aware-optimizer`` with Adam's moments in this dtype
    (:attr:`dsauto.plan.Plan.precision_aware_optimizer`; :func:`dsauto.cost.terms.state_bytes_per_param`
    prices its state). It changes the optimizer's numerics: plans set it only when pinned
    (``--precision-aware-optimizer``); published runs that kept their states in bf16 set it."""
    tp_comm_overlap: bool = False
    """Megatron-core's ``--tp-comm-overlap`` (Transformer Engine userbuffers, with sequence
    parallelism): the tensor-parallel collectives overlap the linear layers' GEMMs
    (:func:`dsauto.cost.terms.tp_overlap_exposed_seconds`). It takes effect only with tp > 1 and
    sequence parallelism (Megatron-LM's validate_args turns it off at tp 1), so a strategy without
    them holds False. Plans emit it when pinned (``--tp-comm-overlap``); published runs set it."""
    attention_kernel: AttentionKernel = "flash"
    """The fused attention kernel (eager attention, TrainSpec.flash_attention False, is priced
    apart): ``flash`` at the device's ``attention_efficiency``; ``cudnn``, Transformer Engine's
    FusedAttention, at its ``fused_attention_efficiency`` and, on a device without one, at its
    ``attention_efficiency``. The search gives a Megatron-core strategy ``cudnn`` where the device
    has that kernel and the model allows it, and to latent attention wherever cuDNN takes its heads
    (:func:`dsauto.engines.rules.default_attention_kernel`), and the plan passes ``--attention-backend
    fused``; ``flash`` otherwise, with ``--attention-backend flash`` (dsauto/emit/megatron.py)."""

    fp8: bool = False
    """FP8 training (Megatron-core's ``--fp8-format hybrid`` through Transformer Engine: E4M3 forward,
    E5M2 gradients): the transformer layers' linear layers run their GEMMs at the
    device's FP8 peak (:func:`dsauto.cost.terms.linear_seconds`), quantize their inputs
    (:func:`dsauto.cost.terms.fp8_cast_bytes_per_token`), keep some of them for backward in FP8
    (:func:`dsauto.cost.terms.fp8_activation_change_bytes_per_token`) and their weights' FP8 copies
    (:func:`dsauto.cost.terms.fp8_weight_bytes`). The attention core, the embedding and the output
    layer stay in the training dtype. Megatron-core plans only, on devices with FP8 tensor cores;
    never chosen by the search (it changes the numerics): a plan runs it when pinned (``--fp8``)."""
    fp8_recipe: Fp8Recipe = "delayed"
    """The FP8 scaling recipe (``--fp8-recipe``, :data:`dsauto.plan.Fp8Recipe`): ``tensorwise`` reads
    each cast input once more for its maximum and keeps the attention output in 16 bits only
    (:func:`dsauto.cost.terms.fp8_cast_bytes_per_token`,
    :func:`dsauto.cost.terms.fp8_activation_change_bytes_per_token`). Read only under ``fp8``."""
    fp8_param_gather: bool = False
    """Megatron-core's ``--fp8-param-gather`` under FP8: the transformer layers' weights are FP8
    tensors (``fp8_model_init``), so the distributed optimizer and Megatron-FSDP gather them at one
    byte a parameter and no separate FP8 copy is kept beside a 16-bit weight
    (:func:`dsauto.cost.terms.fp8_weight_bytes`, :func:`dsauto.cost.terms.data_parallel_cost`). It needs
    the distributed optimizer or Megatron-FSDP (ZeRO 1-3). Read only under ``fp8``."""
    expert_a2a_overlap: bool = False
    """Megatron-core's ``--overlap-moe-expert-parallel-comm`` (``ModelParallelConfig.
    overlap_moe_expert_parallel_comm``): in the 1F1B phase of the schedule the forward of one
    micro-batch and the backward of another run layer by layer together, so each one's expert
    all-to-alls overlap the other's compute (megatron/core/pipeline_parallel/combined_1f1b.py;
    :func:`dsauto.cost.terms.overlapped_dispatch`). It needs expert parallelism, the interleaved
    schedule when pp > 1 and no full recomputation. Plans run it when pinned (``--moe-a2a-overlap``)."""
    cp_comm_type: CpCommType = "p2p"
    """How Megatron-core's context parallelism exchanges the shards of a sequence (``--cp-comm-type``,
    :data:`dsauto.plan.CpCommType`; :func:`dsauto.cost.terms.context_parallel_seconds`): ``p2p`` a
    ring overlapped with attention, ``all_gather`` the keys and values gathered before attention and
    their gradients reduce-scattered after it, exposed, ``a2a`` all-to-alls of the queries, keys,
    values and output, exposed. Under DeepSpeed cp is DeepSpeed-Ulysses and this stays ``p2p``."""

    def __post_init__(self) -> None:
        if self.tp_comm_overlap and not (self.dims.tp > 1 and self.sequence_parallel):
            object.__setattr__(self, "tp_comm_overlap", False)  # as Megatron-LM does: nothing to overlap

    @property
    def tp(self) -> int:
        """Tensor-parallel degree."""
        return self.dims.tp

    @property
    def pp(self) -> int:
        """Pipeline-parallel degree."""
        return self.dims.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree."""
        return self.dims.dp

    def describe(self) -> str:
        sp = " sp" if self.sequence_parallel and self.tp > 1 else ""
        vpp = f" vpp={self.virtual_stages}" if self.virtual_stages > 1 else ""
        vpp += f" recompute={','.join(self.recompute_modules)}" if self.recompute_modules else ""
        vpp += f" offload={self.offload}" if self.offload != "none" else ""
        vpp += f" hpz={self.hpz}" if self.hpz > 1 else ""
        vpp += f" dist_opt_instances={self.dist_opt_instances}" if self.dist_opt_instances > 1 else ""
        vpp += f" fp8={self.fp8_recipe}" if self.fp8 else ""
        return (f"{self.engine} {self.dims.describe()}{vpp} zero={self.zero_stage}{sp} "
                f"mb={self.micro_batch} accum={self.grad_accum}")


@dataclass(frozen=True)
class LayerOption:
    """The per-layer part of a plan for one layer."""

    checkpoint: bool
    """Recompute the layer's activations in backward, keeping only its input."""
    shard_params: bool
    """ZeRO-3 only: keep the parameters sharded (gathered per use) rather than resident."""
    split: int
    """Operator-splitting factor for the layer's largest matrix (the head: loss chunks)."""
    recompute_modules: tuple[str, ...] = ()
    """Selective recomputation: the parts of the layer re-run in backward
    (:data:`dsauto.plan.RecomputeModule`); empty for none, and empty when ``checkpoint``."""
