"""A dsauto plan applied inside a Megatron-core training script.

Megatron-core takes its parallel layout from three objects a training script already builds: the
process groups (``parallel_state.initialize_model_parallel``), the model's ``TransformerConfig`` and
the ``DistributedDataParallelConfig`` (with its ``OptimizerConfig``). This module fills each of them
from the plan:

=====================================  ==========================================================
plan                                    Megatron-core (0.16)
=====================================  ==========================================================
dp, tp, pp                              ``initialize_model_parallel``; ``tensor_/pipeline_model_
                                        parallel_size``
sequence_parallel                       ``sequence_parallel``
stage_layers                            even split, ``num_layers_in_first/last_pipeline_stage``,
                                        or ``pipeline_model_parallel_layout``
virtual_stages                          ``virtual_pipeline_model_parallel_size`` (process groups
                                        and config), the layout over every model chunk; one model
                                        chunk per virtual stage (:func:`model_chunks`)
per-layer checkpoint                    ``recompute_granularity="full"``, ``recompute_method=
                                        "block"``, ``recompute_num_layers``
per-layer recompute modules            ``recompute_granularity="selective"``,
                                        ``recompute_modules``
flash attention on unfused attention    ``recompute_granularity="selective"`` of ``core_attn``
dtype                                   ``params_dtype``, ``bf16`` / ``fp16``, ``pipeline_dtype``
zero_stage 1                            distributed optimizer
dist_opt_instances                      ``num_distributed_optimizer_instances`` (process groups and
                                        DDP config): the partial distributed optimizer
zero_stage 2 / 3                        Megatron-FSDP ``optim_grads`` / ``optim_grads_params``
reduce_bucket_bytes, prefetch           ``bucket_size``, ``suggested_communication_unit_size``
micro_batch, grad_accum, seq_len        the schedule's ``micro_batch_size``, ``num_microbatches``,
                                        ``seq_length`` (read from the plan by the training loop)
=====================================  ==========================================================

What Megatron-core cannot say (checkpointed sets other than the first N layers of every stage,
checkpointing of the embedding or head, operator splitting, ZeRO-3 residency per layer group, a
recompute granularity per layer) is reported as one warning each, naming the layers, and the
nearest safe setting is applied: never silently dropped. Megatron-core is imported lazily, so
``import dsauto`` stays light.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dsauto.describe import layer_span, layers_text, runs_text

# Megatron's rules shared with megatron_args.txt: the flags and this plugin read the plan the same way.
from dsauto.engines.architecture import add_bias_linear, megatron_gaps, no_rope_freq
from dsauto.engines.megatron import (
    FSDP_STRATEGY,
    block_recompute_layers,
    ddp_bucket_size,
    degree_fields,
    max_connections,
    pipeline_layout,
    qk_layernorm,
    selective_recompute_modules,
    te_softmax_fuses,
)
from dsauto.errors import DsautoError
from dsauto.plan import Plan
from dsauto.plan_io import read_plan
from dsauto.spec.model import ModelSpec, attention_widths
from dsauto.units import counted, format_bytes

if TYPE_CHECKING:
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)

M = TypeVar("M")
"""A model chunk, as the script's builder returns it (a GPTModel, or any module)."""


def load_plan(path: Path | str) -> Plan:
    """The plan in ``path``: a ``plan.yaml``, or a ``ds_config.json`` with its ``"dsauto"`` block."""
    return read_plan(path)


def require_megatron_plan(plan: Plan) -> None:
    """Refuses a plan made for another engine: its memory and overlap were priced for that engine."""
    if plan.engine != "megatron":
        raise DsautoError(
            f"This plan was made for {plan.engine} (priced with its memory and overlap, e.g. "
            f"DeepSpeed's ZeRO buffers, not Megatron-core's fp32 gradient buffer); re-plan with "
            f"--engine megatron, or train it with dsauto.deepspeed."
        )


def initialize_model_parallel(plan: Plan, **kwargs: Any) -> None:
    """Creates Megatron-core's process groups for the plan's tp x pp x dp layout.

    ``torch.distributed`` must be initialised with exactly ``plan.world_size`` ranks. ``kwargs`` go
    to ``megatron.core.parallel_state.initialize_model_parallel`` (e.g. ``order``,
    ``distributed_timeout_minutes``); the parallel sizes come from the plan, the virtual pipeline
    size too when the plan interleaves (the script then builds one model chunk per virtual stage,
    as Megatron-core's training loop does: ``parallel_state.set_virtual_pipeline_model_parallel_rank``
    and ``vp_stage``).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    require_megatron_plan(plan)
    if not dist.is_available() or not dist.is_initialized():
        raise DsautoError("torch.distributed is not initialised; call torch.distributed."
                          "init_process_group() (torchrun sets its environment) before "
                          "initialize_model_parallel(plan).")
    world = dist.get_world_size()
    if world != plan.world_size:
        raise DsautoError(
            f"The plan is for {plan.world_size} ranks ({plan.dims.describe()}) but torch.distributed has "
            f"{world}; launch {plan.world_size} processes or re-plan for {counted(world, 'device')}."
        )
    degrees = degree_fields(plan.dims, experts=plan.model.moe)
    for name in (*degrees, "virtual_pipeline_model_parallel_size", "num_distributed_optimizer_instances"):
        if name in kwargs:
            raise DsautoError(f"initialize_model_parallel(plan) takes {name} from the plan; drop the "
                              f"{name}={kwargs[name]!r} argument.")
    if plan.virtual_stages > 1:
        kwargs["virtual_pipeline_model_parallel_size"] = plan.virtual_stages
    if plan.dist_opt_instances > 1:
        # The partial distributed optimizer's groups: an instance's ranks and one shard across instances.
        kwargs["num_distributed_optimizer_instances"] = plan.dist_opt_instances
    parallel_state.initialize_model_parallel(**degrees, **kwargs)
    dp = parallel_state.get_data_parallel_world_size()
    if dp != plan.dp:  # only possible with context or expert parallelism passed in kwargs
        raise DsautoError(f"Megatron-core formed data-parallel groups of {dp} ranks but the plan has "
                          f"dp {plan.dp}; drop the context/expert parallel arguments.")


def model_chunks(plan: Plan, build: Callable[..., M]) -> list[M]:
    """This pipeline rank's model chunks: one per virtual stage when the plan interleaves, else one.

    ``build(pre_process=..., post_process=..., vp_stage=...)`` builds one chunk, e.g. a ``GPTModel``
    from the config of :func:`apply`, passing the three arguments on. As in Megatron-LM's ``get_model``
    (megatron/training/training.py), chunk ``i`` of pipeline rank ``r`` is the model's chunk
    ``i * pp + r``: it has the embedding (``pre_process``) only when it is the first chunk of the
    first rank and the head (``post_process``) only when it is the last chunk of the last rank;
    ``vp_stage`` (None without interleaving) picks its layers from the pipeline layout
    (transformer_block.get_num_layers_to_build, transformer_layer.get_transformer_layer_offset).
    Give the list to ``get_forward_backward_func()(model=...)`` with one data iterator per chunk;
    the interleaved schedule runs when :func:`initialize_model_parallel` set the virtual size. A
    model with multi-token-prediction layers also passes GPTModel ``mtp_block_spec=
    get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine, vp_stage=vp_stage)``, which
    is None except on the chunk that builds them (GPTModel builds them wherever it is given a spec).

    Needs the process groups of :func:`initialize_model_parallel`. Refuses chunks whose transformer
    layers (``decoder.layers``, Megatron's 1-based ``layer_number``) are not those the plan places
    on them: the config was then not made by :func:`apply`.
    """
    from megatron.core import parallel_state

    require_megatron_plan(plan)
    virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if (not parallel_state.model_parallel_is_initialized() or virtual != plan.virtual_stages
            or parallel_state.get_pipeline_model_parallel_world_size() != plan.pp):
        raise DsautoError(f"The plan has pp {plan.pp} with {plan.virtual_stages} model chunk(s) per pipeline "
                          f"rank, and Megatron-core's process groups are not set up for it; call "
                          f"dm.initialize_model_parallel(plan) before building the model.")
    rank, ranges, chunks = parallel_state.get_pipeline_model_parallel_rank(), plan.stage_ranges(), []
    for i in range(plan.virtual_stages):
        vp_stage = i if plan.virtual_stages > 1 else None
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunk = build(pre_process=first, post_process=last, vp_stage=vp_stage)
        layers = getattr(getattr(chunk, "decoder", None), "layers", None)
        planned = list(ranges[i * plan.pp + rank])
        if layers is not None and [layer.layer_number for layer in layers] != planned:
            built = [layer.layer_number for layer in layers]
            raise DsautoError(f"Model chunk {i} of pipeline rank {rank} built "
                              f"{layers_text(built) if built else 'no transformer layers'} but the plan "
                              f"places {layers_text(planned) if planned else 'none'} there; build it from the "
                              f"TransformerConfig returned by dm.apply(plan, config).")
        if plan.model.mtp_layers and hasattr(chunk, "decoder") and last and getattr(chunk, "mtp", None) is None:
            raise DsautoError(f"The plan trains {plan.model.mtp_layers} multi-token-prediction layer(s) on the last "
                              f"model chunk, and the chunk built has none; pass GPTModel mtp_block_spec="
                              f"dm.mtp_block_spec(config, layer_spec, vp_stage).")
        chunks.append(chunk)
    return chunks


def apply(plan: Plan, config: TransformerConfig) -> TransformerConfig:
    """``config`` with the plan's parallel layout, recomputation and precision.

    The model shape in ``config`` must be the plan's model (layers, width, heads, MLP width, key/value
    heads); everything else in it is kept. Sets the tensor / pipeline sizes, sequence parallelism,
    the pipeline layout (:func:`pipeline_layout_fields`), activation recomputation
    (:func:`recompute_fields`) and the dtype, and warns about what Megatron-core cannot express.
    A pure function: it needs no process group.
    """
    require_megatron_plan(plan)
    _check_model(plan.model, config)
    dtype = _torch_dtype(plan)
    fields: dict[str, Any] = dict(
        **degree_fields(plan.dims, experts=plan.model.moe),
        # Megatron refuses sequence parallelism without tensor parallelism (model_parallel_config.py).
        sequence_parallel=plan.sequence_parallel and plan.tp > 1,
        params_dtype=dtype,
        bf16=plan.dtype == "bf16",
        fp16=plan.dtype == "fp16",
        # Dtype of the activations sent between stages; Megatron requires it when pp > 1.
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
    )
    vpp = plan.virtual_stages if plan.virtual_stages > 1 else None
    if config.virtual_pipeline_model_parallel_size != vpp:
        if config.virtual_pipeline_model_parallel_size is not None:
            _report(f"The plan was made for {plan.virtual_stages} model chunk(s) per pipeline rank, so dsauto "
                    f"replaces the config's virtual_pipeline_model_parallel_size="
                    f"{config.virtual_pipeline_model_parallel_size}.")
        fields["virtual_pipeline_model_parallel_size"] = vpp
    if vpp is not None:
        # Megatron-LM's default for the interleaved schedule (--overlap-p2p-communication, and
        # batch_p2p_comm = not overlap_p2p_comm: megatron/training/arguments.py). Megatron-core's own
        # default, one batch of sends and receives, mixes up activations and gradients when pp is 2:
        # both neighbours are the same rank and its two messages are matched in posting order
        # (NVIDIA/Megatron-LM#750, #1450); separate sends use two process groups (p2p_communication.py,
        # _p2p_ops).
        fields.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    elif config.overlap_p2p_comm:
        # The non-interleaved schedules refuse overlapped sends (schedules.py); Megatron-LM turns it off.
        fields.update(overlap_p2p_comm=False, batch_p2p_comm=True)
    # Fields TransformerConfig.__post_init__ derives from the sizes when left unset; replace() would
    # otherwise keep the values derived from the old sizes.
    if config.expert_tensor_parallel_size == config.tensor_model_parallel_size:
        fields["expert_tensor_parallel_size"] = plan.tp
    if config.microbatch_group_size_per_vp_stage == config.pipeline_model_parallel_size:
        fields["microbatch_group_size_per_vp_stage"] = plan.pp
    fields.update(pipeline_layout_fields(plan.stage_layers, plan.virtual_stages, plan.model.mtp_layers,
                                         plan.chunk_layout))
    fields.update(recompute_fields(plan, config))
    if plan.tp_comm_overlap:
        fields["tp_comm_overlap"] = True  # Transformer Engine's userbuffers (its layers only)
    elif config.tp_comm_overlap and fields["sequence_parallel"]:
        _report("The config overlaps the tensor-parallel collectives (tp_comm_overlap) and the plan was "
                "priced without it; dsauto keeps it on, so the step may be faster than predicted "
                "(re-plan with --tp-comm-overlap to price it).")
    if plan.expert_dispatcher == "deepep":
        fields.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    elif plan.model.moe and config.moe_token_dispatcher_type == "flex":
        _report("The config dispatches the experts' tokens with the flex dispatcher and the plan was priced "
                "with alltoall's; dsauto keeps the config's (re-plan with --moe-dispatcher deepep to price "
                "DeepEP's).")
    if plan.expert_load_balanced:
        fields["moe_router_force_load_balancing"] = True
    elif plan.model.moe and config.moe_router_force_load_balancing:
        _report("The config forces the routing to balance (moe_router_force_load_balancing) and the plan was "
                "priced with the router's own balance; dsauto keeps it on, so the step may be faster than "
                "predicted (re-plan with --moe-router-force-load-balancing to price it).")
    if plan.expert_capacity_factor is not None:
        fields.update(moe_expert_capacity_factor=plan.expert_capacity_factor,
                      moe_pad_expert_input_to_capacity=plan.expert_pad_to_capacity)
    elif plan.model.moe and config.moe_expert_capacity_factor is not None:
        _report(f"The config drops tokens beyond {config.moe_expert_capacity_factor:g}x an expert's mean share "
                f"(moe_expert_capacity_factor) and the plan was priced dropless; dsauto keeps it, so the experts' "
                f"load may differ from the prediction (re-plan with --moe-expert-capacity-factor to price it).")
    if plan.cp > 1:
        # Transformer Engine's context parallelism (its attention only); None is its ring, p2p.
        if config.cp_comm_type not in (None, plan.cp_comm_type):
            _report(f"The plan was priced with cp_comm_type {plan.cp_comm_type}, so dsauto replaces the config's "
                    f"{config.cp_comm_type!r}.")
        fields["cp_comm_type"] = plan.cp_comm_type
    # the modules the applied config recomputes selectively
    selective = set(fields.get("recompute_modules") or ()) if fields.get("recompute_granularity") == "selective" else set()
    if plan.expert_a2a_overlap:
        fields["overlap_moe_expert_parallel_comm"] = True  # the combined 1F1B schedule
    elif config.overlap_moe_expert_parallel_comm and "moe" in selective:
        # its schedule calls the MoE layer's parts one by one and would skip the planned recomputation
        fields["overlap_moe_expert_parallel_comm"] = False
        _report("The config overlaps the expert all-to-alls (overlap_moe_expert_parallel_comm), whose schedule never "
                "recomputes an MoE layer whole, and the plan recomputes it ('moe'); dsauto turns the overlap off.")
    elif config.overlap_moe_expert_parallel_comm:
        _report("The config overlaps the expert all-to-alls (overlap_moe_expert_parallel_comm) and the plan was "
                "priced without it; dsauto keeps it on, so the step may be faster than predicted (re-plan with "
                "--moe-a2a-overlap to price it).")
    if config.moe_shared_expert_overlap and (why := (
            "the plan recomputes the shared experts" if "shared_experts" in selective
            else "the plan dispatches with DeepEP" if plan.expert_dispatcher == "deepep"
            else "the plan overlaps the expert all-to-alls" if plan.expert_a2a_overlap else None)):
        fields["moe_shared_expert_overlap"] = False  # Megatron-core's TransformerConfig refuses each beside it
        _report(f"The config overlaps the shared experts with the dispatch (moe_shared_expert_overlap) and {why}, "
                f"which Megatron-core refuses beside it; dsauto turns that overlap off (it was priced without it).")
    if plan.fp8:
        # Transformer Engine's linear layers (its layers only); FP8 weights with --fp8-param-gather
        fields.update(fp8="hybrid", fp8_recipe=plan.fp8_recipe, fp8_param=plan.fp8_param_gather)
    elif config.fp8:
        _report(f"The config trains in FP8 (fp8={config.fp8!r}) and the plan was priced in {plan.dtype}; dsauto "
                f"keeps it, so the step may be faster and its memory other than predicted (re-plan with --fp8 "
                f"to price it).")
    if not plan.flash_attention and plan.dtype != "fp32":
        # The unfused softmax in the precision the plan's memory was priced with.
        fields["attention_softmax_in_fp32"] = plan.attention_softmax_in_fp32
        _report_te_softmax(plan, config)
        if not plan.attention_softmax_in_fp32 and config.apply_query_key_layer_scaling:
            _report("The config scales the query-key product by layer (apply_query_key_layer_scaling), which makes "
                    "Megatron-core run the softmax in fp32, and the plan was priced with a 16-bit softmax; the "
                    "memory may be higher than predicted (turn the scaling off, or re-plan without "
                    "--no-attention-softmax-in-fp32).")
        if plan.attention_softmax_in_fp32 and config.masked_softmax_fusion:
            _report("The config fuses the masked softmax (masked_softmax_fusion), whose kernel keeps 16 bits where "
                    "the shapes allow it, and the plan was priced with the fp32 softmax's copy of the scores; dsauto "
                    "keeps the fusion, so the memory may be lower than predicted (re-plan with "
                    "--no-attention-softmax-in-fp32 to price it).")
    _report_kernel(plan, config)
    _report_unfused_swiglu(plan, config)
    _report_max_connections(plan)
    _report_unsplit(plan)
    for gap in megatron_gaps(plan.model):  # the model's own details Megatron-core cannot build
        _report(f"Megatron-core does not build {gap}.")
    window = plan.model.sliding_window
    if window and not plan.model.window_slides(plan.seq_len) and \
            tuple(getattr(config, "window_size", None) or ()) == (window - 1, 0):
        # the model's window, at least as long as the plan's sequences, attends to all of them: full
        # attention, as priced and as megatron_args.txt launches it (Transformer Engine's ring
        # refuses any window)
        fields.update(window_size=None, window_attn_skip_freq=None)
    applied = dataclasses.replace(config, **fields)
    logger.info("dsauto: applied the plan to the TransformerConfig: tp %d, pp %d, sequence parallel "
                "%s, stages %s, recompute %s/%s/%s, %s", plan.tp, plan.pp, fields["sequence_parallel"],
                list(plan.stage_layers), applied.recompute_granularity, applied.recompute_method,
                applied.recompute_num_layers, plan.dtype)
    return applied


def pipeline_layout_fields(stage_layers: Iterable[int], virtual_stages: int = 1, mtp_layers: int = 0,
                           chunks: Sequence[int] | None = None) -> dict[str, Any]:
    """TransformerConfig fields that place ``stage_layers`` transformer layers on each stage (and
    ``mtp_layers`` multi-token-prediction layers on the last; ``chunks`` layers on each model chunk where
    the plan gives them): first and last stage counts or a layout string, by the rule
    ``megatron_args.txt`` uses too (:func:`dsauto.engines.megatron.pipeline_layout`)."""
    layout = pipeline_layout(list(stage_layers), virtual_stages, mtp_layers, chunks)
    return dict(num_layers_in_first_pipeline_stage=layout.first_stage_layers,
                num_layers_in_last_pipeline_stage=layout.last_stage_layers,
                pipeline_model_parallel_layout=layout.layout,
                account_for_embedding_in_pipeline_split=False,
                account_for_loss_in_pipeline_split=False)


def recompute_fields(plan: Plan, config: TransformerConfig) -> dict[str, Any]:
    """TransformerConfig recompute fields for the plan's per-layer checkpointing
    (:func:`_recompute_fields`). The deprecated ``moe_layer_recompute``, which the config's
    ``__post_init__`` turns into 'moe' added to the selective modules (and refuses beside full
    recomputation), is turned off: the plan says what is recomputed."""
    fields = _recompute_fields(plan, config)
    if not config.moe_layer_recompute:
        return fields
    fields["moe_layer_recompute"] = False
    planned = {m for run in plan.layers for m in run.recompute_modules}
    if "moe" in (fields.get("recompute_modules") or []) and "moe" not in planned:
        fields["recompute_modules"] = [m for m in fields["recompute_modules"] if m != "moe"]
    _report("The config sets moe_layer_recompute (Megatron-LM's --moe-layer-recompute); dsauto turns it off and "
            "recomputes as the plan was priced.")
    return fields


def _recompute_fields(plan: Plan, config: TransformerConfig) -> dict[str, Any]:
    """TransformerConfig recompute fields for the plan's per-layer checkpointing.

    Megatron-core has one recompute setting for all transformer layers:

    - ``full`` / ``block`` / N checkpoints the first N layers of every TransformerBlock, that is of
      every pipeline stage, or of every model chunk when the plan interleaves
      (transformer/transformer_block.py, _checkpointed_forward). A plan whose checkpointed layers
      are of that form is applied exactly. Any other set is widened to the smallest N that covers
      it, which checkpoints more layers than planned (more recomputation, never more memory), and
      the extra layers are reported.
    - A plan that recomputes modules selectively in every layer (:func:`dsauto.engines.megatron.
      selective_recompute_modules`) sets ``selective`` with those ``recompute_modules``; other
      selective plans get the nearest setting that uses no more memory, reported.
    - ``selective`` recomputes parts of every layer; its ``core_attn`` part drops the s x s attention
      scores (Korthikanti et al. 2022, Sec. 5). A plan made for flash attention counts no scores, but
      Megatron-core's own DotProductAttention (``attention_backend`` ``local``) and Transformer
      Engine's ``unfused`` backend keep them; when the plan checkpoints no layer, the scores are
      recomputed instead, which is what the plan's memory assumed. With full recomputation of some
      layers the others keep their scores, since the granularity is one for all layers: reported.
    """
    from megatron.core.transformer.enums import AttnBackend

    keeps_scores = config.attention_backend in (AttnBackend.local, AttnBackend.unfused)
    checkpointed = plan.checkpointed_layers()
    fields: dict[str, Any] = dict(recompute_granularity=None, recompute_method=None,
                                  recompute_num_layers=None)
    ends = [run for run in plan.layers if run.checkpoint and run.group in ("embedding", "head")]
    if ends:
        _report(f"Megatron-core recomputes transformer layers only, so the plan's checkpointing of the "
                f"{runs_text(ends)} ({' and '.join(dict.fromkeys(r.group for r in ends))}) is not "
                f"applied and they keep their activations.")
    selective = _selective_fields(plan, config, keeps_scores)
    if selective is not None:
        fields.update(selective)
        return fields
    if plan.selective_layers():
        # Selective layers mixed with whole-layer checkpointing, which Megatron-core cannot run
        # together: they are checkpointed whole too (more recomputation, no more memory).
        partial = sorted(i for layers in plan.selective_layers().values() for i in layers)
        _report(f"Megatron-core has one recompute granularity, and the plan checkpoints "
                f"{layers_text(checkpointed)} whole and recomputes modules of {layers_text(partial)}; dsauto "
                f"checkpoints those whole too (more recomputation than planned, no more memory).")
        checkpointed = tuple(sorted({*checkpointed, *partial}))
    if checkpointed:
        n = block_recompute_layers(plan) if len(checkpointed) == len(plan.checkpointed_layers()) else None
        if n is None:
            n = _covering_block(plan, checkpointed)
            covered = {layer for layers in plan.stage_ranges() for layer in list(layers)[:n]}
            blocks = (f"model chunks of {plan.chunks()} layers"
                      if plan.virtual_stages > 1 else f"stages {list(plan.stage_layers)}")
            _report(f"Megatron-core checkpoints the first N transformer layers of every "
                    f"{'model chunk' if plan.virtual_stages > 1 else 'pipeline stage'}, and the plan "
                    f"checkpoints {layers_text(checkpointed)} of {blocks}; dsauto sets "
                    f"recompute_num_layers={n}, which also "
                    f"checkpoints {layers_text(covered - set(checkpointed))} (more recomputation than "
                    f"planned, no more memory).")
        fields.update(recompute_granularity="full", recompute_method="block", recompute_num_layers=n)
        kept = plan.model.num_layers - len(checkpointed)
        if plan.flash_attention and keeps_scores and kept:
            _report(f"attention_backend {config.attention_backend.name} keeps the attention scores that "
                    f"the plan, made for flash attention, does not count, and Megatron-core cannot add "
                    f"selective recomputation to full recomputation, so the {kept} transformer layers "
                    f"not checkpointed keep them; use a fused attention backend.")
        if config.recompute_granularity == "selective":
            _report("The plan checkpoints whole layers, so dsauto replaces the config's selective "
                    "recomputation with full recomputation (Megatron-core has one granularity).")
    elif plan.flash_attention and keeps_scores:
        modules = list(dict.fromkeys([*(config.recompute_modules or []), "core_attn"]))
        fields.update(recompute_granularity="selective", recompute_modules=modules)
        _report(f"attention_backend {config.attention_backend.name} keeps the s x s attention scores "
                f"that the plan, made for flash attention, does not count; dsauto recomputes core "
                f"attention (selective recomputation) to keep memory as planned, at the cost of "
                f"recomputing it in the backward pass.")
    return fields


def ddp_config(plan: Plan, *, megatron_fsdp: bool = True, **overrides: Any) -> DistributedDataParallelConfig:
    """The DistributedDataParallelConfig of the plan's data parallelism.

    ZeRO-1 is Megatron's distributed optimizer (optimizer states sharded over data-parallel ranks).
    ZeRO-2 and 3 are Megatron-FSDP with the sharding strategy of the same reach: wrap the model in
    ``megatron.core.distributed.fsdp.mcore_fsdp_adapter.FullyShardedDataParallel`` when
    ``use_megatron_fsdp`` is set, as Megatron-LM does for ``--use-megatron-fsdp``. Megatron-FSDP
    needs CUDA (streams) and, in 0.16, Transformer Engine; with ``megatron_fsdp=False`` ZeRO-2 and 3
    fall back to the distributed optimizer, and the memory that then stays unsharded is reported.
    Gradient reduction overlaps the backward pass where the plan overlaps it (its cost model hides it
    there), which needs the training loop to set ``config.no_sync_func`` and ``config.finalize_model_grads_func`` as
    Megatron-LM's does. ``overrides`` replace any field.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    zero = plan.zero_stage
    fields: dict[str, Any] = dict(
        use_distributed_optimizer=zero >= 1,
        overlap_grad_reduce=plan.overlap_grad_reduce,
        overlap_param_gather=plan.gathers_params_overlapped,
        bucket_size=ddp_bucket_size(plan),  # counts parameters
        # Megatron-LM reduces in fp32 under bf16 (validate_args) unless --grad-reduce-in-bf16.
        grad_reduce_in_fp32=plan.dtype == "bf16" and plan.grad_reduce_in_fp32,
        # Partial distributed optimizer: needs the groups initialize_model_parallel(plan) creates.
        num_distributed_optimizer_instances=plan.dist_opt_instances,
        fp8_param_gather=plan.fp8_param_gather,  # FP8 weights gathered at one byte a parameter
    )
    if zero in FSDP_STRATEGY and megatron_fsdp:
        fields.update(use_megatron_fsdp=True, data_parallel_sharding_strategy=FSDP_STRATEGY[zero])
        if zero == 3:
            # ZeRO-3's prefetch bucket bounds the parameters gathered ahead; Megatron-FSDP's unit of
            # communication (elements) also sets how far it prefetches.
            param_bytes = 4 if plan.dtype == "fp32" else 2
            fields["suggested_communication_unit_size"] = max(1, plan.prefetch_bucket_bytes // param_bytes)
            resident = [run for run in plan.layers if not run.shard_params]
            if resident:
                _report(f"Megatron-FSDP's optim_grads_params shards the parameters of every layer, and "
                        f"the plan keeps those of {runs_text(resident)} resident on every data-parallel "
                        f"rank; they are sharded and gathered per use (less memory, more communication "
                        f"than planned).")
    elif zero in FSDP_STRATEGY:
        extra = max(stage.grads_bytes for stage in plan.stages) * (plan.dp - 1)
        _report(f"Without Megatron-FSDP the plan's ZeRO-{zero} runs as Megatron's distributed optimizer, "
                f"which shards optimizer states only: gradients{' and parameters' if zero == 3 else ''} "
                f"stay whole on every data-parallel rank, at least {format_bytes(extra)} more per rank "
                f"than planned.")
    fields.update(overrides)
    return DistributedDataParallelConfig(**fields)


def optimizer_config(plan: Plan, **overrides: Any) -> OptimizerConfig:
    """An OptimizerConfig consistent with :func:`ddp_config` and the plan's dtype; ``overrides``
    (``lr``, ``weight_decay``, ``clip_grad``, ...) are the script's own choices."""
    from megatron.core.optimizer import OptimizerConfig

    fields: dict[str, Any] = dict(
        use_distributed_optimizer=plan.zero_stage >= 1,
        overlap_param_gather=plan.gathers_params_overlapped,
        bf16=plan.dtype == "bf16",
        fp16=plan.dtype == "fp16",
        params_dtype=_torch_dtype(plan),
        # Under FP8 current scaling Megatron-core keeps the precision-aware optimizer's fp32 main weights
        # itself, as the plan's state is priced (OptimizerConfig.use_precision_aware_optimizer_no_fp8_or_ds_fp8).
        fp8_recipe=plan.fp8_recipe if plan.fp8 else None,
    )
    if plan.precision_aware_optimizer is not None:
        # Transformer Engine's FusedAdam with the plan's moments (emit.megatron writes the same flags).
        _require_transformer_engine(f"keeps Adam's moments in {plan.precision_aware_optimizer} through Megatron-core's "
                                    f"precision-aware optimizer", "without --precision-aware-optimizer")
        moments = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                   "fp8": torch.uint8}[plan.precision_aware_optimizer]
        fields.update(use_precision_aware_optimizer=True, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    if plan.offload != "none":
        # The plan's optimizer lives on the host (the same settings as emit.megatron's flags). The
        # precision-aware optimizer keeps no fp32 main parameters on the device.
        _require_transformer_engine("offloads the optimizer, which Megatron-core runs through its precision-aware "
                                    "optimizer", "with --offload none")
        fields.update(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                      overlap_cpu_optimizer_d2h_h2d=True, use_precision_aware_optimizer=True)
    fields.update(overrides)
    return OptimizerConfig(**fields)


def _require_transformer_engine(what: str, instead: str) -> None:
    """Refuses, in one sentence, a plan that ``what`` (the precision-aware optimizer, which
    OptimizerConfig checks Transformer Engine's FusedAdam for: megatron/core/optimizer/optimizer_config.py)
    where Transformer Engine is not installed."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        raise DsautoError(f"The plan {what}, which needs Transformer Engine; install transformer-engine or re-plan "
                          f"{instead}.")


def transformer_config_kwargs(model: ModelSpec) -> dict[str, Any]:
    """TransformerConfig arguments for the architecture of ``model``, for scripts that build their
    model from the plan's ModelSpec (``TransformerConfig(**transformer_config_kwargs(plan.model), ...)``);
    what Megatron-core cannot build is named by :func:`apply` (dsauto/engines/architecture.py)."""
    import functools

    import torch.nn.functional as F

    kwargs: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.kv_heads,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn_hidden_size,  # per branch for gated MLPs, in both
        normalization="RMSNorm" if model.norm == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=model.norm_epsilon,
        layernorm_zero_centered_gamma=model.norm_plus_one,
        apply_residual_connection_post_layernorm=model.residual_post_norm,
        add_bias_linear=add_bias_linear(model),
        add_qkv_bias=model.biases[0],
        qk_layernorm=qk_layernorm(model),
        # Megatron's defaults are 0.1; ModelSpec.dropout is all-or-nothing.
        hidden_dropout=0.1 if model.dropout else 0.0,
        attention_dropout=0.1 if model.dropout else 0.0,
        gated_linear_unit=model.gated_mlp,
        # Megatron-LM fuses SwiGLU unless --no-bias-swiglu-fusion, and the plan's memory is priced
        # so: the fused function keeps its input alone, where the unfused one also keeps the SiLU's
        # output and a copy of the linear half (MLP.forward's glu adds glu_linear_offset). Its fused
        # bias-GeLU is the tanh approximation, so the exact GeLU keeps it off.
        bias_activation_fusion=model.mlp == "swiglu",
        # the multi-token-prediction layers (the script passes GPTModel an mtp_block_spec for them:
        # get_gpt_mtp_block_spec)
        mtp_num_layers=model.mtp_layers or None,
    )
    if model.glu_clamp:
        # gpt-oss's gate, as Megatron-LM's --quick-geglu --glu-linear-offset 1 --activation-func-clamp-value
        # build it; its experts fuse it with their biases (megatron/core/fusions/fused_bias_geglu.py)
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        kwargs.update(activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=model.glu_clamp)
    elif model.mlp == "swiglu":
        kwargs["activation_func"] = F.silu
    elif model.mlp == "relu":
        kwargs["activation_func"] = F.relu
    elif model.mlp == "relu2":
        from megatron.core.activations import squared_relu  # what --squared-relu selects

        kwargs["activation_func"] = squared_relu
    else:
        kwargs["activation_func"] = functools.partial(F.gelu, approximate="tanh") if model.gelu_tanh else F.gelu
    if model.attention_sinks:
        kwargs["softmax_type"] = "learnable"  # a learned logit per head joins each softmax (gpt-oss)
    if model.attention_scale_dim:
        kwargs["softmax_scale"] = model.attention_scale_dim ** -0.5
    if model.rotary_interleaved:
        kwargs["rotary_interleaved"] = True
    if every := no_rope_freq(model):
        kwargs["no_rope_freq"] = every  # every N-th layer attends without positions
    if model.sliding_window:
        # Hugging Face's window counts the query's own token; Megatron's (left, right) does not.
        kwargs["window_size"] = (model.sliding_window - 1, 0)
        if model.global_attention_every:
            kwargs["window_attn_skip_freq"] = model.global_attention_every
    if model.moe:
        # The experts (TransformerConfig's moe_* fields) and the all-to-all dispatcher the plan is
        # priced with (Megatron's default is allgather); the layer spec must build MoE layers too
        # (get_gpt_layer_local_spec(num_experts=...)). Latent attention needs MLATransformerConfig.
        moe_layers = set(model.moe_layers())
        kwargs.update(
            num_moe_experts=model.num_experts, moe_router_topk=model.moe_top_k,
            moe_ffn_hidden_size=model.expert_ffn_hidden_size,
            moe_shared_expert_intermediate_size=model.shared_expert_ffn_hidden_size or None,
            moe_shared_expert_gate=model.shared_expert_gate,
            moe_layer_freq=[1 if i in moe_layers else 0 for i in range(model.num_layers)],
            moe_router_score_function=model.moe_router,
            moe_router_enable_expert_bias=model.moe_router == "sigmoid" and model.moe_router_balancing_bias,
            moe_apply_probs_on_input=model.moe_probs_on_input,
            moe_router_pre_softmax=model.moe_router_pre_softmax,
            moe_router_topk_scaling_factor=model.moe_router_topk_scaling or None,
            moe_router_num_groups=model.moe_router_groups or None,
            moe_router_group_topk=model.moe_router_group_topk or None,
            moe_token_dispatcher_type="alltoall",
        )
    if model.latent_attention:
        # Multi-head latent attention (DeepSeek-V2 Sec. 2.1): Megatron-core's MLATransformerConfig,
        # whose qk_head_dim is the part without rotary embedding and qk_pos_emb_head_dim the rotary
        # part; q_lora_rank None is one query projection. Build the config with
        # transformer_config_class(model).
        kwargs.update(
            multi_latent_attention=True, q_lora_rank=model.q_lora_rank or None, kv_lora_rank=model.kv_lora_rank,
            qk_head_dim=model.qk_nope_head_dim, qk_pos_emb_head_dim=model.qk_rope_head_dim,
            v_head_dim=model.v_head_dim, rotary_base=model.rotary_base,
            rope_type="yarn" if model.rope_scaling == "yarn" else "rope",
        )
        if model.rope_scaling == "yarn":  # Hugging Face's yarn parameters, where Megatron-core has them
            kwargs["rotary_scaling_factor"] = model.rope_scaling_factor
            known = ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
            kwargs.update({k: (int(v) if k == "original_max_position_embeddings" else v)
                           for k, v in model.rope_scaling_params if k in known})
        kwargs.pop("kv_channels")  # the head widths above replace it
    return kwargs


def transformer_config_class(model: ModelSpec) -> type:
    """Megatron-core's config class for ``model``: ``MLATransformerConfig`` for latent attention,
    else ``TransformerConfig``; takes :func:`transformer_config_kwargs`."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if model.latent_attention else TransformerConfig


def gpt_model_kwargs(plan: Plan) -> dict[str, Any]:
    """GPTModel arguments (besides config, layer spec and pre/post process) for the plan's model."""
    model = plan.model
    if model.architecture != "decoder":
        raise DsautoError(f"{model.name} is an {model.architecture} model, and GPTModel builds decoders; "
                          f"build it with Megatron-core's BertModel.")
    kwargs: dict[str, Any] = dict(
        vocab_size=plan.padded_vocab_size,
        max_sequence_length=model.max_position_embeddings,
        position_embedding_type={"rope": "rope", "learned": "learned_absolute"}.get(model.position_embedding, "none"),
        share_embeddings_and_output_weights=model.tied_embeddings,
    )
    if model.position_embedding == "rope":
        kwargs.update(rotary_base=model.rotary_base, rotary_percent=model.rotary_percent)
        if model.rope_scaling == "llama3":  # Megatron-core fixes its other parameters (see emit.megatron)
            kwargs.update(rope_scaling=True, rope_scaling_factor=model.rope_scaling_factor)
        elif model.rope_scaling == "linear":
            kwargs["seq_len_interpolation_factor"] = model.rope_scaling_factor
        elif model.rope_scaling:
            _report(f"Megatron-core's GPTModel builds no {model.rope_scaling} rope scaling; the rotary "
                    f"embedding is built unscaled.")
    return kwargs


def mtp_block_spec(config: TransformerConfig, layer_spec: Any, vp_stage: int | None = None,
                   use_transformer_engine: bool = False) -> Any:
    """GPTModel's ``mtp_block_spec`` for the model chunk at ``vp_stage`` of a config with
    multi-token-prediction layers (``mtp_num_layers``, set by :func:`transformer_config_kwargs`):
    Megatron-core's ``get_gpt_mtp_block_spec`` over the decoder's ``layer_spec``, None on the chunks
    that do not build them and without them (GPTModel builds them wherever it is given a spec)."""
    if not getattr(config, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=use_transformer_engine,
                                  vp_stage=vp_stage)


def _torch_dtype(plan: Plan) -> torch.dtype:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.dtype]


def _check_model(model: ModelSpec, config: TransformerConfig) -> None:
    """Refuses a config whose model is not the one planned: the plan's layout would not fit it."""
    expected = dict(num_layers=model.num_layers, hidden_size=model.hidden_size,
                    num_attention_heads=model.num_attention_heads,
                    ffn_hidden_size=model.ffn_hidden_size,
                    num_query_groups=model.kv_heads,
                    # the experts the plan splits over ep (None: a dense model, Megatron's default)
                    num_moe_experts=model.num_experts or None,
                    # the multi-token-prediction layers priced on the last stage (None: none)
                    mtp_num_layers=model.mtp_layers or None)
    if model.moe:
        expected.update(moe_router_topk=model.moe_top_k, moe_ffn_hidden_size=model.expert_ffn_hidden_size)
    # the MLP's gate, the norm and the linear layers' biases set the activations priced
    # (megatron/core/transformer/transformer_config.py: gated_linear_unit, normalization, add_bias_linear)
    expected.update(gated_linear_unit=model.mlp in ("swiglu", "geglu"),
                    normalization="RMSNorm" if model.norm == "rmsnorm" else "LayerNorm",
                    add_bias_linear=add_bias_linear(model))
    for name, want in expected.items():
        got = getattr(config, name, None)
        if name == "num_query_groups" and got is None:
            got = config.num_attention_heads  # Megatron's default: one group per head
        if got != want:
            raise DsautoError(f"The TransformerConfig has {name}={got} but the plan was made for "
                              f"{model.name} with {name}={want}; build the model the plan describes "
                              f"or re-plan for this one.")


def _report_max_connections(plan: Plan) -> None:
    """Says when this process's ``CUDA_DEVICE_MAX_CONNECTIONS`` is not what the plan needs on a GPU
    (:func:`dsauto.engines.megatron.max_connections`; megatron_args.txt states it too). CUDA reads it
    when the process starts using the GPU, so it is reported, not set."""
    import torch

    need = max_connections(plan)
    if need is None or not torch.cuda.is_available():
        return
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if (value == "1") != need.one:
        _report(f"The plan needs {need.setting()} for {need.why}, and this process has "
                f"{'none set' if value is None else value}; set it in the launch environment.")


def _report_unfused_swiglu(plan: Plan, config: TransformerConfig) -> None:
    """Says when the config computes a SwiGLU MLP unfused: ``MLP.forward``'s glu
    (megatron/core/transformer/mlp.py) then keeps the SiLU's output and a copy of the linear half
    (it adds ``glu_linear_offset``) beside the fc1 output, where the fused function
    (megatron/core/fusions/fused_bias_swiglu.py) keeps its input alone, as the plan's memory is
    priced. Listed tensor by tensor in bf16 (Megatron-core's local layers on CPU): the two more tensors
    per layer."""
    import torch.nn.functional as F

    if plan.model.mlp == "swiglu" and config.activation_func is F.silu and not config.bias_activation_fusion:
        width = plan.model.expert_ffn_hidden_size if plan.model.moe else plan.model.ffn_hidden_size
        _report(f"The config computes the SwiGLU unfused (bias_activation_fusion=False), which keeps 2 x {width} "
                f"more values per token in every layer than the plan's memory prices; set "
                f"bias_activation_fusion=True (Megatron-LM's default, off only with --no-bias-swiglu-fusion).")


def _report_te_softmax(plan: Plan, config: TransformerConfig) -> None:
    """Transformer Engine's unfused attention (``attention_backend`` unfused) reads none of
    TransformerConfig's softmax fields: its fused masked softmax runs, keeping 16 bits, where it takes
    the shapes and ``NVTE_MASKED_SOFTMAX_FUSION`` is not 0, and torch's in fp32 otherwise
    (:func:`dsauto.engines.megatron.te_softmax_fuses`). Reports a process whose environment runs
    another softmax than the plan was priced with."""
    from megatron.core.transformer.enums import AttnBackend

    if config.attention_backend != AttnBackend.unfused:
        return
    setting = os.environ.get("NVTE_MASKED_SOFTMAX_FUSION", "1")
    fuses = te_softmax_fuses(plan.seq_len, plan.micro_batch, plan.model.num_attention_heads // plan.tp, setting)
    if plan.attention_softmax_in_fp32 and fuses:
        _report("Transformer Engine's unfused attention fuses its masked softmax here, keeping 16 bits, and the plan "
                "was priced with the fp32 softmax; set NVTE_MASKED_SOFTMAX_FUSION=0 in the launch environment to run "
                "as priced (or re-plan with --no-attention-softmax-in-fp32).")
    elif not plan.attention_softmax_in_fp32 and not fuses:
        _report(f"The plan was priced with a 16-bit softmax, and Transformer Engine's unfused attention runs torch's "
                f"in fp32 here (NVTE_MASKED_SOFTMAX_FUSION={setting}), so the memory may be higher than predicted; "
                f"unset it or re-plan without --no-attention-softmax-in-fp32.")


def _report_kernel(plan: Plan, config: TransformerConfig) -> None:
    """Says when the config's attention backend is not the fused kernel the plan's time was priced
    with (``flash`` against ``fused``); the config's choice is kept, as it may be the only one the
    installed Transformer Engine runs. ``auto`` lets Transformer Engine pick, which on Hopper is
    cuDNN's kernel, the plan's default there."""
    from megatron.core.transformer.enums import AttnBackend

    planned = {"flash": AttnBackend.flash, "cudnn": AttnBackend.fused}[plan.attention_kernel]
    other = {AttnBackend.flash: AttnBackend.fused, AttnBackend.fused: AttnBackend.flash}[planned]
    if plan.flash_attention and config.attention_backend == other:
        qk, _, v, _ = attention_widths(plan.model)
        if plan.model.latent_attention and qk != v and other == AttnBackend.flash:  # TE's FlashAttention refuses it
            _report("The config runs attention_backend flash, which Transformer Engine turns off for latent "
                    "attention's unequal query/key and value widths, leaving no backend for it; set "
                    "attention_backend=fused, as the plan was priced.")
            return
        _report(f"The plan's step time was priced with attention_backend {planned.name} and the config runs "
                f"{other.name}, so the measured step may differ from the prediction; set "
                f"attention_backend={planned.name} or re-plan with --attention-kernel "
                f"{'flash' if other == AttnBackend.flash else 'cudnn'}.")


def _report_unsplit(plan: Plan) -> None:
    split = [run for run in plan.layers if run.split > 1]
    if split:
        what = ", ".join(f"{layer_span(run.first, run.last)} ({run.group}) in {run.split} slices" for run in split)
        _report(f"Megatron-core has no operator splitting, so the plan's splitting of {what} is not "
                f"applied and those operators run whole (more transient memory than planned).")


def _report(message: str) -> None:
    """One warning per thing the plan says and Megatron-core cannot, from rank 0 only."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        logger.warning("dsauto: %s", message)


def _selective_fields(plan: Plan, config: TransformerConfig, keeps_scores: bool) -> dict[str, Any] | None:
    """The recompute fields of a plan whose layers recompute modules selectively and none is
    checkpointed whole, or None for other plans. Every layer recomputing the same modules is applied
    exactly (``recompute_granularity="selective"``, ``recompute_modules``); layers recomputing
    different sets, or some none, get the union in every layer (Megatron-core has one list), which
    is reported (more recomputation than planned, no more memory)."""
    sets = plan.selective_layers()
    if not sets or plan.checkpointed_layers():
        return None
    modules = selective_recompute_modules(plan)
    if modules is None:
        modules = tuple(dict.fromkeys(m for ms in sets for m in ms))
        partial = sorted(i for layers in sets.values() for i in layers)
        _report(f"Megatron-core recomputes one list of modules in every transformer layer, and the plan "
                f"recomputes {'; '.join('+'.join(m) + ' in ' + layers_text(ls) for m, ls in sets.items())}"
                f"{'' if len(partial) == plan.model.num_layers else ' only'}; dsauto sets recompute_modules="
                f"{list(modules)} for all of them (more recomputation than planned, no more memory).")
    from megatron.core.tensor_parallel import random as mcore_random

    if "layernorm" in modules and not mcore_random.HAVE_TE:
        # CheckpointWithoutOutput, which drops the norms' outputs, reads Transformer Engine's
        # FP8GlobalStateManager whatever its fp8 flag (megatron/core/tensor_parallel/random.py:
        # ``self.fp8 = fp8 is not None``), an undefined name without Transformer Engine.
        raise DsautoError("The plan recomputes the norms (layernorm), which Megatron-core 0.16 can do only "
                          "with Transformer Engine installed; install transformer_engine or re-plan with "
                          "--recompute-modules without layernorm.")
    if plan.flash_attention and keeps_scores and "core_attn" not in modules:
        modules = (*modules, "core_attn")
        _report(f"attention_backend {config.attention_backend.name} keeps the s x s attention scores that "
                f"the plan, made for flash attention, does not count; dsauto adds core_attn to the "
                f"recomputed modules to keep memory as planned.")
    if config.recompute_granularity == "full":
        _report("The plan recomputes modules selectively, so dsauto replaces the config's full "
                "recomputation with selective recomputation (Megatron-core has one granularity).")
    return dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None,
                recompute_modules=list(modules))


def _covering_block(plan: Plan, checkpointed: Iterable[int] | None = None) -> int:
    """The smallest N whose first N layers of every stage (every model chunk, with virtual stages)
    include all ``checkpointed`` layers (the plan's by default)."""
    checkpointed = set(plan.checkpointed_layers() if checkpointed is None else checkpointed)
    return max((i + 1 for layers in plan.stage_ranges() for i, layer in enumerate(layers)
                if layer in checkpointed), default=0)
