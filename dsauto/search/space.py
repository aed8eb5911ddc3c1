"""The space of global strategies and per-layer options, with the rules the engines enforce."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.engines.megatron import te_softmax_fuses
from dsauto.engines.rules import (
    MIN_CONTEXT_PARALLEL_TOKENS,
    VIRTUAL_STAGES,
    attention_kernel_refusal,
    clamped_gate_refusal,
    context_parallel_refusal,
    cp_comm_type_refusal,
    default_attention_kernel,
    expert_a2a_overlap_refusal,
    expert_dispatcher_refusal,
    force_load_balancing_refusal,
    expert_capacity_refusal,
    mtp_pipeline_refusal,
    grad_reduce_refusal,
    dp_overlap_refusal,
    precision_aware_refusal,
    softmax_16_bit_refusal,
    expert_parallel_refusal,
    dist_opt_instances_refusal,
    hpz_refusal,
    offload_refusal,
    per_layer_residency,
    recompute_module_refusal,
    refusal,
    tp_comm_overlap_refusal,
    fp8_refusal,
    deepspeed_bf16_pipeline_refusal,
    hf_trainer_refusal,
    virtual_stage_refusal,
)
from dsauto.errors import DsautoError
from dsauto.parallel import ParallelDims, divisors, layouts
from dsauto.plan import (
    ACCOUNTED_STAGES,
    ATTENTION_KERNELS,
    ENGINES,
    OFFLOADS,
    CP_COMM_TYPES,
    AttentionKernel,
    CpCommType,
    Engine,
    ExpertDispatcher,
    Fp8Recipe,
    MomentsDtype,
    Offload,
    accounted_chunks,
    even_chunks,
    rank_totals,
)
from dsauto.search.limits import check_search_size, check_strategies
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec

def _pin_expectation(f: dataclasses.Field, value: object) -> str:
    """What a pinned field of :class:`Constraints` must hold where ``value`` is not that, else "":
    the checks the command line's option types make (dsauto.cli, add_field_options), for pins given
    through the Python API."""
    choices = f.metadata.get("choices") or ()
    hint = typing.get_type_hints(Constraints)[f.name]
    kinds = [a for a in typing.get_args(hint) if a is not type(None)]
    allowed = [v for v in (choices.values() if isinstance(choices, dict) else choices) if v is not None]
    allowed += [a for kind in kinds if typing.get_origin(kind) is typing.Literal
                for a in typing.get_args(kind) if a not in allowed]
    if allowed:
        ok = any(value == a and (type(value) is type(a) or isinstance(a, int) and isinstance(value, numbers.Integral)
                                 and not isinstance(value, bool)) for a in allowed)
        return "" if ok else f"one of {', '.join(repr(a) for a in allowed)}"
    if "const" in f.metadata or kinds == [bool]:
        return "" if isinstance(value, bool) else "True or False"
    if kinds == [int]:
        whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return "" if whole and value >= 1 else "a whole number from 1"
    if kinds == [float]:
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        return "" if number and value > 0 else "a number above 0"
    return "" if isinstance(value, str) else "a string"


SPLITS = (1, 2, 4, 8, 16)
"""Operator-splitting factors considered: the head's loss chunks; ZeRO-3 sharded layers use up to 4."""


@dataclass(frozen=True)
class Constraints:
    """Choices the user pinned; None leaves a choice to the search.

    Each field's ``metadata`` is the command-line option that sets it: ``flag`` and ``help``, plus
    ``choices`` (values, or option names mapped to values) or ``const`` (the value of an option
    that takes no argument). ``dsauto.cli`` builds its options from these fields, so a new field
    here is a new option there.
    """

    tp: int | None = field(default=None, metadata={"flag": "--tp", "help": "pin the tensor-parallel degree"})
    """Tensor-parallel degree."""
    pp: int | None = field(default=None, metadata={"flag": "--pp", "help": "pin the pipeline-parallel degree"})
    """Pipeline-parallel degree."""
    zero_stage: int | None = field(default=None, metadata={
        "flag": "--zero-stage", "choices": (0, 1, 2, 3),
        "help": "pin the ZeRO stage (DeepSpeed's; on Megatron-core 1 is its distributed optimizer, 2 and 3 "
                "Megatron-FSDP's optim_grads and optim_grads_params)"})
    """ZeRO stage."""
    micro_batch: int | None = field(default=None, metadata={"flag": "--micro-batch",
                                                            "help": "pin the micro-batch size"})
    """Micro-batch size."""
    checkpoint: bool | None = field(default=None, metadata={
        "flag": "--checkpoint", "choices": {"auto": None, "all": True, "none": False},
        "help": "activation checkpointing of whole transformer layers (default: chosen per layer); "
                "selective recomputation is --recompute-modules (none for no recomputation at all)"})
    """Checkpoint every transformer layer (True), none (False), or let the search choose."""
    sequence_parallel: bool | None = field(default=None, metadata={
        "flag": "--no-sequence-parallel", "const": False,
        "help": "disable Megatron sequence parallelism when tp > 1"})
    """Sequence parallelism when tp > 1 (default: on, it only saves memory and time)."""
    cp: int | None = field(default=None, metadata={
        "flag": "--cp", "help": "pin the context-parallel degree (sequence shards: Megatron's ring attention, or "
                                "DeepSpeed-Ulysses' sequence_parallel_size under --engine deepspeed)"})
    """Context-parallel degree."""
    vpp: int | None = field(default=None, metadata={
        "flag": "--vpp", "help": "pin the virtual pipeline stages per rank (Megatron's interleaved 1F1B)"})
    """Model chunks per pipeline rank; 1 is plain 1F1B."""
    engine: Engine | None = field(default=None, metadata={
        "flag": "--engine", "choices": {"auto": None, "deepspeed": "deepspeed", "megatron": "megatron"},
        "help": "the engine to plan for (default: auto, the faster plan of the two)"})
    """The engine the plan is for (``deepspeed`` or ``megatron``); None plans for both and keeps the
    faster."""
    ep: int | None = field(default=None, metadata={
        "flag": "--ep", "help": "pin the expert-parallel degree of a mixture of experts (Megatron-core; "
                                "folds inside tp x cp x dp)"})
    """Expert-parallel degree (MoE models; searched among the divisors of the experts by default)."""
    etp: int | None = field(default=None, metadata={
        "flag": "--etp", "help": "pin the expert tensor-parallel degree of a mixture of experts (Megatron-core)"})
    """Expert tensor-parallel degree (MoE models; searched among 1 and tp by default)."""
    recompute_modules: str | None = field(default=None, metadata={
        "flag": "--recompute-modules",
        "help": "selective recomputation in every transformer layer: comma-separated modules among "
                "core_attn, layernorm, mlp, moe_act, mla_up_proj, moe, shared_experts (Megatron-core's "
                "--recompute-modules; under DeepSpeed the dsauto hook checkpoints the first three in each "
                "block; moe_act, the routed experts' activation, mla_up_proj, latent attention's up "
                "projections, moe, an MoE layer's whole MLP, and shared_experts are Megatron-core's "
                "alone), or 'none' (default: chosen by the search)"})
    """Modules every transformer layer recomputes, comma-separated (``"core_attn,mlp"``), or
    ``"none"`` for no selective recomputation; None lets the search choose."""
    offload: Offload | None = field(default=None, metadata={
        "flag": "--offload", "choices": {"auto": None, **{name: name for name in OFFLOADS}},
        "help": "what to keep in host memory: none, the optimizer state, or it and (DeepSpeed ZeRO-3) the "
                "parameters (default: auto, offload only a strategy that does not fit without it)"})
    """What to offload to host memory (:data:`dsauto.plan.Offload`); None lets the search offload the
    optimizer of a strategy that does not fit otherwise."""
    hpz: int | None = field(default=None, metadata={
        "flag": "--hpz", "help": "pin ZeRO++'s hierarchical partition size (DeepSpeed ZeRO-3: ranks of a node "
                                 "holding a secondary copy of the sharded parameters; 1: off)"})
    """ZeRO++ hpZ partition size (default: searched among 1 and a node's devices when ZeRO-3's data
    parallelism spans nodes)."""
    dist_opt_instances: int | None = field(default=None, metadata={
        "flag": "--dist-opt-instances",
        "help": "pin Megatron-core's distributed optimizer instances (--num-distributed-optimizer-instances: "
                "each instance of dp x cp / N ranks shards the optimizer state over itself; 1: off)"})
    """Megatron-core's partial distributed optimizer instances (default: searched among 1 and one
    instance per node when the distributed optimizer's data parallelism spans nodes)."""
    attention_kernel: AttentionKernel | None = field(default=None, metadata={
        "flag": "--attention-kernel", "choices": {"auto": None, **{name: name for name in ATTENTION_KERNELS}},
        "help": "the fused attention kernel: flash (FlashAttention) or cudnn (cuDNN's fused attention through "
                "Transformer Engine, Megatron-core only) (default: auto, cudnn for Megatron-core on devices "
                "that have it, as Transformer Engine picks on Hopper, and for latent attention wherever cuDNN "
                "takes its heads)"})
    """The fused attention kernel (:data:`dsauto.plan.AttentionKernel`); None: each engine's default
    (:func:`dsauto.engines.rules.default_attention_kernel`)."""
    tp_comm_overlap: bool | None = field(default=None, metadata={
        "flag": "--tp-comm-overlap", "const": True,
        "help": "overlap the tensor-parallel collectives with the GEMMs (Megatron-core's --tp-comm-overlap, "
                "Transformer Engine's userbuffers; Megatron-core plans only, on where tp > 1 with sequence "
                "parallelism) (default: off)"})
    """Megatron-core's ``--tp-comm-overlap`` on the plans where it applies (tp > 1, sequence parallel);
    None or False: off, as Megatron-core's default."""
    grad_reduce_in_fp32: bool | None = field(default=None, metadata={
        "flag": "--grad-reduce-in-bf16", "const": False,
        "help": "keep and reduce gradients in bf16 instead of fp32 (Megatron-core's --grad-reduce-in-bf16; "
                "bf16 Megatron-core plans only) (default: fp32, Megatron-core's default)"})
    """False: gradients kept and reduced in bf16 (Megatron-core's ``--grad-reduce-in-bf16``); None:
    fp32, the engine's default (never chosen by the search: it trades precision for memory)."""
    overlap_grad_reduce: bool | None = field(default=None, metadata={
        "flag": "--no-overlap-grad-reduce", "const": False,
        "help": "price the gradients reduced at once after the backward and the parameters gathered at once after "
                "the optimizer step, exposed, as Megatron-LM runs a launch without --overlap-grad-reduce (its "
                "default) (Megatron-core plans of ZeRO 0-1; default: overlapped, as dsauto's plans run)"})
    """False: Megatron-core's gradient reduction (and so its parameter gather) unoverlapped
    (:attr:`dsauto.cost.strategy.Strategy.overlap_grad_reduce`); None: overlapped (never chosen by the
    search: overlapping costs nothing)."""
    overlap_param_gather: bool | None = field(default=None, metadata={
        "flag": "--no-overlap-param-gather", "const": False,
        "help": "price the distributed optimizer's parameters gathered at once after the optimizer step, exposed, "
                "as Megatron-LM runs a launch without --overlap-param-gather (Megatron-core plans of ZeRO 0-1; "
                "default: overlapped with the next forward)"})
    """False: the distributed optimizer's parameter gather unoverlapped
    (:attr:`dsauto.cost.strategy.Strategy.overlap_param_gather`); None: overlapped unless
    ``overlap_grad_reduce`` is False, which Megatron-LM requires of it."""
    attention_softmax_in_fp32: bool | None = field(default=None, metadata={
        "flag": "--no-attention-softmax-in-fp32", "const": False,
        "help": "with --no-flash-attention, price Megatron-core's unfused attention with its softmax in 16 bits, "
                "keeping no fp32 copy of the scores: Megatron-LM's default launch (--attention-softmax-in-fp32 "
                "is opt-in, and its fused masked-softmax kernel keeps 16 bits) (16-bit Megatron-core plans; "
                "default: fp32, as dsauto's plugin runs it)"})
    """False: the unfused attention's softmax in 16 bits
    (:attr:`dsauto.cost.strategy.Strategy.attention_softmax_in_fp32`); None: fp32, as dsauto's plugin
    configures Megatron-core (never chosen by the search: it changes the numerics)."""
    precision_aware_optimizer: MomentsDtype | None = field(default=None, metadata={
        "flag": "--precision-aware-optimizer",
        "help": "keep Adam's moments in this dtype and the fp32 main weights as the 16 bits bf16 lacks "
                "(Megatron-core's --use-precision-aware-optimizer with --exp-avg-dtype and --exp-avg-sq-dtype, "
                "Transformer Engine's FusedAdam; bf16 Megatron-core plans with the distributed optimizer, ZeRO 1) "
                "(default: off, fp32 main weights and moments)"})
    """The moments' dtype of Megatron-core's precision-aware optimizer
    (:attr:`dsauto.cost.strategy.Strategy.precision_aware_optimizer`); None: off (never chosen by the
    search: it changes the optimizer's numerics)."""
    expert_dispatcher: ExpertDispatcher | None = field(default=None, metadata={
        "flag": "--moe-dispatcher", "choices": {"alltoall": None, "deepep": "deepep"},
        "help": "the MoE token dispatcher: alltoall, or deepep (Megatron-core's flex dispatcher with "
                "DeepSeek's DeepEP kernels, installed apart: across nodes a token crosses the network once "
                "per node holding its experts) (Megatron-core plans of mixtures of experts; default: alltoall)"})
    """The MoE token dispatcher (:data:`dsauto.plan.ExpertDispatcher`); None: ``alltoall``."""
    expert_load_balanced: bool | None = field(default=None, metadata={
        "flag": "--moe-router-force-load-balancing", "const": True,
        "help": "price the routing forced to balance, so the busiest expert-parallel rank carries the mean load "
                "(Megatron-core's --moe-router-force-load-balancing, a benchmarking option that changes what the "
                "model learns; NVIDIA's MoE performance tables set it) (Megatron-core plans of mixtures of "
                "experts; default: off, the busiest rank carrying 1.1x the mean)"})
    """True: routing forced to balance (:attr:`dsauto.cost.strategy.Strategy.expert_load_balanced`); None:
    the router's own balance (never chosen by the search: it changes what the model learns)."""
    expert_capacity_factor: float | None = field(default=None, metadata={
        "flag": "--moe-expert-capacity-factor",
        "help": "price token dropping: each expert takes at most this times its mean share of a rank's routed "
                "tokens and drops the rest (Megatron-core's --moe-expert-capacity-factor), so the busiest "
                "expert-parallel rank carries at most that times the mean (Megatron-core plans of mixtures of "
                "experts; default: dropless)"})
    """Megatron-core's expert capacity (:attr:`dsauto.cost.strategy.Strategy.expert_capacity_factor`); None:
    dropless (never chosen by the search: dropping tokens changes what the model learns)."""
    expert_pad_to_capacity: bool | None = field(default=None, metadata={
        "flag": "--moe-pad-expert-input-to-capacity", "const": True,
        "help": "with --moe-expert-capacity-factor, fill every expert to its capacity (Megatron-core's "
                "--moe-pad-expert-input-to-capacity), so every rank carries that factor times the mean "
                "(default: off)"})
    """True: every expert takes exactly its capacity
    (:attr:`dsauto.cost.strategy.Strategy.expert_pad_to_capacity`); needs ``expert_capacity_factor``."""
    fp8: bool | None = field(default=None, metadata={
        "flag": "--fp8", "const": True,
        "help": "train the transformer layers' linear layers in FP8 (Megatron-core's --fp8-format hybrid "
                "through Transformer Engine, scaled as --fp8-recipe says; Megatron-core plans on devices with FP8 "
                "tensor cores, H100 and H200) (default: off)"})
    """True: FP8 training (:attr:`dsauto.cost.strategy.Strategy.fp8`); None: the training dtype
    throughout (never chosen by the search: it changes the numerics)."""
    fp8_recipe: Fp8Recipe | None = field(default=None, metadata={
        "flag": "--fp8-recipe",
        "help": "the FP8 scaling recipe with --fp8: delayed (from a history of maxima) or tensorwise (current "
                "scaling, each tensor's own maximum) (default: delayed, Megatron-core's)"})
    """The FP8 scaling recipe (:data:`dsauto.plan.Fp8Recipe`); None: ``delayed``. Needs ``fp8``."""
    fp8_param_gather: bool | None = field(default=None, metadata={
        "flag": "--fp8-param-gather", "const": True,
        "help": "with --fp8, keep the transformer layers' weights in FP8 and gather them at one byte a parameter "
                "(Megatron-core's --fp8-param-gather; needs ZeRO 1-3) (default: off)"})
    """True: FP8 weights (:attr:`dsauto.cost.strategy.Strategy.fp8_param_gather`), which rules out ZeRO 0;
    None: 16-bit weights with FP8 copies. Needs ``fp8``."""

    expert_a2a_overlap: bool | None = field(default=None, metadata={
        "flag": "--moe-a2a-overlap", "const": True,
        "help": "overlap a mixture of experts' all-to-alls with another micro-batch's compute (Megatron-core's "
                "--overlap-moe-expert-parallel-comm, its combined 1F1B schedule; needs ep > 1, the interleaved "
                "schedule when pp > 1, no full recomputation) (default: off)"})
    """True: Megatron-core's ``--overlap-moe-expert-parallel-comm``
    (:attr:`dsauto.cost.strategy.Strategy.expert_a2a_overlap`); None: off (the search does not pick it:
    it rules out full recomputation and needs torch 2.6 or later)."""
    cp_comm_type: CpCommType | None = field(default=None, metadata={
        "flag": "--cp-comm-type",
        "help": "how Megatron-core's context parallelism exchanges a sequence's shards: p2p (a ring of keys "
                "and values overlapped with attention), all_gather (keys and values gathered before attention, "
                "as Llama 3 trained) or a2a (all-to-alls trading the sequence shard for heads, as "
                "DeepSpeed-Ulysses) (Megatron-core plans with cp > 1; default: the fastest that runs)"})
    """How Megatron-core's context parallelism exchanges the shards (:data:`dsauto.plan.CpCommType`);
    None: the search tries each that runs (they compute the same)."""

    stage_layers: str | None = field(default=None, metadata={
        "flag": "--stage-layers",
        "help": "pin the transformer layers of each pipeline stage: 'even' (split evenly over the pp x vpp "
                "model chunks, what Megatron-core does without a layout flag), 'even+embedding', 'even+loss' or "
                "'even+embedding+loss' (the even split counting them as layers: Megatron-LM's "
                "--account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split; needs --pp), "
                "one count per stage, "
                "comma-separated, first stage first, or with --pp and --vpp pinned one count per model chunk, "
                "in Megatron's chunk order (pp x vpp counts: every rank's first chunk, then every rank's second, "
                "...) "
                "(default: balanced by the search)"})
    """The pipeline layout: ``"even"``, the transformer layers of each pipeline rank, comma-separated
    (:func:`parse_stage_layers`), or of each model chunk in chunk order (pp x vpp counts, a rank's
    chunks as Megatron-core's ``--pipeline-model-parallel-layout`` places them); None lets the search
    balance the stages."""

    recompute_num_layers: int | None = field(default=None, metadata={
        "flag": "--recompute-num-layers",
        "help": "checkpoint the first N transformer layers of every pipeline stage (of every model chunk "
                "with --vpp) and no others: Megatron-core's --recompute-method block --recompute-num-layers N "
                "(default: chosen per layer)"})
    """Megatron's block recomputation: the first N transformer layers of each model chunk checkpointed
    whole, the rest not (:func:`dsauto.plan.block_recompute_set`); None lets the search choose per layer."""
    hf_trainer: bool | None = field(default=None, metadata={
        "flag": "--for", "choices": {"deepspeed": None, "hf": True},
        "help": "who runs the plan: deepspeed (deepspeed.initialize; default) or hf (Hugging Face Trainer / "
                "accelerate: only what dsauto's hook applies to a transformers model, and ds_config.json with "
                "\"auto\" where TrainingArguments own the value)"})
    """True: plan what dsauto's hook applies to a ``transformers`` model that Hugging Face's Trainer or
    accelerate hands to DeepSpeed (:func:`hf_trainer_refusal`): DeepSpeed's engine, one pipeline stage,
    no DeepSpeed-Ulysses, no attention-core recomputation, no operator splitting; ``dsauto tune`` then
    writes ds_config.json in Hugging Face's convention (``--for hf``)."""

    def __post_init__(self) -> None:
        if self.hf_trainer is False:
            object.__setattr__(self, "hf_trainer", None)  # deepspeed.initialize's plans: --for deepspeed
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, f.name, int(value))  # numpy's integers, as Python's
            if value is not None:
                expected = _pin_expectation(f, value)
                if expected:
                    option = f" (option {f.metadata['flag']})" if "flag" in f.metadata else ""
                    raise DsautoError(f"{f.name}={value!r} is not a pin dsauto reads{option}: give {expected}, or "
                                      f"None to leave it to the search.")
        if self.hf_trainer and self.engine is None:
            object.__setattr__(self, "engine", "deepspeed")  # what Hugging Face's Trainer runs

    @property
    def fp8_delayed(self) -> bool:
        """FP8 pinned with delayed scaling."""
        return bool(self.fp8) and (self.fp8_recipe or "delayed") == "delayed"


def strategies(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
               pins: Constraints) -> list[Strategy]:
    """Every global strategy the engines accept, in a fixed order.

    Rules: tp divides the devices of a node (tensor parallelism stays on the fast links) and the
    heads, key/value heads and MLP width; pp is at most the layer count; tp * pp * dp is the world
    size; dp divides the global batch (train_batch = micro * accum * dp, DeepSpeed's batch
    equation); DeepSpeed's pipeline engine accepts ZeRO stage 0 or 1 only
    (deepspeed/runtime/pipe/engine.py asserts zero stage < 2); ZeRO stages above 0 need dp > 1;
    each engine runs only what :func:`dsauto.engines.rules.refusal` allows.
    """
    check_search_size(model, cluster, train, pins)  # before building any: huge inputs answer at once
    if pins.recompute_num_layers is not None and (why := recompute_num_layers_refusal(pins)):
        raise DsautoError(f"--recompute-num-layers {pins.recompute_num_layers} {why}.")
    if pins.hf_trainer and model.transformers_dense_experts:
        raise DsautoError(f"A plan for Hugging Face's Trainer (--for hf) cannot price {model.name}'s experts as "
                          f"transformers computes them: each of its {model.num_experts} experts on every token (Llama "
                          f"4's Llama4TextMoe), {model.num_experts // model.moe_top_k}x the top-{model.moe_top_k} "
                          f"work dsauto prices; plan without --for hf, for Megatron-core or a DeepSpeed model that "
                          f"routes each token to its top-{model.moe_top_k}.")
    if pins.hf_trainer and (why := pinned_hf_trainer_refusal(pins, model)):
        raise DsautoError(f"A plan for Hugging Face's Trainer (--for hf) cannot run {why}; drop it, or plan "
                          f"without --for hf.")
    out = []
    engines = ENGINES if pins.engine is None else (pins.engine,)
    if pins.hf_trainer:
        engines = ("deepspeed",)
    engines = tuple(engine for engine in engines if clamped_gate_refusal(engine, model) is None)
    recompute_sets = {engine: recompute_module_sets(engine, model, train, pins) for engine in engines}
    pinned_layout = None if pins.stage_layers is None else parse_stage_layers(pins.stage_layers, model.num_layers)
    chunked, pinned_chunks = chunked_layout(pins), pinned_chunk_layout(pins)  # chunks pin --pp and --vpp: one layout
    for dims in _with_context_parallel(layouts(cluster.world_size, cluster.devices_per_node), train, pins):
        tp, pp, dp = dims.tp, dims.pp, dims.dp
        if pins.hf_trainer and (pp > 1 or dims.cp > 1):
            continue  # no pipeline engine, no DistributedAttention (hf_trainer_refusal)
        if (pins.tp is not None and tp != pins.tp) or (pins.pp is not None and pp != pins.pp):
            continue
        if model.tp_problem(tp) or pp > model.num_layers or train.global_batch % dp:
            continue
        zero_stages = (0, 1) if pp > 1 else (0, 1, 2, 3)
        if pins.zero_stage is not None:
            if pins.zero_stage not in zero_stages:
                continue
            zero_stages = (pins.zero_stage,)
        elif dims.replicas == 1:
            zero_stages = (0,)  # nothing to partition over (ZeRO shards over dp x cp)
        per_replica = train.global_batch // dp
        experts = _expert_degrees(model, dims, pins)
        # Megatron-core's sequence parallelism scatters each cp rank's tokens over tp, which must divide them
        # (megatron/core/tensor_parallel/mappings.py, _split_along_first_dim asserts it)
        sp_runs = sequence_parallel_divides(train.seq_len, dims.cp, tp)
        sp_values = (False,) if tp == 1 else (
            (pins.sequence_parallel,) if pins.sequence_parallel is not None else (sp_runs,))
        for micro in divisors(per_replica):
            if pins.micro_batch is not None and micro != pins.micro_batch:
                continue
            accum = per_replica // micro
            for zero in zero_stages:
                for sp in sp_values:
                    for engine in engines:
                        if (sp and engine == "megatron" and not sp_runs) or mtp_pipeline_refusal(engine, pp, model):
                            continue
                        if refusal(engine, dims, zero, train.dtype) is not None or context_parallel_refusal(
                                engine, dims.cp, train.seq_len, train.flash_attention, heads=model.num_attention_heads,
                                kv_heads=model.kv_heads, pp=pp, learned_positions=model.learned_positions) is not None:
                            continue
                        chunks = (pins.vpp,) if pins.vpp is not None else (1, *VIRTUAL_STAGES)
                        for expert_dims in experts:
                            if expert_parallel_refusal(engine, expert_dims, zero, sp, model.num_experts,
                                                       model.expert_ffn_hidden_size) is not None:
                                continue
                            if engine == "deepspeed" and expert_dims.ep > 1 and pins.ep is None:
                                # DeepSpeed-MoE's ep needs the model built from its MoE layers:
                                # planned when asked for (--ep), never sprung on a model
                                continue
                            for v in chunks:
                                # The search's own layouts give each chunk a layer; a pinned one may leave
                                # some empty (a padded end stage).
                                if virtual_stage_refusal(engine, pp, v, accum) is None and (
                                        model.num_layers // pp >= v if pins.stage_layers is None
                                        else stage_layout_refusal(pinned_layout, model.num_layers, pp, v,
                                                                  chunked) is None):
                                    out.extend(_host_and_hpz(Strategy(
                                        dims=expert_dims, zero_stage=zero, micro_batch=micro, grad_accum=accum,
                                        sequence_parallel=sp, engine=engine, virtual_stages=v,
                                        chunk_layout=pinned_chunks), cluster, pins))
    # Each with the selective recomputations its engine runs (none among them unless pinned), the
    # attention kernel it runs and the pinned engine options; an engine refusing a pin is dropped.
    hopper = bool(cluster.device.fused_attention_efficiency)
    kernels = {engine: pins.attention_kernel or default_attention_kernel(
        engine, hopper, train.dtype, train.flash_attention, model, train.seq_len) for engine in engines}
    runnable = {engine: not pinned_option_refusals(engine, pins, train, model, hopper) for engine in engines}
    out = [dataclasses.replace(s, recompute_modules=modules, attention_kernel=kernels[s.engine],
                               tp_comm_overlap=bool(pins.tp_comm_overlap),
                               expert_dispatcher=pins.expert_dispatcher or "alltoall",
                               expert_load_balanced=bool(pins.expert_load_balanced),
                               expert_capacity_factor=pins.expert_capacity_factor,
                               expert_pad_to_capacity=bool(pins.expert_pad_to_capacity),
                               # a transformers model's experts (Strategy.experts_gathered_whole)
                               experts_gathered_whole=bool(pins.hf_trainer and model.moe),
                               grad_reduce_in_fp32=pins.grad_reduce_in_fp32 is not False,
                               overlap_grad_reduce=pins.overlap_grad_reduce is not False,
                               overlap_param_gather=(pins.overlap_param_gather is not False
                                                     and pins.overlap_grad_reduce is not False),
                               precision_aware_optimizer=pins.precision_aware_optimizer,
                               attention_softmax_in_fp32=pins.attention_softmax_in_fp32 is not False,
                               fp8=bool(pins.fp8), fp8_recipe=pins.fp8_recipe or "delayed",
                               fp8_param_gather=bool(pins.fp8 and pins.fp8_param_gather), cp_comm_type=exchange,
                               expert_a2a_overlap=bool(pins.expert_a2a_overlap))
           for s in out if runnable[s.engine] and not (pins.fp8_param_gather and s.zero_stage == 0)
           and not (False in (pins.overlap_grad_reduce, pins.overlap_param_gather)
                    and dp_overlap_refusal(s.engine, s.zero_stage))
           and not (pins.precision_aware_optimizer and (s.zero_stage != 1 or s.offload != "none"))
           # Transformer Engine's fused masked softmax, which keeps 16 bits, needs micro-batch x heads per rank
           # a multiple of 4 (te_softmax_fuses)
           and not (pins.attention_softmax_in_fp32 is False and not te_softmax_fuses(
               train.seq_len, s.micro_batch, model.num_attention_heads // s.tp))
           and not (pins.expert_a2a_overlap and not a2a_overlap_runs(s))
           for exchange in cp_comm_types(s, model, pins, train.seq_len)
           for modules in recompute_sets[s.engine]]
    return check_strategies(out, model, cluster, train)  # none too many, none too long to simulate


def a2a_overlap_runs(strategy: Strategy) -> bool:
    """Whether Megatron-core can overlap ``strategy``'s expert all-to-alls
    (``--overlap-moe-expert-parallel-comm``): it needs expert parallelism and, when pp > 1, the
    interleaved schedule (TransformerConfig asserts both)."""
    return strategy.dims.ep > 1 and (strategy.pp == 1 or strategy.virtual_stages > 1)


def cp_comm_types(strategy: Strategy, model: ModelSpec, pins: Constraints, seq_len: int) -> tuple[CpCommType, ...]:
    """The ways the search tries for ``strategy``'s context parallelism to exchange the shards: the
    pinned one, else each that runs (they compute the same, so the cost model picks); ``p2p`` alone
    where nothing is exchanged (cp 1) or cp is DeepSpeed-Ulysses (a pin drops DeepSpeed's strategies:
    :func:`pinned_option_refusals`)."""
    if strategy.dims.cp == 1 or strategy.engine != "megatron":
        return ("p2p",)
    tried = (pins.cp_comm_type,) if pins.cp_comm_type is not None else CP_COMM_TYPES
    return tuple(t for t in tried if cp_comm_type_refusal(strategy.engine, t, strategy.dims.cp, strategy.tp, model, seq_len) is None)


def sequence_parallel_divides(seq_len: int, cp: int, tp: int) -> bool:
    """Whether Megatron-core's sequence parallelism can split a context-parallel rank's share of a
    ``seq_len``-token sequence over ``tp`` ranks."""
    return (seq_len // cp) % tp == 0


def sequence_parallel_runs(seq_len: int, tp: int, cp: int | None, world: int) -> bool:
    """Whether sequence parallelism over ``tp`` ranks can run with the pinned ``cp`` (None: with some
    context-parallel degree of ``world`` that splits the sequence, into 2 x cp chunks)."""
    cps = [cp] if cp else [c for c in divisors(world) if c == 1 or seq_len % (2 * c) == 0]
    return any(sequence_parallel_divides(seq_len, c, tp) for c in cps)


def sequence_parallel_multiple(tp: int, cp: int | None) -> int:
    """The multiple a sequence's length must be for sequence parallelism over ``tp`` ranks with ``cp``
    context-parallel ranks (None or 1: none): tp x cp, and 2 x cp for context parallelism's chunks."""
    cp = cp or 1
    return math.lcm(tp * cp, 2 * cp) if cp > 1 else tp


def strategies_or_none(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                       pins: Constraints) -> list[Strategy]:
    """:func:`strategies`, or none where it refuses the inputs."""
    try:
        return strategies(model, cluster, train, pins)
    except DsautoError:
        return []


def pinned_option_refusals(engine: Engine, pins: Constraints, train: TrainSpec,
                           model: ModelSpec, hopper: bool = False) -> dict[str, tuple[str, str]]:
    """Flag -> (why ``engine`` cannot run it, what to do) of each pinned engine option it refuses: the
    attention kernel, pinned or the engine's default on the device (``hopper``: it has cuDNN's
    fused attention; :func:`dsauto.engines.rules.attention_kernel_refusal`), ``--tp-comm-overlap``,
    ``--grad-reduce-in-bf16``, ``--no-overlap-grad-reduce``, ``--no-overlap-param-gather``,
    ``--no-attention-softmax-in-fp32``, ``--precision-aware-optimizer``,
    ``--moe-dispatcher deepep``, ``--moe-router-force-load-balancing``, ``--fp8`` and ``--cp-comm-type``
    (Megatron-core's). The search drops the engine's strategies when any is refused."""
    out = {}
    kernel = pins.attention_kernel or default_attention_kernel(engine, hopper, train.dtype, train.flash_attention,
                                                                model, train.seq_len)
    if why := attention_kernel_refusal(engine, kernel, train.dtype, train.flash_attention, model, train.seq_len,
                                       hopper=hopper):
        other = attention_kernel_refusal(engine, "cudnn" if kernel == "flash" else "flash", train.dtype,
                                         train.flash_attention, model, train.seq_len, hopper=hopper)
        on_hopper = attention_kernel_refusal(engine, "cudnn", train.dtype, train.flash_attention, model,
                                             train.seq_len, hopper=True) is None
        unfused = "add --no-flash-attention (unfused attention)" + ("" if hopper or not on_hopper else
                                                                    ", or plan for Hopper")
        if pins.attention_kernel is None:  # the default: no fused kernel runs this model's attention here
            out["fused attention"] = f"{why}, and {other}", unfused
        elif other is None:
            out[f"--attention-kernel {kernel}"] = why, f"use --attention-kernel {'cudnn' if kernel == 'flash' else 'flash'} or leave it out"
        else:
            out[f"--attention-kernel {kernel}"] = f"{why}, and {other}", unfused
    if pins.tp_comm_overlap and (why := tp_comm_overlap_refusal(engine)):
        out["--tp-comm-overlap"] = why, "otherwise leave it out"
    if pins.grad_reduce_in_fp32 is False and (why := grad_reduce_refusal(engine, train.dtype)):
        out["--grad-reduce-in-bf16"] = why, "leave it out"
    for flag, pin in (("--no-overlap-grad-reduce", pins.overlap_grad_reduce),
                      ("--no-overlap-param-gather", pins.overlap_param_gather)):
        if pin is False and (why := dp_overlap_refusal(engine, pins.zero_stage)):
            out[flag] = why, ("otherwise leave it out" if engine != "megatron"
                              else "pin --zero-stage 0 or 1, or leave it out")
    if pins.attention_softmax_in_fp32 is False and (why := softmax_16_bit_refusal(
            engine, train.dtype, train.flash_attention, train.seq_len)):
        out["--no-attention-softmax-in-fp32"] = why, "leave it out"
    elif pins.attention_softmax_in_fp32 is False and pins.micro_batch is not None and not any(
            te_softmax_fuses(train.seq_len, pins.micro_batch, model.num_attention_heads // tp)
            for tp in ([pins.tp] if pins.tp else divisors(model.num_attention_heads))):
        out["--no-attention-softmax-in-fp32"] = (
            f"Transformer Engine's fused masked softmax needs micro-batch x attention heads per rank a multiple of "
            f"4, and micro-batch {pins.micro_batch} x {model.num_attention_heads} heads / tp "
            f"{pins.tp or 'any'} is none", "pin another --micro-batch or leave it out")
    if pins.precision_aware_optimizer is not None and (why := precision_aware_refusal(
            engine, train.dtype, pins.zero_stage, pins.offload)):
        out[f"--precision-aware-optimizer {pins.precision_aware_optimizer}"] = why, "leave it out"
    if pins.expert_dispatcher == "deepep" and (why := expert_dispatcher_refusal(engine, model.moe)):
        out["--moe-dispatcher deepep"] = why, "leave it out"
    if pins.expert_load_balanced and (why := force_load_balancing_refusal(engine, model.moe)):
        out["--moe-router-force-load-balancing"] = why, "leave it out"
    if pins.expert_capacity_factor is not None and (why := expert_capacity_refusal(engine, model.moe)):
        out[f"--moe-expert-capacity-factor {pins.expert_capacity_factor:g}"] = why, "leave it out"
    elif pins.expert_pad_to_capacity and pins.expert_dispatcher == "deepep":
        out["--moe-pad-expert-input-to-capacity"] = (
            "Megatron-core refuses filling the experts to capacity under DeepEP's dispatcher",
            "leave it out, or dispatch with alltoall")
    if pins.fp8 and (why := fp8_refusal(engine, train.dtype, model)):
        out["--fp8"] = why, "leave it out"
    if pins.expert_a2a_overlap and (why := expert_a2a_overlap_refusal(
            engine, model.moe, train.dtype, pins.checkpoint,
            parse_recompute_modules(pins.recompute_modules) if pins.recompute_modules is not None else ())):
        out["--moe-a2a-overlap"] = why, "leave it out"
    if pins.cp_comm_type is not None and engine != "megatron" and (
            why := cp_comm_type_refusal(engine, pins.cp_comm_type, pins.cp or 1, pins.tp or 1, model, train.seq_len)):
        out[f"--cp-comm-type {pins.cp_comm_type}"] = why, "plan with --engine megatron or leave it out"
    return out


def fp8_param_gather_recipe(pins: Constraints) -> str | None:
    """The FP8 recipe of pinned FP8 weight gathers (--fp8-param-gather), or None without them."""
    return (pins.fp8_recipe or "delayed") if pins.fp8 and pins.fp8_param_gather else None


def _host_and_hpz(strategy: Strategy, cluster: ClusterSpec, pins: Constraints) -> list[Strategy]:
    """``strategy`` with each offload and hpZ setting the search tries up front: the pinned ones, else
    no offload (the planner offloads a strategy that does not fit without it:
    :meth:`dsauto.search.planner.Planner.search`) and hpz 1, plus a node's data-parallel ranks when
    ZeRO-3's data parallelism spans nodes (hpZ then keeps backward's gathers inside the node)."""
    offload = pins.offload or "none"
    out = []
    for strategy in _single_replica_zeros(strategy, pins) if offload != "none" else [strategy]:
        if offload_refusal(strategy.engine, strategy.dims, strategy.zero_stage, offload, host_problem(cluster),
                           fp8_param_gather_recipe(pins)):
            continue
        per_node = cluster.devices_per_node
        if pins.hpz is not None:
            sizes: tuple[int, ...] = (pins.hpz,)
        elif strategy.zero_stage == 3 and strategy.dims.spans_nodes("dp", per_node):
            sizes = (1, per_node)
        else:
            sizes = (1,)
        out += [dataclasses.replace(strategy, offload=offload, hpz=hpz, dist_opt_instances=instances)
                for hpz in sizes if hpz_refusal(strategy.engine, strategy.dims, strategy.zero_stage, hpz, per_node) is None
                for instances in dist_opt_instance_counts(strategy, cluster, pins)]
    return out


def dist_opt_instance_counts(strategy: Strategy, cluster: ClusterSpec, pins: Constraints) -> tuple[int, ...]:
    """The instance counts of Megatron-core's partial distributed optimizer the search tries for
    ``strategy``: the pinned one, else 1, plus one instance per node when the distributed optimizer
    (ZeRO-1) shards over ranks on several nodes. A dp x cp group spans tp x dp x cp consecutive ranks
    (the rank order of :mod:`dsauto.parallel`, pipeline stages outermost), so an instance of
    devices-per-node / tp replicas fills a node: its reduce-scatter and all-gather stay on the node's
    links and only the shard's all-reduce crosses nodes, for optimizer state sharded over fewer
    ranks. Each count obeys :func:`dsauto.engines.rules.dist_opt_instances_refusal`."""
    if pins.dist_opt_instances is not None:
        counts: tuple[int, ...] = (pins.dist_opt_instances,)
    else:
        counts = (1,)
        per_node, tp, replicas = cluster.devices_per_node, strategy.tp, strategy.dims.replicas
        if (strategy.engine == "megatron" and strategy.zero_stage == 1 and tp * replicas > per_node
                and per_node % tp == 0 and replicas % (per_node // tp) == 0):
            counts = (1, replicas // (per_node // tp))
    return tuple(n for n in counts
                 if dist_opt_instances_refusal(strategy.engine, strategy.dims, strategy.zero_stage, n) is None)


def offloaded_variants(strategy: Strategy, cluster: ClusterSpec, pins: Constraints) -> list[Strategy]:
    """``strategy`` with its optimizer offloaded, and under DeepSpeed ZeRO-3 its parameters too: what
    the planner tries for a strategy that fits nowhere without offload, unless ``offload`` or the
    precision-aware optimizer (its states priced on the device) is pinned. Not for distributed-optimizer
    instances: one instance over all ranks keeps less optimizer state, so it is the one offloaded when
    nothing fits."""
    if (pins.offload is not None or pins.precision_aware_optimizer is not None or strategy.offload != "none"
            or host_problem(cluster)):
        return []
    if strategy.dist_opt_instances > 1:
        return []
    recipe = strategy.fp8_recipe if strategy.fp8_param_gather else None
    return [dataclasses.replace(zeroed, offload=offload) for zeroed in _single_replica_zeros(strategy, pins)
            for offload in OFFLOADS[1:]
            if offload_refusal(zeroed.engine, zeroed.dims, zeroed.zero_stage, offload,
                               fp8_param_gather_recipe=recipe) is None]


def _single_replica_zeros(strategy: Strategy, pins: Constraints) -> list[Strategy]:
    """``strategy`` as it offloads: a single replica has nothing to partition (the search gives it
    ZeRO 0), but ZeRO's optimizer is the one that offloads, so it runs ZeRO-Offload's single-GPU
    setting (Ren et al. 2021, Sec. 4.1), ZeRO-2 (Megatron-core: its distributed optimizer), unless
    the ZeRO stage is pinned; under DeepSpeed, when the step accumulates micro-batches, ZeRO-1 too,
    which keeps the sum on the device where ZeRO-2 carries it through host memory every micro-batch
    (:func:`dsauto.cost.offload.host_accumulation_seconds`): the search prices both."""
    if strategy.zero_stage == 0 and strategy.dims.replicas == 1 and pins.zero_stage is None:
        if strategy.engine != "deepspeed":
            return [dataclasses.replace(strategy, zero_stage=1)]
        stages = (2, 1) if strategy.grad_accum > 1 else (2,)
        return [dataclasses.replace(strategy, zero_stage=stage) for stage in stages]
    return [strategy]


def host_problem(cluster: ClusterSpec) -> str | None:
    """Why nothing can be offloaded to the cluster's hosts, or None: the hardware must describe them,
    and on CPU ranks (the dry-run preset) the device memory is the host's, so offloading frees none
    of it (DeepSpeed's CPU accelerator keeps the "offloaded" state in the same process)."""
    hardware = cluster.hardware
    if cluster.device.name == "cpu":
        return "on CPU ranks the device memory is the host memory, so offloading frees none of it"
    if hardware.host_link is None or hardware.host_memory_bytes <= 0 or hardware.host_memory_bandwidth_gbps <= 0:
        return (f"the hardware {hardware.name} gives no host_link, host_memory_bytes and "
                f"host_memory_bandwidth_gbps to offload to")
    return None


def _expert_degrees(model: ModelSpec, dims: ParallelDims, pins: Constraints) -> list[ParallelDims]:
    """``dims`` with each expert layout the search tries: a dense model only its own (ep = etp = 1);
    a mixture of experts every ep dividing its experts and etp of 1 or tp, such that ep x etp
    divides the stage's tp x cp x dp ranks (Megatron-core's folding)."""
    if not model.moe:
        return [dims] if (pins.ep or 1) == 1 and (pins.etp or 1) == 1 else []
    etps = (pins.etp,) if pins.etp is not None else tuple(sorted({1, dims.tp}))
    eps = (pins.ep,) if pins.ep is not None else tuple(divisors(model.num_experts))
    out = [dataclasses.replace(dims, ep=ep, etp=etp) for etp in etps for ep in eps
           if dims.stage_ranks % (ep * etp) == 0]
    # Expert gradients are priced on the data-parallel ring (terms.dp_equivalent_params): without
    # one (dp x cp = 1), experts replicated over the tensor-parallel ranks would reduce for free.
    return [d for d in out if d.replicas > 1 or d.expert_dp == 1]


def _with_context_parallel(layouts: Iterable[ParallelDims], train: TrainSpec,
                           pins: Constraints) -> Iterator[ParallelDims]:
    """Each layout, and for long sequences the same with its data-parallel ranks split into cp
    context-parallel ones (cp adjacent to tp in the rank order, so a ring stays on a node's fast
    links when tp x cp fits in it)."""
    for dims in layouts:
        if pins.cp is not None:
            if pins.cp == 1 or dims.dp % pins.cp == 0:
                yield dataclasses.replace(dims, dp=dims.dp // pins.cp, cp=pins.cp)
            continue
        yield dims
        if train.seq_len >= MIN_CONTEXT_PARALLEL_TOKENS:
            for cp in divisors(dims.dp)[1:]:
                if train.seq_len % cp == 0:  # each engine's own rule: context_parallel_refusal
                    yield dataclasses.replace(dims, dp=dims.dp // cp, cp=cp)


def explain_empty_space(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                        pins: Constraints) -> DsautoError:
    """The error to show when no strategy satisfies the rules: names the first rule that fails."""
    world = cluster.world_size
    if pins.stage_layers is not None and (
            without := strategies_or_none(model, cluster, train, dataclasses.replace(pins, stage_layers=None))):
        layout = parse_stage_layers(pins.stage_layers, model.num_layers)
        shapes = sorted({(s.pp, s.virtual_stages) for s in without})
        # the reason of a shape the layout's count of stages or chunks names, where one does
        named = [(p, v) for p, v in shapes if layout is not None and len(layout) in (p, p * v)]
        reason = stage_layout_refusal(layout, model.num_layers, *(named or shapes)[0], chunked_layout(pins))
        tried = ", ".join(f"pp {p}" + (f" x vpp {v}" if v > 1 else "") for p, v in shapes[:6])
        return DsautoError(f"--stage-layers {pins.stage_layers} cannot run: {reason} (the other settings allow "
                           f"{tried}{' and more' if len(shapes) > 6 else ''}); pin a --pp (and --vpp) it fits, or "
                           f"leave --stage-layers out.")
    if (pins.tp or 1) > 1 and pins.engine != "deepspeed" and pins.sequence_parallel is not False and not (
            sequence_parallel_runs(train.seq_len, pins.tp, pins.cp, world)):
        tokens = f"{train.seq_len} tokens" + (f" / cp {pins.cp}" if (pins.cp or 1) > 1 else "")
        if pins.sequence_parallel or model.moe:  # else the space holds the plans without it
            needs = ("it is pinned on" if pins.sequence_parallel else
                     "an MoE model's tensor parallelism needs it (Megatron-core's token dispatch)")
            return DsautoError(f"Sequence parallelism splits each sequence's {tokens} over tp {pins.tp}, which does "
                               f"not divide them, and {needs}; pin a --seq-len that is a multiple of "
                               f"{sequence_parallel_multiple(pins.tp, pins.cp)}, or another --tp.")
    if (pins.ep or 1) > 1 or (pins.etp or 1) > 1:
        if not model.moe:
            return DsautoError(f"--ep {pins.ep or 1} --etp {pins.etp or 1} split experts, and {model.name} is "
                               f"not a mixture of experts; leave them out.")
        if pins.ep is not None and model.num_experts % pins.ep:
            return DsautoError(f"--ep {pins.ep} does not divide the {model.num_experts} experts of {model.name}; "
                               f"pin a divisor of {model.num_experts}.")
    if model.moe and pins.engine == "deepspeed":
        # DeepSpeed-MoE's own rules, on the degrees pinned (the rest at the values they leave open)
        pp = pins.pp or 1
        with contextlib.suppress(ValueError):  # degrees that do not fold are explained below
            reason = expert_parallel_refusal(
                "deepspeed", ParallelDims(dp=max(1, world // pp), pp=pp, ep=pins.ep or 1, etp=pins.etp or 1),
                pins.zero_stage if pins.zero_stage is not None else 1, False, model.num_experts,
                model.expert_ffn_hidden_size)
            pinned = " ".join(f"{option} {value}" for option, value in (
                ("--pp", pins.pp), ("--ep", pins.ep), ("--etp", pins.etp), ("--zero-stage", pins.zero_stage))
                if value is not None)
            if reason:
                return DsautoError(f"{pinned} cannot run: {reason}.")
    if model.moe and pins.sequence_parallel is False and (pins.tp or 1) > 1 and pins.engine != "deepspeed":
        # DeepSpeed plans have no tensor parallelism, so a pinned tp > 1 leaves Megatron-core alone
        reason = expert_parallel_refusal("megatron", ParallelDims(dp=max(1, world // pins.tp), tp=pins.tp), 1, False,
                                         model.num_experts, model.expert_ffn_hidden_size)
        return DsautoError(f"Sequence parallelism off (--no-sequence-parallel) cannot run with --tp {pins.tp}: "
                           f"{reason}; turn it on, or pin --tp 1.")
    if pins.tp is not None:
        problem = model.tp_problem(pins.tp)
        if problem:
            return DsautoError(f"Cannot use --tp {pins.tp} for {model.name}: {problem}; pin a TP degree "
                               f"that divides them.")
        if cluster.devices_per_node % pins.tp:
            return DsautoError(f"--tp {pins.tp} does not divide the {cluster.devices_per_node} devices of a "
                               f"node; tensor parallelism must stay inside a node.")
    if pins.pp is not None and pins.pp > model.num_layers:
        return DsautoError(f"--pp {pins.pp} exceeds the {model.num_layers} layers of {model.name}.")
    if pins.engine == "megatron" and (why := clamped_gate_refusal("megatron", model)):
        return DsautoError(f"--engine megatron cannot run {model.name}: {why}; plan it with --engine deepspeed.")
    if (pins.pp or 1) > 1 and pins.engine == "megatron" and (why := mtp_pipeline_refusal("megatron", pins.pp, model)):
        return DsautoError(f"--pp {pins.pp} cannot run {model.name} on Megatron-core: {why}; pin --pp 1, or untie "
                           f"the head (tied_embeddings false) in a model YAML.")
    tp, pp = pins.tp or 1, pins.pp or 1
    if world % (tp * pp):
        return DsautoError(f"tp({tp}) * pp({pp}) does not divide the world size {world} "
                           f"({cluster.nodes} node{'s' if cluster.nodes > 1 else ''} x {cluster.devices_per_node} devices); change --tp, "
                           f"--pp, --nodes or --gpus-per-node.")
    expert_ranks = (pins.ep or 1) * (pins.etp or 1)
    stage_ranks = world // pp
    if model.moe and expert_ranks > 1 and stage_ranks % expert_ranks:
        # Megatron-core folds ep x etp over a stage's tp x cp x dp ranks (ParallelDims), DeepSpeed-MoE
        # its ep over the data-parallel ranks
        return DsautoError(f"--ep {pins.ep or 1} x --etp {pins.etp or 1} = {expert_ranks} expert ranks do not divide "
                           f"the {stage_ranks} ranks of a pipeline stage ({world} devices / pp {pp}); pin an "
                           f"--ep that divides {stage_ranks}, or a smaller --pp.")
    if pins.fp8_param_gather and pins.fp8 and (
            without := strategies_or_none(model, cluster, train, dataclasses.replace(pins, fp8_param_gather=None))):
        if all(s.zero_stage == 0 for s in without):
            return DsautoError("--fp8-param-gather needs Megatron-core's distributed optimizer or Megatron-FSDP, and "
                               "every strategy the other settings allow has one data-parallel replica (ZeRO 0); "
                               "add devices for data parallelism or leave out --fp8-param-gather.")
    if pins.zero_stage is not None and pins.zero_stage >= 2 and pins.pp is not None and pins.pp > 1:
        pipelines = {"deepspeed": "DeepSpeed's pipeline engine supports", "megatron": "Megatron-core's pipelines support",
                     None: "DeepSpeed's and Megatron-core's pipelines support"}[pins.engine]
        return DsautoError(f"ZeRO stage {pins.zero_stage} cannot run with pipeline parallelism {pins.pp}: "
                           f"{pipelines} ZeRO 0 and 1 only; pin --zero-stage 1 or --pp 1.")
    if pins.engine is not None:
        dims = ParallelDims(dp=max(1, world // (tp * pp)), tp=tp, pp=pp)
        if pins.zero_stage == 0 and (reason := deepspeed_bf16_pipeline_refusal(pins.engine, dims, 0, train.dtype)):
            return DsautoError(f"--zero-stage 0 is not what DeepSpeed runs here: {reason}; pin --zero-stage 1 (which "
                               f"dsauto plans and prices so), --pp 1, or --dtype fp16.")
        reason = refusal(pins.engine, dims, pins.zero_stage or 0)
        # ZeRO 2-3 under a pipeline is refused above: what is left is DeepSpeed's tensor parallelism
        if reason and pins.hf_trainer:
            return DsautoError(f"A plan for Hugging Face's Trainer (--for hf) runs DeepSpeed, and {reason}; pin "
                               f"--tp 1, or plan without --for hf.")
        if reason:
            # ZeRO 2-3 under a pipeline and the bf16 pipeline are refused above: DeepSpeed's tp is left
            return DsautoError(f"--engine {pins.engine} cannot run this plan: {reason}; pin --tp 1, or plan with "
                               f"--engine megatron.")
    engines = ENGINES if pins.engine is None else (pins.engine,)
    refused = [pinned_option_refusals(e, pins, train, model, bool(cluster.device.fused_attention_efficiency))
               for e in engines]
    for flag, (why, remedy) in refused[-1].items():  # each a Megatron-core option: its reason, engine open or not
        if all(flag in other for other in refused):
            return DsautoError(f"{flag} cannot run: {why}; {remedy}.")
    if pins.expert_a2a_overlap and (
            without := strategies_or_none(model, cluster, train, dataclasses.replace(pins, expert_a2a_overlap=None))):
        if not any(a2a_overlap_runs(s) for s in without):
            return DsautoError("--moe-a2a-overlap needs expert parallelism (ep > 1) and, with pp > 1, the interleaved "
                               "schedule, and no strategy the other settings allow has both; pin --ep and --vpp, or "
                               "leave out --moe-a2a-overlap.")
    if pins.cp is not None and pins.cp > 1 and pins.cp_comm_type is not None and pins.engine != "deepspeed" and (
            why := cp_comm_type_refusal("megatron", pins.cp_comm_type, pins.cp, tp, model, train.seq_len)):
        return DsautoError(f"--cp-comm-type {pins.cp_comm_type} cannot run with --cp {pins.cp}: {why}; "
                           f"pin another --cp-comm-type{' or a smaller --cp' if 'tp x cp' in why else ''}, or leave "
                           f"it out.")
    if pins.cp is not None and pins.cp > 1:
        engines = ENGINES if pins.engine is None else (pins.engine,)
        learned = model.learned_positions
        reasons = [context_parallel_refusal(e, pins.cp, train.seq_len, train.flash_attention,
                                            heads=model.num_attention_heads, kv_heads=model.kv_heads, pp=pp,
                                            learned_positions=learned)
                   for e in engines]
        if all(reasons):
            # Ulysses under a pipeline or with learned positions is refused whatever the cp; the other
            # reasons name what cp must divide
            advice = ("pin --pp 1 or --engine megatron, or leave --cp out" if engines == ("deepspeed",) and pp > 1
                      else "pin --engine megatron, or leave --cp out" if engines == ("deepspeed",) and learned
                      else "pin a cp that divides them, or leave --cp out")
            said = dict(zip(engines, reasons))
            why = reasons[0] if len(engines) == 1 else (
                f"{said['deepspeed']} (DeepSpeed), and {said['megatron']} (Megatron-core)")
            return DsautoError(f"--cp {pins.cp} cannot run: {why}; {advice}.")
        if world % (tp * pp * pins.cp):
            return DsautoError(f"tp({tp}) * pp({pp}) * cp({pins.cp}) does not divide the world size {world}; "
                               f"change --cp, --tp or --pp.")
    if pins.offload not in (None, "none") or (pins.hpz or 1) > 1:
        dims = ParallelDims(dp=max(1, world // (tp * pp)), tp=tp, pp=pp)
        engine = pins.engine or "deepspeed"
        zero = pins.zero_stage if pins.zero_stage is not None else 3 if pins.offload == "optimizer+params" else 1
        reason = offload_refusal(engine, dims, zero, pins.offload or "none", host_problem(cluster),
                                 fp8_param_gather_recipe(pins))
        if reason:
            return DsautoError(f"--offload {pins.offload} cannot run: {reason}.")
        cp = pins.cp or 1
        with_cp = ParallelDims(dp=max(1, world // (tp * pp * cp)), tp=tp, pp=pp, cp=cp)  # hpZ needs cp 1 too
        reason = hpz_refusal(engine, with_cp, pins.zero_stage if pins.zero_stage is not None else 3, pins.hpz or 1,
                             cluster.devices_per_node)
        if reason:
            remedy = ("leave it out, or plan with tp, pp and cp 1" if with_cp.world_size != with_cp.dp
                      else "pin one that divides both, or leave it out")
            return DsautoError(f"--hpz {pins.hpz} cannot run: {reason}; {remedy}.")
    if (pins.dist_opt_instances or 1) > 1:
        dims = ParallelDims(dp=max(1, world // (tp * pp * (pins.cp or 1))), tp=tp, pp=pp, cp=pins.cp or 1)
        reason = dist_opt_instances_refusal(pins.engine or "megatron", dims,
                                            pins.zero_stage if pins.zero_stage is not None else 1,
                                            pins.dist_opt_instances or 1)
        if reason:
            return DsautoError(f"--dist-opt-instances {pins.dist_opt_instances} cannot run: {reason}.")
    if pins.vpp is not None and pins.vpp > 1:
        reason = virtual_stage_refusal(pins.engine or "megatron", pp, pins.vpp, pp)
        if reason:
            return DsautoError(f"--vpp {pins.vpp} cannot run: {reason}.")
        if pins.stage_layers is None and model.num_layers // pp < pins.vpp:
            accounted = [text for text, counted in ACCOUNTED_STAGES.items()
                         if accounted_chunks(model.num_layers, pp, pins.vpp, *counted) is not None]
            return DsautoError(f"--vpp {pins.vpp} cannot run on the layouts the search tries: they give each model "
                               f"chunk a layer, and {model.num_layers} layers over pp {pp} leave {model.num_layers // pp} "
                               f"a stage; pin --stage-layers "
                               + (f"{accounted[0]} (Megatron-core's even split counting the embedding and the loss "
                                  f"as layers) or counts " if accounted else "")
                               + "(a chunk may then hold none: Megatron-core's --pipeline-model-parallel-layout "
                               "runs it) or lower --vpp.")
        replicas = world // (tp * pp * (pins.cp or 1))
        m = train.global_batch // (replicas * pins.micro_batch) if replicas and pins.micro_batch else 0
        if pp > 1 and pins.tp and pins.engine != "deepspeed" and m and m % pp and (
                train.global_batch % (replicas * pins.micro_batch) == 0):
            return DsautoError(f"--vpp {pins.vpp} cannot run: the interleaved schedule needs the micro-batches of a step "
                               f"to be a multiple of pp {pp}, and global batch {train.global_batch} / (dp {replicas} x "
                               f"micro-batch {pins.micro_batch}) gives {m}; change --global-batch, --micro-batch or "
                               f"--pp.")
        if not (pins.tp and m and m % pp == 0):  # else another pin empties the space: the checks below name it
            return DsautoError(f"--vpp {pins.vpp} cannot run: the interleaved schedule needs Megatron-core, "
                               f"pp > 1 and micro-batches per step a multiple of pp; change --pp, --micro-batch "
                               f"or --global-batch.")
    if pins.recompute_modules is not None and parse_recompute_modules(pins.recompute_modules, model, pins.engine,
                                                                      pins.fp8_delayed):
        if pins.checkpoint is True:
            return DsautoError(f"--recompute-modules {pins.recompute_modules} recomputes parts of every transformer "
                               f"layer and --checkpoint all recomputes them whole; a layer runs one of "
                               f"the two, so drop one.")
    if pins.micro_batch is not None:
        return DsautoError(f"No data-parallel degree allowed by the other settings divides the global "
                           f"batch {train.global_batch} into micro-batches of {pins.micro_batch}; change "
                           f"--micro-batch or --global-batch.")
    return DsautoError(f"No data-parallel degree allowed by the other settings divides the global batch "
                       f"{train.global_batch} on {world} devices; use a global batch divisible by the "
                       f"data-parallel degree (world / (tp * pp)).")


def layer_options(strategy: Strategy) -> tuple[LayerOption, ...]:
    """Every per-layer option under ``strategy`` (the groups then restrict them, see ``allowed``).
    Under selective recomputation (``strategy.recompute_modules``) no layer is checkpointed whole,
    and the transformer layers' options carry the modules (the embedding and head take the others)."""
    if strategy.zero_stage == 3 and strategy.dims.replicas > 1:
        shard_values = (False, True) if per_layer_residency(strategy.engine) else (True,)
    else:
        shard_values = (False,)
    # DeepSpeed's pipeline engine applies the loss (PipelineModule.loss_fn) to the last layer's whole
    # output, so its head cannot chunk the loss (deepspeed/runtime/pipe/engine.py, _exec_forward_pass);
    # Megatron-core splits no operator (dsauto's plugin runs them whole: dsauto.runtime.megatron).
    splits = (1,) if strategy.engine == "megatron" or strategy.pp > 1 else SPLITS
    if strategy.recompute_modules:
        return tuple(LayerOption(checkpoint=False, shard_params=s, split=k, recompute_modules=r)
                     for r in ((), strategy.recompute_modules) for s in shard_values for k in splits)
    return tuple(LayerOption(checkpoint=c, shard_params=s, split=k)
                 for c in (False, True) for s in shard_values for k in splits)


SEARCHED_RECOMPUTE = {False: ("core_attn",), True: ()}
"""The selective recomputation the search tries, by whether attention is fused: Korthikanti et al.'s
attention core under eager attention, where its s x s scores are 5as/h of a layer's sbh(34 + 5as/h)
bytes (2022, Table 2 and Sec. 5); none under a fused kernel, which keeps no scores, and where the
other modules free a smaller share (the norms' outputs 4 of the 34, the MLP's 16 of them at the
price of two thirds of the layer's forward). A pin (``--recompute-modules``) asks for any set."""


def parse_recompute_modules(text: str, model: ModelSpec | None = None,
                            engine: Engine | None = None, fp8_delayed: bool = False) -> tuple[str, ...]:
    """The modules of a ``--recompute-modules`` value (``"none"``: no selective recomputation); a
    name dsauto does not know, or that ``engine`` (None: either) cannot recompute for ``model``, is
    refused in one sentence."""
    if text.strip().lower() in ("", "none"):
        return ()
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    for name in names:
        if reason := _module_refusal(name, model, engine, fp8_delayed):
            raise DsautoError(f"--recompute-modules {text}: {reason}.")
    return names


def _module_refusal(name: str, model: ModelSpec | None, engine: Engine | None,
                    fp8_delayed: bool = False) -> str | None:
    """:func:`recompute_module_refusal` with what it asks of ``model`` (None: not known) read from it."""
    if model is None:
        return recompute_module_refusal(name, engine=engine, fp8_delayed=fp8_delayed)
    return recompute_module_refusal(name, model.linear_bias, engine, model.moe, fp8_delayed,
                                    model.norm_position == "pre", model.latent_attention,
                                    model.shared_expert_ffn_hidden_size > 0)


EVEN_STAGES = "even"
"""The ``--stage-layers`` value for Megatron-core's own split: the transformer layers divided evenly
over the pp x vpp model chunks (megatron/core/transformer/transformer_block.py, get_num_layers_to_build,
which asserts that they divide when no layout flag is given)."""


def accounted_stage_layers(text: str, num_layers: int, pp: int | None, vpp: int | None) -> str:
    """The per-chunk counts (per stage without virtual stages) of the ``--stage-layers`` value ``text``,
    one of :data:`dsauto.plan.ACCOUNTED_STAGES` (:func:`dsauto.plan.accounted_chunks`), refused in one sentence
    without a pinned --pp or where Megatron-core refuses the split."""
    embedding, loss = ACCOUNTED_STAGES[text]
    if pp is None:
        raise DsautoError(f"--stage-layers {text} splits the layers evenly over the pinned pipeline ranks; pin --pp "
                          f"(and --vpp for virtual stages).")
    counts = accounted_chunks(num_layers, pp, vpp or 1, embedding, loss)
    if counts is None:
        counted = " + ".join(name for name, on in (("the embedding", embedding), ("the loss", loss)) if on)
        raise DsautoError(f"--stage-layers {text} splits {num_layers} transformer layers + {counted} = "
                          f"{num_layers + embedding + loss} evenly over pp {pp} x vpp {vpp or 1} = {pp * (vpp or 1)} "
                          f"model chunks, which Megatron-core refuses as they do not divide; change --pp or --vpp, or "
                          f"give the counts.")
    return ",".join(str(count) for count in counts)


def parse_stage_layers(text: str, num_layers: int) -> tuple[int, ...] | None:
    """The transformer layers per pipeline stage that a ``--stage-layers`` value names, or None for
    :data:`EVEN_STAGES`; a malformed value, or counts that do not add up to ``num_layers``, is
    refused in one sentence."""
    counts = _stage_counts(text)
    if counts is None:
        return None
    if sum(counts) != num_layers:
        raise DsautoError(f"--stage-layers {text} places {sum(counts)} transformer layers and the model has "
                          f"{num_layers}; give counts that add up to {num_layers}, or '{EVEN_STAGES}'.")
    return counts


def _stage_counts(text: str) -> tuple[int, ...] | None:
    """The counts of a ``--stage-layers`` value, or None for :data:`EVEN_STAGES`."""
    if text.strip().lower() == EVEN_STAGES:
        return None
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise DsautoError(f"--stage-layers {text}: give '{EVEN_STAGES}' or one whole number of transformer layers "
                          f"per pipeline stage, comma-separated (such as 8,8,8,8).") from None
    if min(counts) < 0:
        raise DsautoError(f"--stage-layers {text}: a count of transformer layers cannot be negative.")
    return counts


def stage_layout_refusal(layout: tuple[int, ...] | None, num_layers: int, pp: int,
                         virtual_stages: int, chunked: bool = False) -> str | None:
    """Why a pinned layout (:func:`parse_stage_layers`: the counts, or None for the even split) cannot
    place ``num_layers`` transformer layers on pp ranks of ``virtual_stages`` model chunks each; None
    when it can. Counts per rank split over the rank's chunks as :func:`dsauto.plan.chunk_layers` does;
    ``chunked`` counts (:func:`chunked_layout`) are the chunks' own, in chunk order. A chunk may hold
    no layer (Megatron-core's layout string runs it), a rank may not."""
    if layout is None:
        if num_layers % (pp * virtual_stages):
            chunks = f"pp {pp} x vpp {virtual_stages} = {pp * virtual_stages}" if virtual_stages > 1 else f"pp {pp}"
            return f"{num_layers} transformer layers do not split evenly over {chunks} model chunks"
        return None
    if chunked:
        if len(layout) != pp * virtual_stages:
            return f"its {len(layout)} model chunks are not pp {pp} x vpp {virtual_stages}"
        ranks = rank_totals(layout, pp, virtual_stages)
        if min(ranks) < 1:
            return f"it leaves pipeline rank {ranks.index(min(ranks))} without a transformer layer"
        return None
    if len(layout) != pp:
        chunks = (f" ({len(layout)} counts are model chunks only with --pp {pp} --vpp {virtual_stages} pinned)"
                  if virtual_stages > 1 and len(layout) == pp * virtual_stages else "")
        return f"it names {len(layout)} stage{'s' if len(layout) > 1 else ''} and the plan has pp {pp}{chunks}"
    if min(layout) < 1:
        return "every pipeline stage needs at least one transformer layer"
    return None


def chunked_layout(pins: Constraints) -> bool:
    """Whether ``--stage-layers`` gives one count per model chunk: pp x vpp counts with both --pp and
    --vpp pinned (vpp > 1); any other count list gives one per pipeline rank."""
    counts = None if pins.stage_layers is None else _stage_counts(pins.stage_layers)
    return (counts is not None and pins.pp is not None and pins.vpp is not None and pins.vpp > 1
            and len(counts) == pins.pp * pins.vpp)


def pinned_stage_layers(pins: Constraints, num_layers: int, pp: int,
                        virtual_stages: int = 1) -> tuple[int, ...] | None:
    """The transformer layers of each pipeline rank that ``pins`` sets (for a strategy that
    :func:`strategies` kept), or None when the search balances them."""
    if pins.stage_layers is None:
        return None
    layout = parse_stage_layers(pins.stage_layers, num_layers) or (num_layers // pp,) * pp
    return tuple(rank_totals(layout, pp, virtual_stages)) if chunked_layout(pins) else layout


def pinned_chunk_layout(pins: Constraints) -> tuple[int, ...] | None:
    """The layers of each model chunk that ``pins`` sets (on its pinned --pp and --vpp) where they split a
    rank's layers otherwise than evenly (:attr:`dsauto.plan.Plan.chunk_layout`), or None."""
    if not chunked_layout(pins):
        return None
    layout = _stage_counts(pins.stage_layers)
    stages = rank_totals(layout, pins.pp, pins.vpp)
    return None if even_chunks(stages, pins.vpp, layout) else layout


def recompute_module_sets(engine: Engine, model: ModelSpec, train: TrainSpec,
                          pins: Constraints) -> tuple[tuple[str, ...], ...]:
    """The selective recomputations the search tries for ``engine``, as strategy-wide module sets
    (empty: none, whole layers checkpointed or not per layer): the pinned one, or none and
    :data:`SEARCHED_RECOMPUTE`, less what ``engine`` cannot recompute for ``model``
    (:func:`recompute_module_refusal`). Megatron-core runs them through ``recompute_modules``, DeepSpeed
    through the dsauto hook (dsauto.runtime.recompute). A mixture of experts on Megatron-core also
    tries ``moe_act``: it frees top-k x the expert width of each token's activations in every MoE
    layer for one elementwise pass in backward; latent attention on Megatron-core ``mla_up_proj``:
    it frees the queries, keys and values of every head (DeepSeek-V3: 128 heads of 192 + 192 + 128)
    for the up projections' matrix multiplies again, as NVIDIA's DeepSeek-V3 recipes recompute them
    (Megatron-Bridge's perf_recipes/deepseek/b200/deepseek_v3.py, NeMo's llm/recipes/deepseek_v3.py).
    One set of them all: the per-layer choice is that set or none."""
    if pins.recompute_modules is not None:
        modules = parse_recompute_modules(pins.recompute_modules, model, pins.engine, pins.fp8_delayed)
        if modules and (pins.checkpoint is True
                        or any(_module_refusal(m, model, engine, pins.fp8_delayed) for m in modules)):
            return ()
        return (modules,)
    extra = (("moe_act",) if model.moe else ()) + (("mla_up_proj",) if model.latent_attention else ())
    searched = tuple(m for m in SEARCHED_RECOMPUTE[train.flash_attention] + extra
                     if _module_refusal(m, model, engine, pins.fp8_delayed) is None
                     and not (pins.hf_trainer and hf_trainer_refusal(recompute_modules=(m,))))
    if pins.checkpoint is True or pins.recompute_num_layers is not None or not searched:
        return ((),)
    return ((), searched)


def pinned_hf_trainer_refusal(pins: Constraints, model: ModelSpec) -> str | None:
    """Why a pin cannot run in a ``transformers`` model under Hugging Face's Trainer (the pin and the
    rule's reason, :func:`dsauto.engines.rules.hf_trainer_refusal`), or None. The search leaves all
    of these out; this names a pin that asks for one."""
    if why := hf_trainer_refusal(engine=pins.engine or "deepspeed"):
        return f"--engine {pins.engine}: {why}"
    modules = parse_recompute_modules(pins.recompute_modules, model, None, pins.fp8_delayed) \
        if pins.recompute_modules is not None else ()
    if megatron_only := [m for m in modules if _module_refusal(m, model, "deepspeed", pins.fp8_delayed)]:
        return (f"--recompute-modules {pins.recompute_modules}: Hugging Face's Trainer runs DeepSpeed, which does not "
                f"recompute {', '.join(megatron_only)} (Megatron-core's)")
    for pin, why in ((f"--pp {pins.pp}", hf_trainer_refusal(pp=pins.pp or 1)),
                     (f"--cp {pins.cp}", hf_trainer_refusal(cp=pins.cp or 1)),
                     (f"--ep {pins.ep}", hf_trainer_refusal(ep=pins.ep or 1)),
                     (f"--recompute-modules {pins.recompute_modules}", hf_trainer_refusal(recompute_modules=modules))):
        if why:
            return f"{pin}: {why}"
    return None


def recompute_num_layers_refusal(pins: Constraints) -> str | None:
    """Why ``--recompute-num-layers`` cannot go with the other pins (the rest of a sentence), or None.
    Megatron-core's block method recomputes whole layers, so it excludes selective recomputation
    (TransformerConfig: recompute_num_layers must be None under the selective granularity) and the
    expert all-to-alls' overlap (which asserts recompute_num_layers None); --checkpoint already says
    which layers to checkpoint."""
    n = pins.recompute_num_layers
    if n is None:
        return None
    if pins.checkpoint is not None:
        which = "all" if pins.checkpoint else "none"
        return (f"and --checkpoint {which} both say which transformer layers to checkpoint; keep one of the two "
                f"(--checkpoint all is an N of at least a stage's layers)")
    if pins.recompute_modules is not None and parse_recompute_modules(pins.recompute_modules):
        return (f"checkpoints whole layers and --recompute-modules {pins.recompute_modules} recomputes parts of "
                f"every layer; Megatron-core runs one of the two, so drop one")
    if pins.expert_a2a_overlap:
        return ("recomputes whole layers, which Megatron-core refuses beside the expert all-to-alls' overlap "
                "(--moe-a2a-overlap); drop one of the two")
    return None


def allowed(kind: str, option: LayerOption, pins: Constraints, recompute: tuple[str, ...] = ()) -> bool:
    """Which options a layer of ``kind`` (:attr:`LayerGroup.kind`: ``embedding``, ``transformer`` or
    ``head``) may take.

    Checkpointing applies to transformer layers (the embedding and head keep little and the head's
    memory is cut by splitting instead). Splitting applies to the head's loss (OSDP's chunked
    computation; the logits dominate its memory) and, up to 4 slices, to layers whose parameters
    ZeRO-3 gathers (the gathered block shrinks); elsewhere it would cost time for nothing.
    ``recompute``: the modules the strategy recomputes selectively (``Strategy.recompute_modules``),
    which every transformer layer then takes and the embedding and head do not.
    """
    transformer = kind not in ("embedding", "head")
    if option.checkpoint and not transformer:
        return False
    # Selective recomputation re-runs parts of transformer layers, all of them (``recompute``, the
    # strategy's modules: Megatron-core has one recompute granularity for every layer).
    if option.recompute_modules != (recompute if transformer else ()):
        return False
    if transformer and pins.checkpoint is not None and option.checkpoint != pins.checkpoint:
        return False
    if transformer and pins.expert_a2a_overlap and option.checkpoint:
        return False  # Megatron-core refuses full recomputation beside the expert all-to-alls' overlap
    if pins.hf_trainer and hf_trainer_refusal(split=option.split):
        return False
    if kind == "head":
        return True
    return option.split == 1 or (option.shard_params and option.split <= 4)
