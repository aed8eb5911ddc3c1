"""Which strategies each engine can run: the search offers only these, and the hooks refuse the rest.

- DeepSpeed: data parallelism with ZeRO 0-3 and the plan's per-layer choices (applied by
  ``dsauto.deepspeed.initialize``), or its pipeline engine (``PipelineModule``, ZeRO 0-1) for pp > 1.
  Tensor parallelism needs tensor-parallel modules (Megatron-core's, through ``deepspeed_mpu()``),
  which is a Megatron-core plan: a DeepSpeed plan has tp = 1.
- Megatron-core: tensor, pipeline and data parallelism; ZeRO-1 is its distributed optimizer and
  ZeRO-2/3 are Megatron-FSDP's ``optim_grads`` / ``optim_grads_params``, which dsauto plans without
  pipeline parallelism (DeepSpeed's pipeline engine has the same rule for ZeRO >= 2:
  deepspeed/runtime/pipe/engine.py asserts zero stage < 2). Megatron-FSDP shards every layer's
  parameters under ZeRO-3: there is no per-layer residency.
"""

from __future__ import annotations

from collections.abc import Iterable

from dsauto.engines.megatron import TE_FUSED_SOFTMAX_KEYS, te_softmax_fuses
from dsauto.parallel import ParallelDims
from dsauto.plan import RECOMPUTE_MODULES, AttentionKernel, CpCommType, Engine, Offload
from dsauto.spec.model import ModelSpec, attention_widths
from dsauto.spec.training import Dtype


def refusal(engine: Engine, dims: ParallelDims, zero_stage: int, dtype: Dtype | None = None) -> str | None:
    """Why ``engine`` cannot run these degrees with this ZeRO stage in ``dtype``, or None when it can
    (the reason alone: what to change depends on what the caller pinned)."""
    if why := deepspeed_bf16_pipeline_refusal(engine, dims, zero_stage, dtype):
        return why
    if zero_stage >= 2 and dims.pp > 1:
        return (f"ZeRO stage {zero_stage} cannot run with pipeline parallelism {dims.pp}: "
                f"{'DeepSpeed' if engine == 'deepspeed' else 'Megatron-core'} pipelines support ZeRO 0 "
                f"and 1 only")
    if engine == "deepspeed" and dims.tp > 1:
        return (f"DeepSpeed plans have no tensor parallelism (tp {dims.tp}): it needs Megatron-core's "
                f"tensor-parallel modules")
    return None


def mtp_pipeline_refusal(engine: Engine, pp: int, model: ModelSpec) -> str | None:
    """Why Megatron-core cannot pipeline ``model``'s multi-token-prediction layers, or None: with a tied
    head, its last stage builds an output weight beside the embedding the layers read, and uses the
    embedding's for the loss (GPTModel: ``skip_weight_param_allocation`` on the first stage only,
    ``shared_embedding_or_output_weight`` returns the embedding's where ``mtp_process``), so that
    weight never gets a gradient, which the overlapped gradient reduction dsauto's plans run refuses
    (``_ParamAndGradBucketGroup.reset`` asserts every parameter's gradient came; measured: the second
    step's first call stops there)."""
    if engine == "megatron" and pp > 1 and model.mtp_layers and model.tied_embeddings:
        return ("Megatron-core's last pipeline stage of a tied head with multi-token-prediction layers holds an "
                "output weight that gets no gradient, which its overlapped gradient reduction refuses")
    return None


def clamped_gate_refusal(engine: Engine, model: ModelSpec) -> str | None:
    """Why ``engine`` cannot build ``model``'s clamped gate (gpt-oss's, ``ModelSpec.glu_clamp``) in a
    dense MLP or a shared expert, or None. Megatron-LM turns the activation's fusion on with
    ``--quick-geglu`` and biases (megatron/training/argument_utils.py: ``bias_activation_fusion`` is
    ``bias_gelu_fusion``), as dsauto's plugin does; under it Megatron-core fuses the clamped gate only
    with the router's per-token scales, i.e. in routed experts, and a dense MLP stops with 'Only support
    fusion of gelu and swiglu' (megatron/core/transformer/mlp.py, ``MLP.forward``). Unfused
    (``--no-bias-gelu-fusion``) every MLP runs ``glu``'s clamps, which keep more than dsauto prices."""
    if engine != "megatron" or not model.glu_clamp:
        return None
    dense = model.num_layers - len(model.moe_layers())
    parts = [f"{dense} dense MLP layer{'s' if dense != 1 else ''}"] if dense else []
    if model.moe and model.shared_expert_ffn_hidden_size:
        parts.append("a shared expert in each MoE layer")
    if not parts:
        return None
    return (f"Megatron-core fuses a clamped gate (glu_clamp {model.glu_clamp:g}) only in routed experts, so "
            f"{model.name}'s {' and '.join(parts)} would run it only unfused (--no-bias-gelu-fusion), which dsauto "
            f"does not price")


def deepspeed_bf16_pipeline_refusal(engine: Engine, dims: ParallelDims, zero_stage: int,
                                    dtype: Dtype | None) -> str | None:
    """Why a DeepSpeed pipeline of data-parallel replicas does not run bf16 without ZeRO, or None.
    DeepSpeed 0.19 wraps the optimizer of such an engine in its BF16_Optimizer
    (deepspeed/runtime/engine.py, ``_do_optimizer_sanity_check``: bf16 gradients accumulated in bf16
    under pipeline parallelism), which keeps the fp32 weights and Adam's moments of 1/dp of the
    parameters on each rank and all-gathers the updated bf16 weights after the step
    (deepspeed/runtime/bf16_optimizer.py, ``fp32_groups_flat_partition``, ``update_lp_params``): the
    sharding and traffic of ZeRO stage 1, which is how dsauto plans it, not those of stage 0 (over
    one replica it runs, priced with its gradient accumulator: dsauto.plan.deepspeed_bf16_optimizer)."""
    if engine == "deepspeed" and zero_stage == 0 and dims.pp > 1 and dims.replicas > 1 and dtype == "bf16":
        return (f"DeepSpeed's pipeline engine (pp {dims.pp}) trains bf16 over {dims.replicas} data-parallel "
                f"replicas with its BF16_Optimizer, which shards the optimizer state as ZeRO stage 1 does")
    return None


def context_parallel_refusal(engine: Engine, cp: int, seq_len: int, flash_attention: bool, *,
                             heads: int = 0, kv_heads: int = 0, pp: int = 1, learned_positions: bool = False
                             ) -> str | None:
    """Why context parallelism of degree ``cp`` cannot run, or None.

    Megatron-core's context parallelism runs Transformer Engine's fused attention over 2 x cp
    load-balanced chunks of each sequence (megatron/core/extensions/transformer_engine.py,
    ``TEDotProductAttention`` with ``cp_group``), so the sequence must split into 2 x cp equal
    chunks and attention must be fused.

    Under DeepSpeed, cp is DeepSpeed-Ulysses sequence parallelism (``sequence_parallel_size``;
    Jacobs et al. 2023, Sec. 3): each rank holds 1/cp of every sequence and, around attention,
    all-to-alls trade it for 1/cp of the heads, so the sequence and the query heads and key/value
    heads (``heads``, ``kv_heads``) must split evenly over cp (DeepSpeed 0.19 can split uneven
    heads, one rank then attending over more of them: not planned). DeepSpeed's pipeline engine
    takes no sequence-parallel groups (``deepspeed.initialize`` asserts ``mpu is None`` for a
    ``PipelineModule``), so Ulysses runs with pp = 1. A model that adds learned position embeddings
    (``learned_positions``) indexes them by the position within its input, which under Ulysses is
    a shard of the sequence, so dsauto's hook refuses it (dsauto.runtime.ulysses); Megatron-core
    hands each rank its chunks' own position ids."""
    if cp == 1:
        return None
    if engine == "deepspeed":
        if pp > 1:
            return f"DeepSpeed-Ulysses (cp {cp}) does not run under DeepSpeed's pipeline engine (pp {pp})"
        if learned_positions:
            return (f"DeepSpeed-Ulysses (cp {cp}) gives each rank a shard of the sequence, and the model's learned "
                    f"position embeddings would be indexed by the position within the shard")
        for name, count in (("attention heads", heads), ("key/value heads", kv_heads)):
            if count % cp:
                return f"DeepSpeed-Ulysses splits the {count} {name} over cp {cp}, which does not divide them"
        if seq_len % cp:
            return f"the sequence ({seq_len} tokens) does not split into cp = {cp} equal shards"
        return None
    if not flash_attention:
        return "Megatron-core's context parallelism needs fused (flash) attention"
    if seq_len % (2 * cp):
        return f"the sequence ({seq_len} tokens) must split into 2 x cp = {2 * cp} equal chunks"
    return None


MIN_CONTEXT_PARALLEL_TOKENS = 16384
"""Sequences shorter than this are not split by the search (``--cp`` may still ask for it): below it
the activations a sequence shard saves rarely repay the ring's traffic (Llama 3 trained its 8K
sequences without context parallelism and its 128K ones with cp 16: Llama Team 2024, Table 4)."""


def expert_parallel_refusal(engine: Engine, dims: ParallelDims, zero_stage: int, sequence_parallel: bool,
                            num_experts: int, expert_ffn_hidden_size: int) -> str | None:
    """Why the expert degrees ``dims.ep`` x ``dims.etp`` cannot run, or None.

    Megatron-core folds the expert grid over a stage's tp x cp x dp ranks (checked by
    :class:`ParallelDims`); its MoE layer splits the routed experts evenly over ep
    (``num_moe_experts % expert_model_parallel_size``) and each expert's width over etp, and refuses
    to train MoE layers under tensor parallelism without sequence parallelism
    (megatron/core/transformer/moe/moe_layer.py). Under Megatron-FSDP (ZeRO 2/3) the expert
    parameters, gradients and optimizer states are sharded over the expert data-parallel group
    (megatron_fsdp.py: expert parameters need the ``expt_dp`` group), as the distributed optimizer
    (ZeRO 1) shards expert optimizer states. Under DeepSpeed, ep is DeepSpeed-MoE's ``ep_size``
    (``deepspeed.moe.layer.MoE``; the model must be built from DeepSpeed's MoE layers, which the hook
    checks): no expert tensor parallelism, and not under ZeRO-3, which DeepSpeed refuses with its MoE
    layers (``_validate_zero3_moe_compatibility`` in deepspeed/runtime/engine.py); ZeRO 1-2 shard the
    expert states over the expert data-parallel group. With ep = 1 a DeepSpeed plan keeps every
    expert on every rank and ZeRO shards them like any parameter. dsauto builds DeepSpeed's pipeline
    engine (a PipelineModule) of dense layers only, so a DeepSpeed plan of experts has one stage."""
    if num_experts and dims.tp > 1 and not sequence_parallel and engine == "megatron":
        return "Megatron-core trains MoE layers under tensor parallelism only with sequence parallelism"
    if num_experts and dims.pp > 1 and engine == "deepspeed":
        # dsauto.runtime.pipeline builds no PipelineModule of MoE layers
        return "dsauto places no MoE layer in DeepSpeed's pipeline engine; pin --pp 1, or plan with --engine megatron"
    if dims.ep == 1 and dims.etp == 1:
        return None
    if not num_experts:
        return f"ep {dims.ep} and etp {dims.etp} need a mixture-of-experts model"
    if engine == "deepspeed":
        if dims.etp > 1:
            return f"DeepSpeed-MoE has no expert tensor parallelism (etp {dims.etp}); plan with --engine megatron"
        if zero_stage == 3:
            return f"DeepSpeed-MoE layers (ep {dims.ep}) do not run under ZeRO-3; use ZeRO 0, 1 or 2"
    if num_experts % dims.ep:
        return f"the {num_experts} experts of an MoE layer do not split evenly over ep {dims.ep}"
    if expert_ffn_hidden_size % dims.etp:
        return f"the expert width {expert_ffn_hidden_size} does not split evenly over etp {dims.etp}"
    return None


VIRTUAL_STAGES = (2, 4)
"""Model chunks per pipeline rank the search tries beyond 1 (a pin may ask for any)."""


def virtual_stage_refusal(engine: Engine, pp: int, virtual_stages: int, micro_batches: int) -> str | None:
    """Why the interleaved schedule with ``virtual_stages`` chunks per rank cannot run, or None.

    Megatron-core's interleaved 1F1B (megatron/core/pipeline_parallel/schedules.py,
    ``forward_backward_pipelining_with_interleaving``) runs micro-batches in groups of pp, so their
    count must be a multiple of pp; DeepSpeed's pipeline engine has no interleaving. A chunk may
    hold no transformer layer: dsauto places chunks with ``--pipeline-model-parallel-layout``, whose
    stages may be empty (PipelineParallelLayerLayout counts only the layers of the whole model), and
    an empty TransformerBlock passes its input on (megatron/core/transformer/transformer_block.py);
    the search's own layouts give every chunk a layer (:func:`dsauto.search.space.strategies`)."""
    if virtual_stages == 1:
        return None
    if engine != "megatron":
        return "only Megatron-core interleaves pipeline stages (--vpp needs --engine megatron)"
    if pp == 1:
        return "virtual pipeline stages need pipeline parallelism (pp > 1)"
    if micro_batches % pp:
        return (f"the interleaved schedule needs the micro-batches per step ({micro_batches}) to be a "
                f"multiple of pp ({pp})")
    return None


def recompute_module_refusal(name: str, linear_bias: bool = False, engine: Engine | None = None,
                             experts: bool | None = None, fp8_delayed: bool = False,
                             pre_norms: bool = True, latent: bool | None = None,
                             shared_experts: bool | None = None) -> str | None:
    """Why dsauto cannot plan selective recomputation of module ``name`` on ``engine`` (None: on
    either), or None when it can (:data:`dsauto.plan.RECOMPUTE_MODULES`: the attention core, the
    norms, the dense MLP, the routed experts' activation, latent attention's up projections, an MoE
    layer's whole MLP or its shared experts). Megatron-core runs them through
    ``recompute_modules`` (one set for every layer), DeepSpeed the first three through the dsauto
    hook (dsauto.runtime.recompute, per layer).

    ``moe_act`` needs a mixture of experts (``experts``; None: not known) and Megatron-core: its
    grouped-GEMM experts (``TEGroupedMLP`` / ``GroupedMLP`` in megatron/core/transformer/moe/
    experts.py, which the emitted ``--moe-grouped-gemm`` selects; ``TransformerConfig`` refuses
    ``moe_act`` without it) checkpoint the activation function with ``CheckpointWithoutOutput`` and
    drop its output once the second matrix has consumed it. DeepSpeed-MoE's experts have no such
    option.

    ``linear_bias``: the model's linear layers have biases. Megatron-core 0.16's MLP then returns
    its output bias, a parameter, for the fused bias-dropout-add, and under ``mlp`` recomputation
    that parameter comes out of ``tensor_parallel.checkpoint`` (transformer_layer.py,
    ``_forward_mlp``) as an output of the checkpoint's own autograd node, whose backward then calls
    itself without end (seen on CPU ranks, where the process grew to gigabytes). The DeepSpeed hook
    checkpoints the whole MLP, biases included, and has no such limit.

    ``mla_up_proj`` needs latent attention (``latent``; None: not known) and Megatron-core: its
    ``MLASelfAttention`` re-runs the up projections and the rotary embedding under
    ``CheckpointWithoutOutput`` and drops the queries, keys and values they made once the attention
    core has run (megatron/core/transformer/multi_latent_attention.py, ``recompute_up_proj``);
    TransformerConfig refuses it without multi-latent attention.

    ``pre_norms``: the model normalises before attention and the MLP (ModelSpec.norm_position
    ``pre``). The DeepSpeed hook's ``layernorm`` recomputes those norms' outputs
    (dsauto.runtime.recompute, ``_target``); a model that normalises after each residual add (BERT) or
    each branch's output (OLMo 2) has none to drop.

    ``moe`` and ``shared_experts`` need a mixture of experts (the latter shared experts:
    ``shared_experts``; None: not known) and Megatron-core: its ``MoELayer`` runs its whole forward
    (router, dispatch, experts, combine, shared experts) under ``tensor_parallel.checkpoint`` for
    ``moe``, and its shared experts alone for ``shared_experts`` (megatron/core/transformer/moe/
    moe_layer.py, ``moe_layer_recompute`` and ``shared_experts_recompute``; Megatron-LM's deprecated
    ``--moe-layer-recompute`` is ``moe``). DeepSpeed-MoE has no such option.

    ``fp8_delayed``: the plan trains in FP8 with delayed scaling (:func:`fp8_refusal`), under which
    Megatron-core's ``TransformerConfig`` refuses recomputing ``moe_act`` and ``layernorm``
    (megatron/core/transformer/transformer_config.py, ``__post_init__``)."""
    if fp8_delayed and name in ("moe_act", "layernorm"):
        return (f"Megatron-core does not recompute '{name}' under FP8 with delayed scaling (use "
                f"--fp8-recipe tensorwise)")
    if name == "layernorm" and not pre_norms and engine == "deepspeed":
        return ("dsauto's DeepSpeed hook recomputes the norms before attention and the MLP ('layernorm'), and "
                "the model normalises after them; leave out layernorm, or plan with --engine megatron")
    if name == "mla_up_proj" and latent is False:
        return "'mla_up_proj' recomputes latent attention's up projections, and the model's attention is not latent"
    if name == "mla_up_proj" and engine == "deepspeed":
        return ("'mla_up_proj' is Megatron-core's recomputation of latent attention's up projections; plan with "
                "--engine megatron")
    if name == "moe_act" and experts is False:
        return "'moe_act' recomputes the routed experts' activation, and the model has no experts"
    if name == "moe_act" and engine == "deepspeed":
        return ("'moe_act' is Megatron-core's recomputation of its grouped experts' activation; plan with "
                "--engine megatron")
    if name in ("moe", "shared_experts") and experts is False:
        return f"'{name}' recomputes part of a mixture of experts' layers, and the model has no experts"
    if name == "shared_experts" and shared_experts is False:
        return "'shared_experts' recomputes an MoE layer's shared experts, and the model has none"
    if name in ("moe", "shared_experts") and engine == "deepspeed":
        return (f"'{name}' is Megatron-core's recomputation of its MoE layers' "
                f"{'whole MLP' if name == 'moe' else 'shared experts'}; plan with --engine megatron")
    if name == "mlp" and linear_bias and engine == "megatron":
        return ("Megatron-core 0.16 cannot recompute the MLP of a model whose linear layers have biases "
                "(the MLP's output bias passes through the checkpoint, whose backward then never ends); leave "
                "out mlp (core_attn recomputes the attention core), or plan with --engine deepspeed")
    if name in RECOMPUTE_MODULES:
        return None
    return (f"'{name}' is not a module Megatron-core recomputes (dsauto plans "
            f"{', '.join(RECOMPUTE_MODULES)})")


def per_layer_residency(engine: Engine) -> bool:
    """Whether the engine can keep some layers' parameters resident under ZeRO-3 while sharding
    the rest (DeepSpeed's ``ds_persist``, applied by the hook); Megatron-FSDP shards them all."""
    return engine == "deepspeed"


def offload_refusal(engine: Engine, dims: ParallelDims, zero_stage: int, offload: Offload,
                    host_problem: str | None = None, fp8_param_gather_recipe: str | None = None) -> str | None:
    """Why the engine cannot keep ``offload`` in host memory under this strategy, or None.

    DeepSpeed offloads the optimizer of ZeRO 1-3 (``zero_optimization.offload_optimizer``) and, under
    ZeRO-3 only, the parameter partitions (``offload_param``: deepspeed/runtime/zero/config.py);
    offload with its pipeline engine is not planned. Megatron-core's optimizer CPU offload runs
    inside its distributed optimizer (Megatron-LM's validate_args asks for
    ``--use-precision-aware-optimizer``, which ``OptimizerConfig`` allows only with the distributed
    optimizer: megatron/core/optimizer/optimizer_config.py), which is ZeRO-1 here; it has no
    parameter offload; with FP8 weights gathered (``--fp8-param-gather``, its recipe
    ``fp8_param_gather_recipe``) Megatron-LM's validate_args allows the optimizer's CPU offload under
    the delayed recipe only. ``host_problem``: why the cluster's hosts take nothing, if they do not
    (:func:`dsauto.search.space.host_problem`)."""
    if offload == "none":
        return None
    if host_problem:
        return host_problem
    if zero_stage == 0:
        return "offload needs ZeRO stage 1 or above (the optimizer state it moves is partitioned by ZeRO)"
    if offload == "optimizer+params" and (engine != "deepspeed" or zero_stage != 3):
        return "parameter offload is DeepSpeed ZeRO-3's offload_param (--engine deepspeed --zero-stage 3)"
    if engine == "megatron" and zero_stage != 1:
        return ("Megatron-core offloads the optimizer inside its distributed optimizer (ZeRO 1), not under "
                "Megatron-FSDP")
    if engine == "deepspeed" and dims.pp > 1:
        return "offload with DeepSpeed's pipeline engine is not planned; use pp 1"
    if engine == "megatron" and fp8_param_gather_recipe not in (None, "delayed"):
        return (f"Megatron-LM offloads the optimizer beside --fp8-param-gather only under --fp8-recipe delayed, "
                f"not {fp8_param_gather_recipe}")
    return None


def hpz_refusal(engine: Engine, dims: ParallelDims, zero_stage: int, hpz: int, devices_per_node: int) -> str | None:
    """Why ZeRO++ hierarchical partitioning over ``hpz`` ranks cannot run, or None.

    DeepSpeed builds the secondary partition groups from ``hpz`` consecutive global ranks
    (``_create_zero_param_parallel_group`` in deepspeed/utils/groups.py), which are data-parallel
    ranks of one node only when every rank is a data-parallel one (a DeepSpeed ZeRO-3 plan: tp, pp
    and cp are 1) and ``hpz`` divides the devices of a node; it exists for ZeRO-3's parameters
    alone (``zero_hpz_partition_size``). Megatron-FSDP's hybrid sharding is not planned."""
    if hpz == 1:
        return None
    if engine != "deepspeed" or zero_stage != 3:
        return "hierarchical partitioning (hpZ) is DeepSpeed ZeRO-3's (--engine deepspeed --zero-stage 3)"
    if dims.world_size != dims.dp:
        return "hpZ's groups are consecutive ranks, which are all data-parallel only when tp, pp and cp are 1"
    if devices_per_node % hpz or dims.dp % hpz:
        return f"hpz {hpz} must divide the {devices_per_node} devices of a node and dp {dims.dp}"
    return None


def dist_opt_instances_refusal(engine: Engine, dims: ParallelDims, zero_stage: int, instances: int) -> str | None:
    """Why Megatron-core's partial distributed optimizer with ``instances`` instances cannot run, or
    None.

    ``parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=N)`` splits each
    dp x cp group into N instances of consecutive ranks (the intra-partial data-parallel groups,
    asserting that N divides dp x cp) and the expert data-parallel groups likewise (asserting that
    N divides their size); ``DistributedDataParallel`` accepts N > 1 only with its distributed
    optimizer ("Partial DistOpt cannot be used without DistOpt", distributed_data_parallel.py), which
    is ZeRO-1 here. Under Megatron-FSDP (ZeRO 2/3) the same setting is its hybrid sharding (HSDP),
    whose device mesh is CUDA's (megatron/core/distributed/fsdp/mcore_fsdp_adapter.py,
    ``_init_dist_index``): not planned. An instance of one rank would shard nothing: ZeRO-0 does that."""
    if instances == 1:
        return None
    if engine != "megatron" or zero_stage != 1:
        return ("distributed optimizer instances are Megatron-core's distributed optimizer (--engine megatron "
                "--zero-stage 1); Megatron-FSDP's hybrid sharding is not planned")
    if dims.replicas % instances or dims.replicas == instances:
        return (f"{instances} instances must split the {dims.replicas} data-parallel ranks (dp x cp) into equal "
                f"instances of at least 2 ranks")
    if dims.expert_dp % instances:
        return f"{instances} instances must divide the expert data-parallel degree {dims.expert_dp}"
    return None


CUDNN_MAX_HEAD_DIM = 128
"""The widest attention head cuDNN's fused attention trains on every Hopper cuDNN that Transformer
Engine's F16_arbitrary_seqlen backend accepts (head dimensions up to 128, multiples of 16; wider
ones only for inference or on newer cuDNN: transformer_engine/common/fused_attn/fused_attn.cpp,
``nvte_get_fused_attn_backend``)."""

CUDNN_HOPPER_MAX_HEAD_DIM = 256
"""The widest head cuDNN 9.5 and later train on Hopper (sm90; the same function's "9.5: <= 256 +
Hopper + bprop"), which every container that ships Transformer Engine 2.x carries; Transformer Engine
then prefers it to FlashAttention there (``get_attention_backend``)."""


def attention_kernel_refusal(engine: Engine, kernel: AttentionKernel, dtype: Dtype, flash_attention: bool,
                             model: ModelSpec, seq_len: int | None = None, hopper: bool = False) -> str | None:
    """Why ``kernel`` cannot run this model's attention under ``engine``, or None.

    cuDNN's fused attention is Transformer Engine's FusedAttention, which dsauto's Megatron-core plans
    select with ``--attention-backend fused`` (Megatron-core then sets NVTE_FUSED_ATTN=1 and the other
    backends' variables to 0: megatron/core/models/common/language_module/language_module.py,
    ``_set_attention_backend``); dsauto's DeepSpeed plans run the model's own attention (PyTorch's SDPA
    or FlashAttention-2). Its kernels take 16-bit inputs and heads of :data:`CUDNN_MAX_HEAD_DIM` or
    less, up to :data:`CUDNN_HOPPER_MAX_HEAD_DIM` on Hopper (``hopper``: the device has a fused
    attention efficiency); chunked attention is left to FlashAttention, which a run with
    the backend forced to ``fused`` could not fall back to.

    FlashAttention (``--attention-backend flash``) does not run latent attention in Megatron-core:
    Transformer Engine turns it off where the query/key and value heads differ in width
    (transformer_engine/pytorch/attention/dot_product_attention/utils.py, ``get_attention_backend``,
    "Filter: Head dimension"), nor a softmax with learned sinks (gpt-oss: ``softmax_type`` learnable,
    "Filter: Softmax type"; cuDNN 9.13.1 on runs it), and the flag has turned the other backends off. Causal
    sliding windows (a left window, nothing to the right) it runs without attention dropout (cuDNN
    9.2 on: Transformer Engine's ``nvte_get_fused_attn_backend``, transformer_engine/common/
    fused_attn/fused_attn.cpp, and ``get_attention_backend``'s "Filter: Sliding window attention",
    which turns FusedAttention off for a window with dropout; TE 2.12)."""
    if kernel == "flash":
        if engine != "megatron" or not flash_attention:
            return None
        if model.attention_sinks:
            return ("Transformer Engine's FlashAttention does not run the sinks' learnable softmax (gpt-oss: "
                    "--softmax-type learnable)")
        if not model.latent_attention:
            return None
        qk, _, v, _ = attention_widths(model)
        if qk != v:
            heads = model.num_attention_heads
            return (f"Transformer Engine's FlashAttention does not run latent attention, whose query and key heads "
                    f"({qk // heads} wide) are not its value heads ({v // heads})")
        return None
    if engine != "megatron":
        return ("cuDNN's fused attention runs through Transformer Engine, which only dsauto's Megatron-core "
                "plans use (--engine megatron)")
    if not flash_attention:
        return "eager attention (--no-flash-attention) runs no fused kernel"
    if dtype == "fp32":
        return "cuDNN's fused attention runs in bf16 or fp16, not fp32"
    if model.window_slides(seq_len) and model.dropout:
        return (f"cuDNN's fused attention runs sliding-window attention ({model.sliding_window} tokens) only "
                f"without attention dropout")
    if model.attention_chunk:
        return f"chunked attention ({model.attention_chunk} tokens) is planned with FlashAttention"
    # latent attention's query/key and value heads (multiples of 8), or the one head width (of 16)
    if model.latent_attention:
        qk, _, v, _ = attention_widths(model)
        widths, multiple = (qk // model.num_attention_heads, v // model.num_attention_heads), 8
        what = f"latent attention's {'/'.join(map(str, widths))}"
    else:
        widths, multiple, what = (model.head_dim,), 16, str(model.head_dim)
    if max(widths) > (CUDNN_HOPPER_MAX_HEAD_DIM if hopper else CUDNN_MAX_HEAD_DIM) or any(w % multiple for w in widths):
        return (f"cuDNN's fused attention trains heads in multiples of {multiple} up to {CUDNN_MAX_HEAD_DIM} wide "
                f"({CUDNN_HOPPER_MAX_HEAD_DIM} on Hopper with cuDNN 9.5 or later), not {what}")
    return None


def default_attention_kernel(engine: Engine, device_has_fused: bool, dtype: Dtype, flash_attention: bool,
                             model: ModelSpec, seq_len: int | None = None) -> AttentionKernel:
    """The kernel a plan runs unless pinned: cuDNN's fused attention where the device has one
    (``DeviceSpec.fused_attention_efficiency``: Hopper), or the model's attention is latent or has
    learned sinks (which Transformer Engine runs in no other fused kernel), and
    :func:`attention_kernel_refusal` allows it, which is what Transformer Engine picks on Hopper when
    Megatron-core leaves the backend to it
    (transformer_engine/pytorch/attention/dot_product_attention/utils.py, ``get_attention_backend``);
    FlashAttention otherwise."""
    # Latent attention and the sinks' softmax have no other fused kernel in Transformer Engine: cuDNN's
    # wherever it takes them.
    only_fused = engine == "megatron" and (model.latent_attention or model.attention_sinks)
    if (device_has_fused or only_fused) and attention_kernel_refusal(
            engine, "cudnn", dtype, flash_attention, model, seq_len, hopper=device_has_fused) is None:
        return "cudnn"
    return "flash"


FP8_DIM_MULTIPLE = 16
"""Transformer Engine runs a GEMM in FP8 only when the inner (last) dimension of its operands is a
multiple of 16 (transformer_engine/pytorch/utils.py, ``check_dim_for_fp8_exec``, which its linear
layers assert under ``fp8_autocast``)."""


def fp8_refusal(engine: Engine, dtype: Dtype, model: ModelSpec) -> str | None:
    """Why ``engine`` cannot train ``model`` with FP8 linear layers, or None. FP8 training is
    Transformer Engine's (its linear layers under ``fp8_autocast``), which Megatron-core turns on with
    ``--fp8-format`` (megatron/training/arguments.py) and dsauto's DeepSpeed plans do not use; it
    runs inside bf16 or fp16 training, and every linear layer's input width must be a multiple of
    :data:`FP8_DIM_MULTIPLE`."""
    if engine != "megatron":
        return ("FP8 training runs through Transformer Engine's linear layers, which only dsauto's Megatron-core "
                "plans use (--engine megatron)")
    if dtype == "fp32":
        return "FP8 training runs the linear layers in FP8 inside bf16 or fp16 training, not fp32"
    widths = {"hidden size": model.hidden_size, "attention width": model.num_attention_heads * model.head_dim,
              "MLP width": model.ffn_hidden_size if len(model.moe_layers()) < model.num_layers else 0,
              "expert width": model.expert_ffn_hidden_size if model.moe else 0}
    odd = [f"{name} {width}" for name, width in widths.items() if width % FP8_DIM_MULTIPLE]
    if odd:
        return (f"Transformer Engine's FP8 GEMMs need widths that are multiples of {FP8_DIM_MULTIPLE}, and "
                f"{model.name} has {', '.join(odd)}")
    return None


def tp_comm_overlap_refusal(engine: Engine) -> str | None:
    """Why ``--tp-comm-overlap`` cannot be asked of ``engine``, or None. It is Megatron-core's
    (Transformer Engine's userbuffers: megatron/core/model_parallel_config.py, ``tp_comm_overlap``),
    and takes effect where tp > 1 with sequence parallelism, which Megatron-LM's validate_args
    requires of it (it turns both off at tp 1)."""
    if engine != "megatron":
        return "the tensor-parallel overlap is Megatron-core's (Transformer Engine's userbuffers); plan with --engine megatron"
    return None


def cp_comm_type_refusal(engine: Engine, cp_comm_type: CpCommType, cp: int, tp: int, model: ModelSpec,
                         seq_len: int | None = None) -> str | None:
    """Why context parallelism of degree ``cp`` cannot exchange a sequence's shards the
    ``cp_comm_type`` way (``--cp-comm-type``), or None; under Megatron-core nothing to refuse at cp 1.

    The three ways are Transformer Engine's (transformer_engine/pytorch/attention/
    dot_product_attention/context_parallel.py, ``attn_forward_func_with_cp``), which Megatron-core
    runs (``TransformerConfig.cp_comm_type``): its ring (``p2p``) does not run sliding-window
    attention (only ``a2a`` and ``all_gather`` do), and ``a2a`` splits the query heads and the
    key/value heads of each tensor-parallel rank over cp (``AttnFuncWithCPAndQKVOA2A`` asserts
    ``num_heads % cp_size == 0`` for Q, K and V); a softmax with learned sinks it runs with ``a2a``
    alone (TE's tests/pytorch/attention/test_attention_with_cp.py skips the others: "CP implementation
    only supports cp_comm_type=a2a for non-vanilla softmax types"). Under DeepSpeed cp is
    DeepSpeed-Ulysses, which has no such choice (refused whatever cp is)."""
    if engine != "megatron":
        return (f"--cp-comm-type {cp_comm_type} is Megatron-core's context parallelism (Transformer Engine's), "
                f"and under DeepSpeed cp is DeepSpeed-Ulysses")
    if cp == 1:
        return None
    if model.attention_chunk:
        return (f"chunked attention ({model.attention_chunk}-token chunks: Llama 4) is not Transformer "
                f"Engine's, and dsauto does not plan it with context parallelism")
    if model.attention_sinks and cp_comm_type != "a2a":
        return (f"Transformer Engine's context parallelism runs the sinks' learnable softmax (gpt-oss) only with "
                f"cp_comm_type a2a, not {cp_comm_type}")
    if cp_comm_type == "p2p" and model.window_slides(seq_len):
        return (f"Transformer Engine's ring (cp_comm_type p2p) does not run sliding-window attention "
                f"({model.sliding_window} tokens)")
    if cp_comm_type == "a2a":
        for name, count in (("attention heads", model.num_attention_heads), ("key/value heads", model.kv_heads)):
            if count % (tp * cp):
                return (f"cp_comm_type a2a splits the {count} {name} over tp x cp = {tp} x {cp}, which does "
                        f"not divide them")
    return None


def expert_a2a_overlap_refusal(engine: Engine, moe: bool, dtype: Dtype, checkpoint: bool | None,
                               recompute_modules: Iterable[str] = ()) -> str | None:
    """Why ``--moe-a2a-overlap`` (Megatron-core's ``--overlap-moe-expert-parallel-comm``) cannot be
    asked, or None. Megatron-core's TransformerConfig asserts (megatron/core/transformer/
    transformer_config.py, ``__post_init__``): expert parallelism, bf16 or fp16, no full
    recomputation; a strategy also needs ep > 1 and, when pp > 1, the interleaved schedule
    (:func:`dsauto.search.space.strategies` keeps only those). The combined 1F1B schedule calls an MoE
    layer's router, dispatch, experts and combine one by one (megatron/core/models/gpt/
    fine_grained_callables.py), never the ``MoELayer.forward`` that ``moe`` recomputation
    checkpoints, so that recomputation would not run."""
    if not moe:
        return "the expert all-to-alls' overlap is for a mixture of experts, and the model has no experts"
    if engine != "megatron":
        return "the expert all-to-alls' overlap is Megatron-core's combined 1F1B schedule; plan with --engine megatron"
    if dtype == "fp32":
        return "Megatron-core overlaps the expert all-to-alls of bf16 or fp16 models only, not fp32"
    if checkpoint:
        return "Megatron-core refuses full recomputation (--checkpoint) beside the expert all-to-alls' overlap"
    if "moe" in recompute_modules:
        return ("Megatron-core's overlapped schedule runs an MoE layer's parts one by one and never recomputes "
                "it whole ('moe' in --recompute-modules)")
    return None


def expert_dispatcher_refusal(engine: Engine, moe: bool) -> str | None:
    """Why DeepEP's dispatch cannot run, or None: it is Megatron-core's flex token dispatcher
    (``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep``), for the MoE layers of
    a mixture of experts; DeepSpeed-MoE has its own all-to-all."""
    if not moe:
        return "DeepEP dispatches the tokens of a mixture of experts, and the model has no experts"
    if engine != "megatron":
        return "DeepEP is Megatron-core's flex token dispatcher; plan with --engine megatron"
    return None


def force_load_balancing_refusal(engine: Engine, moe: bool) -> str | None:
    """Why routing cannot be forced to balance, or None: Megatron-core's
    ``--moe-router-force-load-balancing`` (TransformerConfig.moe_router_force_load_balancing; its
    router then spreads the tokens evenly over the experts: megatron/core/transformer/moe/router.py),
    for the routers of a mixture of experts; DeepSpeed-MoE has no such option."""
    if not moe:
        return "forcing the routing to balance applies to a mixture of experts, and the model has no experts"
    if engine != "megatron":
        return "forced load balancing is Megatron-core's router option; plan with --engine megatron"
    return None


def expert_capacity_refusal(engine: Engine, moe: bool) -> str | None:
    """Why experts cannot drop tokens beyond a capacity as dsauto prices it, or None: Megatron-core's
    ``--moe-expert-capacity-factor`` (its router's ``apply_router_token_dropping``; TransformerConfig
    refuses ``--moe-pad-expert-input-to-capacity`` under the flex dispatcher's DeepEP backend, which
    the pins' check says); DeepSpeed-MoE's own capacity is its gate's, not this option."""
    if not moe:
        return "an expert capacity applies to a mixture of experts, and the model has no experts"
    if engine != "megatron":
        return "the expert capacity factor is Megatron-core's router option; plan with --engine megatron"
    return None


def precision_aware_refusal(engine: Engine, dtype: Dtype, zero_stage: int | None, offload: str | None) -> str | None:
    """Why Megatron-core's precision-aware optimizer (``--use-precision-aware-optimizer`` with the
    moments' dtype) cannot run as dsauto prices it, or None. Megatron-core builds it only with the
    distributed optimizer (megatron/core/optimizer/__init__.py: "--use-precision-aware-optimizer only
    supported with distributed optimizer"), which is ZeRO 1 in dsauto's Megatron plans (Megatron-FSDP
    keeps its own main weights: ``megatron_fsdp_main_params_dtype``); dsauto prices it under bf16 with
    the optimizer on the device. ``zero_stage`` and ``offload``: the pins, None when searched."""
    if engine != "megatron":
        return "the precision-aware optimizer is Megatron-core's (Transformer Engine's FusedAdam); plan with --engine megatron"
    if dtype != "bf16":
        return f"dsauto prices the precision-aware optimizer under bf16, not {dtype}"
    if zero_stage is not None and zero_stage != 1:
        return (f"Megatron-core runs it inside its distributed optimizer, ZeRO stage 1, not stage {zero_stage}")
    if offload not in (None, "none"):
        return "dsauto prices its states on the device; with --offload optimizer Megatron-core keeps them on the host"
    return None


def softmax_16_bit_refusal(engine: Engine, dtype: Dtype, flash_attention: bool, seq_len: int) -> str | None:
    """Why a 16-bit softmax in unfused attention (TransformerConfig's ``attention_softmax_in_fp32``
    False) is no choice, or None: Megatron-core's own attention only, in 16-bit training, only without
    fused attention (which keeps no score matrix), and only where Transformer Engine's layers, which
    Megatron-LM launches by default, run it: their fused masked softmax, for the keys it takes
    (:data:`dsauto.engines.megatron.TE_FUSED_SOFTMAX_KEYS`; else they run torch's in fp32). The
    attention batches' condition is the search's (:func:`dsauto.search.space.strategies`)."""
    if engine != "megatron":
        return "the softmax of unfused attention is Megatron-core's setting; plan with --engine megatron"
    if dtype == "fp32":
        return "in fp32 the softmax is fp32 anyway"
    if flash_attention:
        return "fused attention keeps no score matrix; it applies with --no-flash-attention"
    if not te_softmax_fuses(seq_len, 1, 4):  # the keys alone; the batches are the search's
        low, high, multiple = TE_FUSED_SOFTMAX_KEYS
        return (f"Transformer Engine's layers run it through their fused masked softmax, which takes {low} < s < "
                f"{high} keys, a multiple of {multiple}, not {seq_len} (they run torch's in fp32 otherwise)")
    return None


def grad_reduce_refusal(engine: Engine, dtype: Dtype) -> str | None:
    """Why gradients cannot be kept and reduced in bf16 (Megatron-LM's ``--grad-reduce-in-bf16``,
    DistributedDataParallelConfig.grad_reduce_in_fp32 False), or None: Megatron-core only, and only
    under bf16 (fp16 gradients are 16-bit already, fp32 ones stay fp32)."""
    if engine != "megatron":
        return "bf16 gradient buffers are Megatron-core's; plan with --engine megatron"
    if dtype != "bf16":
        return f"bf16 gradients apply to bf16 training, not {dtype}"
    return None


def dp_overlap_refusal(engine: Engine, zero_stage: int | None) -> str | None:
    """Why the data-parallel reduction and gather cannot run unoverlapped (Megatron-LM's launch without
    ``--overlap-grad-reduce`` or ``--overlap-param-gather``), or None: Megatron-core's own data
    parallelism only (ZeRO 0-1, ``zero_stage`` None: any of them); dsauto prices Megatron-FSDP with
    its overlap, as its plans run it."""
    if engine != "megatron":
        return "--overlap-grad-reduce and --overlap-param-gather are Megatron-core's; plan with --engine megatron"
    if zero_stage is not None and zero_stage >= 2:
        return (f"dsauto prices Megatron-FSDP (ZeRO {zero_stage} on Megatron-core) only with its gathers and "
                f"reductions overlapped")
    return None


HF_UNRECOMPUTED = ("core_attn",)
"""Selective recomputations dsauto's hook cannot apply to a ``transformers`` decoder layer, whose
``self_attn`` holds the projections beside the attention core (dsauto.runtime.recompute)."""


def hf_trainer_refusal(engine: Engine = "deepspeed", pp: int = 1, cp: int = 1, ep: int = 1,
                       recompute_modules: Iterable[str] = (), split: int = 1) -> str | None:
    """Why a ``transformers`` model that Hugging Face's Trainer or accelerate hands to DeepSpeed cannot
    run these settings (the rest of a sentence), or None. They build DeepSpeed's engine (accelerate's
    ``Accelerator._prepare_deepspeed``), never its pipeline engine; the model has no
    ``DistributedAttention`` for DeepSpeed-Ulysses, no ``deepspeed.moe.layer.MoE`` layers to split
    experts over, and no attention core apart from its projections (:data:`HF_UNRECOMPUTED`); and
    dsauto's hook splits none of its operators (``split``): the loss is computed inside the model's
    forward, where no chunking reaches it, and under ZeRO-3 the model is built inside
    ``deepspeed.zero.Init``, partitioned before any split (dsauto.runtime.deepspeed, ``prepare_model``)."""
    if engine != "deepspeed":
        return "Hugging Face's Trainer and accelerate run DeepSpeed"
    if pp > 1:
        return "Hugging Face's Trainer and accelerate build no DeepSpeed pipeline"
    if cp > 1:
        return "a transformers decoder layer has no DistributedAttention for DeepSpeed-Ulysses to split its sequence"
    if ep > 1:
        return "a transformers model has no deepspeed.moe.layer.MoE layers to split its experts over ranks"
    if unrunnable := [m for m in recompute_modules if m in HF_UNRECOMPUTED]:
        return (f"a transformers decoder layer has no attention core apart from its projections to recompute "
                f"({', '.join(unrunnable)})")
    if split > 1:
        return "dsauto's hook splits no operator of a model they build"
    return None
