"""Planning from Python: the search behind ``dsauto tune``, as a few typed functions.

The package exports them with the emitters they feed (``dsauto.make_plan``, ``dsauto.find_plans``,
``dsauto.write_artifacts``, ``dsauto.ds_config``, ...; see ``dsauto/__init__.py`` for an example).
The command line builds its problem with :func:`make_problem` and searches with
:func:`find_plans`, so the two share every default. The knobs of :func:`make_problem` are the
fields of :class:`~dsauto.spec.training.TrainSpec` and :class:`~dsauto.search.space.Constraints`
by name (``tests/test_api.py`` holds them to it), plus the cluster's size and memory limit.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dsauto.errors import DsautoError, DsautoWarning
from dsauto.plan import ACCOUNTED_STAGES
from dsauto.search.space import Constraints, accounted_stage_layers, sequence_parallel_multiple, sequence_parallel_runs
from dsauto.spec.cluster import ClusterSpec, HardwareSpec
from dsauto.spec.loaders import ModelSource, as_model, load_cluster, override_cluster
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import Dtype, TrainSpec

if TYPE_CHECKING:
    from dsauto.plan import (AttentionKernel, CpCommType, Engine, ExpertDispatcher, Fp8Recipe, MomentsDtype, Offload,
                             Plan)
    from dsauto.profile.store import Profile
    from dsauto.search.planner import Progress

# Importing this module stays light (the command line reads the defaults below while it builds its
# options); the search, the emitters and the profile store are imported when used.

DEFAULT_MODEL = "gpt-tiny"
"""The model planned when none is named: tiny enough to train on two CPU ranks."""
DEFAULT_HARDWARE = "cpu"
"""The hardware planned for when none is named: the CPU preset (two ranks), so it runs anywhere."""
DEFAULT_SEQ_LEN = 2048
"""Sequence length when none is given, capped at the model's maximum."""
DEFAULT_MIN_GLOBAL_BATCH = 8
"""Smallest default global batch; larger clusters default to one sequence per rank."""

DEFAULT_TEXT = {
    "global_batch": f"max({DEFAULT_MIN_GLOBAL_BATCH}, world size)",
    "seq_len": f"min({DEFAULT_SEQ_LEN}, the model's maximum)",
    "dtype": "the hardware's",
}
"""How the defaults computed here read in ``--help`` (by TrainSpec field name)."""


@dataclass(frozen=True)
class Problem:
    """What one search plans for."""

    model: ModelSpec
    """The model to train."""
    cluster: ClusterSpec
    """The cluster to train it on, with its memory budget."""
    train: TrainSpec
    """The workload: batch, sequence length, dtype, attention kernel."""
    pins: Constraints
    """The choices the user fixed; the search makes the rest."""


def default_seq_len(model: ModelSpec, seq_len: int | None = None) -> int:
    """``seq_len``, or min(2048, the model's maximum) when it is None. Longer than the model's
    positions: a DsautoError for learned position embeddings (the table has no row for them); a
    warning for rotary positions or ALiBi, where training at a longer length is how a context is
    extended (Llama 3.1 extended Llama 3's 8K to 128K that way)."""
    seq_len = min(DEFAULT_SEQ_LEN, model.max_position_embeddings) if seq_len is None else seq_len
    if seq_len > model.max_position_embeddings and model.position_embedding != "learned":
        # ALiBi's biases grow with the distance and need no setting; rotary positions are rescaled
        how = ("" if model.position_embedding == "alibi" else
               " (set its rotary base or scaling for that length in your training script)")
        warnings.warn(f"{model.name} was trained with {model.max_position_embeddings} positions; planning "
                      f"{seq_len}-token sequences extends its context{how}.", DsautoWarning, stacklevel=2)
    elif seq_len > model.max_position_embeddings:
        raise DsautoError(f"Sequences of {seq_len} tokens exceed the {model.max_position_embeddings} positions "
                          f"{model.name} supports; give a sequence length (--seq-len) of at most "
                          f"{model.max_position_embeddings}.")
    return seq_len


def default_global_batch(cluster: ClusterSpec, global_batch: int | None = None) -> int:
    """``global_batch``, or max(8, world size) when it is None: one sequence per rank at least."""
    return max(DEFAULT_MIN_GLOBAL_BATCH, cluster.world_size) if global_batch is None else global_batch


def make_problem(
    model: ModelSource = DEFAULT_MODEL,
    hardware: str | os.PathLike[str] | ClusterSpec | HardwareSpec = DEFAULT_HARDWARE,
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    memory_limit: int | str | None = None,
    global_batch: int | None = None,
    seq_len: int | None = None,
    dtype: Dtype | None = None,
    flash_attention: bool = True,
    tp: int | None = None,
    pp: int | None = None,
    zero_stage: int | None = None,
    micro_batch: int | None = None,
    checkpoint: bool | None = None,
    sequence_parallel: bool | None = None,
    cp: int | None = None,
    vpp: int | None = None,
    engine: Engine | None = None,
    ep: int | None = None,
    etp: int | None = None,
    offload: Offload | None = None,
    hpz: int | None = None,
    dist_opt_instances: int | None = None,
    recompute_modules: str | None = None,
    attention_kernel: AttentionKernel | None = None,
    tp_comm_overlap: bool | None = None,
    grad_reduce_in_fp32: bool | None = None,
    overlap_grad_reduce: bool | None = None,
    overlap_param_gather: bool | None = None,
    precision_aware_optimizer: MomentsDtype | None = None,
    attention_softmax_in_fp32: bool | None = None,
    expert_dispatcher: ExpertDispatcher | None = None,
    expert_load_balanced: bool | None = None,
    expert_capacity_factor: float | None = None,
    expert_pad_to_capacity: bool | None = None,
    fp8: bool | None = None,
    fp8_recipe: Fp8Recipe | None = None,
    fp8_param_gather: bool | None = None,
    cp_comm_type: CpCommType | None = None,
    expert_a2a_overlap: bool | None = None,
    stage_layers: str | Sequence[int] | None = None,
    recompute_num_layers: int | None = None,
    hf_trainer: bool | None = None,
) -> Problem:
    """The model, cluster, workload and pins of one search, with dsauto's defaults filled in.

    Args:
        model: a model preset name (``"llama3-8b"``), the path of a dsauto model YAML or of a
            Hugging Face ``config.json`` (or its folder), a ModelSpec, a ``transformers`` config
            object (``AutoConfig.from_pretrained(...)``), or a ``config.json`` as a dict.
        hardware: a hardware preset name (``"h100-80gb"``), the path of a cluster YAML, or a
            ClusterSpec or HardwareSpec.
        nodes: number of nodes (default: the cluster's, 1 for a preset).
        gpus_per_node: devices per node (default: the hardware's).
        memory_limit: per-device budget in bytes or as text such as ``"60GiB"`` (default: device
            memory minus its reserve).
        global_batch: sequences per optimizer step (default: max(8, world size)).
        seq_len: tokens per sequence (default: min(2048, the model's maximum)).
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (default: the hardware's).
        flash_attention: price fused attention; False prices eager attention, which keeps the
            s x s scores.
        tp: pin the tensor-parallel degree (default: searched).
        pp: pin the pipeline-parallel degree (default: searched).
        zero_stage: pin the ZeRO stage, 0-3 (default: searched).
        micro_batch: pin the micro-batch size (default: searched).
        checkpoint: checkpoint every transformer layer (True) or none (False); None lets the
            search choose per layer.
        sequence_parallel: False disables Megatron sequence parallelism when tp > 1; None or True
            keeps it on.
        cp: pin the context-parallel degree (Megatron's ring attention, DeepSpeed-Ulysses for a
            DeepSpeed plan; default: searched for sequences of 16384 tokens and more).
        vpp: pin the virtual pipeline stages per rank (Megatron's interleaved 1F1B; default:
            searched).
        engine: ``"deepspeed"`` or ``"megatron"``, the engine the plan is for; None plans for both
            and keeps the faster.
        ep: pin the expert-parallel degree of a mixture of experts (Megatron-core; folds inside
            tp x cp x dp; default: searched for MoE models, 1 for dense ones).
        etp: pin the expert tensor-parallel degree (default: searched among 1 and tp).
        offload: ``"none"``, ``"optimizer"`` or ``"optimizer+params"`` (DeepSpeed ZeRO-3): what to
            keep in host memory (default: the optimizer of a strategy that fits only so).
        hpz: pin ZeRO++'s hierarchical partition size (DeepSpeed ZeRO-3; default: searched).
        dist_opt_instances: pin the instances of Megatron-core's partial distributed optimizer
            (``--num-distributed-optimizer-instances``; default: searched).
        recompute_modules: selective recomputation in every transformer layer, comma-separated
            modules among ``core_attn``, ``layernorm`` and ``mlp`` (Megatron-core's names; the
            DeepSpeed hook checkpoints the same modules), or ``"none"`` (default: searched).
        attention_kernel: ``"flash"`` (FlashAttention) or ``"cudnn"`` (cuDNN's fused attention
            through Transformer Engine, Megatron-core plans only); None: cudnn for Megatron-core on
            devices that have it (Hopper), as Transformer Engine picks there, and for latent
            attention wherever cuDNN takes its heads (Transformer Engine's FlashAttention does not
            run it); flash otherwise.
        tp_comm_overlap: True turns on Megatron-core's ``--tp-comm-overlap`` where the plan has tp > 1
            with sequence parallelism (Megatron-core plans only; default: off).
        grad_reduce_in_fp32: False keeps and reduces gradients in bf16 (Megatron-core's
            ``--grad-reduce-in-bf16``, bf16 plans only; default: fp32).
        overlap_grad_reduce: False prices Megatron-core's gradient reduction after the backward and its
            parameter gather after the optimizer step, exposed, as a launch without
            ``--overlap-grad-reduce`` runs them (Megatron-core plans of ZeRO 0-1); default: overlapped.
        overlap_param_gather: False prices the distributed optimizer's parameter gather after the
            optimizer step, exposed, as a launch without ``--overlap-param-gather`` runs it; default:
            overlapped unless ``overlap_grad_reduce`` is False.
        precision_aware_optimizer: the dtype of Adam's moments under Megatron-core's precision-aware
            optimizer (``--use-precision-aware-optimizer``, Transformer Engine's FusedAdam, the fp32
            main weights kept as remainders; bf16 Megatron-core plans with ZeRO 1); None: off.
        attention_softmax_in_fp32: False prices Megatron-core's unfused attention (``flash_attention``
            False) with its softmax in 16 bits, no fp32 copy of the scores kept, as Megatron-LM's launches
            run it by default (16-bit Megatron-core plans); None: fp32, as dsauto's plugin runs it.
        expert_dispatcher: ``deepep`` dispatches a mixture of experts' tokens with DeepEP
            (Megatron-core's flex dispatcher; DeepEP installed apart); None: ``alltoall``.
        expert_load_balanced: True prices a mixture of experts' routing forced to balance
            (Megatron-core's ``--moe-router-force-load-balancing``, a benchmarking option that changes
            what the model learns); None: off, the busiest expert-parallel rank carrying 1.1x the mean.
        expert_capacity_factor: each expert takes at most this times its mean share of a rank's routed
            tokens and drops the rest (Megatron-core's ``--moe-expert-capacity-factor``); None: dropless.
        expert_pad_to_capacity: True fills every expert to its capacity (Megatron-core's
            ``--moe-pad-expert-input-to-capacity``); needs ``expert_capacity_factor``.
        fp8: True trains the transformer layers' linear layers in FP8 (Megatron-core's
            ``--fp8-format hybrid`` through Transformer Engine; bf16 or fp16 Megatron-core plans on
            devices with an ``fp8`` peak, H100 and H200); None: off.
        fp8_recipe: ``"delayed"`` (default, Megatron-core's) or ``"tensorwise"`` (current scaling), the
            FP8 scaling recipe; needs ``fp8``.
        fp8_param_gather: True keeps the transformer layers' weights in FP8, gathered at one byte a
            parameter (Megatron-core's ``--fp8-param-gather``); needs ``fp8`` and ZeRO 1-3.
        cp_comm_type: how a Megatron-core plan's context parallelism exchanges the shards of a
            sequence: ``"p2p"`` (a ring), ``"all_gather"`` or ``"a2a"`` (Megatron-core's
            ``--cp-comm-type``); None: the search prices each that runs and keeps the fastest.
        expert_a2a_overlap: True overlaps a mixture of experts' all-to-alls with another
            micro-batch's compute (Megatron-core's ``--overlap-moe-expert-parallel-comm``; needs ep > 1,
            the interleaved schedule when pp > 1, no full recomputation); None: off.
        stage_layers: the transformer layers of each pipeline stage, first stage first (a sequence,
            or the same comma-separated), or ``"even"``: split evenly over the pp x vpp model chunks,
            as Megatron-core does without a layout flag, or ``"even+embedding"``, ``"even+loss"``,
            ``"even+embedding+loss"``: that split counting them as layers (Megatron-LM's
            ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``;
            needs ``pp``); None: balanced by the search.
        recompute_num_layers: N checkpoints the first N transformer layers of every pipeline stage (of
            every model chunk with virtual stages) and no others, Megatron-core's ``--recompute-method
            block --recompute-num-layers N``; None: chosen per layer by the search.
        hf_trainer: True plans for Hugging Face's Trainer or accelerate, what dsauto's hook applies to a
            ``transformers`` model they hand to DeepSpeed (``dsauto tune --for hf``): DeepSpeed's
            engine, one pipeline stage, no DeepSpeed-Ulysses, no attention-core recomputation, no
            operator splitting; None: any plan.

    Raises:
        DsautoError: an unknown preset, a bad file, a memory limit over the device's memory, or a
            sequence longer than the model's positions, as one sentence.
    """
    model_spec = as_model(model)
    if isinstance(hardware, (ClusterSpec, HardwareSpec)):
        cluster = hardware if isinstance(hardware, ClusterSpec) else ClusterSpec(hardware)
        cluster = override_cluster(cluster, nodes, gpus_per_node, memory_limit)
    else:
        cluster = load_cluster(os.fspath(hardware), nodes=nodes, gpus_per_node=gpus_per_node,
                               memory_limit=memory_limit)
    try:
        train = TrainSpec(global_batch=default_global_batch(cluster, global_batch),
                          seq_len=default_seq_len(model_spec, seq_len),
                          dtype=dtype or cluster.hardware.dtype,  # type: ignore[arg-type]
                          flash_attention=flash_attention)
    except ValueError as exc:  # out of the bounds of dsauto/spec/limits.py
        option = {"seq_len": "--seq-len", "dtype": "--dtype", "flash_attention": "--no-flash-attention"}.get(
            str(exc).split(" ")[0], "--global-batch")
        raise DsautoError(f"The workload is not one dsauto plans: {exc}; change {option}.") from None
    if isinstance(stage_layers, str) and stage_layers.strip().lower() in ACCOUNTED_STAGES:
        vpp = vpp or 1  # Megatron-core splits so only the chunks it is given: none beyond one a rank unless pinned
        stage_layers = accounted_stage_layers(stage_layers.strip().lower(), model_spec.num_layers, pp, vpp)
    pins = Constraints(tp=tp, pp=pp, zero_stage=zero_stage, micro_batch=micro_batch, checkpoint=checkpoint,
                       sequence_parallel=sequence_parallel, cp=cp, vpp=vpp, engine=engine, ep=ep, etp=etp,
                       offload=offload, hpz=hpz, dist_opt_instances=dist_opt_instances,
                       recompute_modules=recompute_modules, attention_kernel=attention_kernel,
                       tp_comm_overlap=tp_comm_overlap, grad_reduce_in_fp32=grad_reduce_in_fp32,
                       overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
                       precision_aware_optimizer=precision_aware_optimizer,
                       attention_softmax_in_fp32=attention_softmax_in_fp32,
                       expert_dispatcher=expert_dispatcher, expert_load_balanced=expert_load_balanced,
                       expert_capacity_factor=expert_capacity_factor, expert_pad_to_capacity=expert_pad_to_capacity,
                       fp8=fp8,
                       fp8_recipe=fp8_recipe, fp8_param_gather=fp8_param_gather, cp_comm_type=cp_comm_type,
                       expert_a2a_overlap=expert_a2a_overlap,
                       stage_layers=stage_layers if stage_layers is None or isinstance(stage_layers, str)
                       else ",".join(str(count) for count in stage_layers),
                       recompute_num_layers=recompute_num_layers, hf_trainer=hf_trainer)
    if tp_comm_overlap and sequence_parallel is False:
        raise DsautoError("--tp-comm-overlap overlaps the tensor-parallel collectives of sequence parallelism, and "
                          "--no-sequence-parallel turns it off; leave out one of them.")
    if fp8_recipe is not None and not fp8:
        raise DsautoError(f"--fp8-recipe {fp8_recipe} sets how FP8 training scales its tensors, and FP8 is off; "
                          f"add --fp8 or leave out --fp8-recipe.")
    if cp_comm_type not in (None, "p2p") and cp == 1:
        raise DsautoError(f"--cp-comm-type {cp_comm_type} exchanges the shards of context parallelism, and --cp 1 "
                          f"has none; pin --cp 2 or more, or leave out --cp-comm-type.")
    if (expert_pad_to_capacity and expert_capacity_factor is not None and model_spec.moe
            and expert_capacity_factor > model_spec.num_experts / model_spec.moe_top_k):
        raise DsautoError(f"--moe-expert-capacity-factor {expert_capacity_factor:g} with "
                          f"--moe-pad-expert-input-to-capacity fills each of the {model_spec.num_experts} experts past "
                          f"all of a rank's tokens (a factor over experts / top-k = "
                          f"{model_spec.num_experts / model_spec.moe_top_k:g}); give a factor of at most that.")
    if expert_pad_to_capacity and expert_capacity_factor is None:
        raise DsautoError("--moe-pad-expert-input-to-capacity fills the experts to their capacity, and no "
                          "--moe-expert-capacity-factor sets one; add it or leave out "
                          "--moe-pad-expert-input-to-capacity.")
    if fp8_param_gather and not fp8:
        raise DsautoError("--fp8-param-gather keeps the weights in FP8, and FP8 is off; add --fp8 or leave out "
                          "--fp8-param-gather.")
    if fp8_param_gather and zero_stage == 0:
        raise DsautoError("--fp8-param-gather needs Megatron-core's distributed optimizer or Megatron-FSDP, which "
                          "--zero-stage 0 turns off; pin --zero-stage 1 to 3 or leave out --fp8-param-gather.")
    if fp8 and "fp8" not in cluster.device.peak_flops:
        raise DsautoError(f"{cluster.device.name} has no FP8 peak FLOP/s (its peak_flops give "
                          f"{', '.join(cluster.device.peak_flops)}), so FP8 training cannot be priced on it; leave "
                          f"out --fp8, or plan for a device with FP8 tensor cores (h100-80gb, h200).")
    if (tp or 1) > 1 and engine != "deepspeed" and sequence_parallel is None and not model_spec.moe and not (
            sequence_parallel_runs(train.seq_len, tp, cp, cluster.world_size)):
        warnings.warn(f"Megatron-core plans run without sequence parallelism: it splits each sequence's "
                      f"{train.seq_len} tokens{f' / cp {cp}' if (cp or 1) > 1 else ''} over tp {tp}, which does not "
                      f"divide them; a --seq-len that is a multiple of {sequence_parallel_multiple(tp, cp)} allows it.",
                      DsautoWarning, stacklevel=2)
    if attention_kernel == "cudnn" and not cluster.device.fused_attention_efficiency:
        warnings.warn(f"{cluster.device.name} has no fused attention efficiency of its own; cuDNN's fused "
                      f"attention is priced at its FlashAttention efficiency.", DsautoWarning, stacklevel=2)
    return Problem(model_spec, cluster, train, pins)


def find_plans(problem: Problem, *, top_k: int = 1, profile: Profile | str | os.PathLike[str] | None = None,
               progress: Progress | None = None) -> list[Plan]:
    """The ``top_k`` best plans for ``problem`` that fit its memory budget, best first: the fastest,
    except that among plans predicted within 3% of it the one with the most memory headroom comes
    first (:mod:`dsauto.search.ranking`; its ``ranking`` field says so).

    Args:
        problem: what to plan for, from :func:`make_problem`.
        top_k: how many plans to return (at least 1).
        profile: measured costs to price the layers with: a Profile, or a profile file or folder
            written by ``dsauto profile`` (default: the analytic cost model only).
        progress: called with (strategies done, strategies in all) as the search goes.

    Raises:
        DsautoError: nothing fits, no strategy satisfies the pins, or no stored profile matches,
            as one sentence that says what to change.
    """
    from dsauto.search.planner import Planner
    from dsauto.search.ranking import TIE_TOLERANCE, rank_by_headroom

    if top_k < 1:
        raise DsautoError(f"top_k must be at least 1, got {top_k}.")
    if isinstance(profile, (str, os.PathLike)):
        from dsauto.profile.store import OTHER_ENGINES_PROFILE, find_profile  # imports torch: only when named

        with warnings.catch_warnings():  # another engine's profile: said below, of the plan found
            warnings.filterwarnings("ignore", OTHER_ENGINES_PROFILE)
            profile = find_profile(Path(profile), problem.model, problem.train.dtype, problem.train.seq_len,
                                   problem.pins.engine, problem.cluster)
    planner = Planner(problem.model, problem.cluster, problem.train, problem.pins, profile)
    # Every plan within the tie tolerance of the fastest competes for first place on memory headroom.
    plans = rank_by_headroom(planner.search(top_k=top_k, progress=progress, within=TIE_TOLERANCE))[:top_k]
    measured_engine = getattr(profile, "engine", None)
    if measured_engine is not None and plans[0].engine != measured_engine:
        warnings.warn(f"The {plans[0].engine} plan is priced from a profile of {measured_engine}'s layers, whose "
                      f"time may differ from {plans[0].engine}'s own; run `dsauto profile --engine "
                      f"{plans[0].engine}` to price it from them.", DsautoWarning, stacklevel=2)
    if problem.pins.tp_comm_overlap and not plans[0].tp_comm_overlap:
        remedy = ("pin --tp 2 or more to use it" if plans[0].tp == 1 else
                  f"a --seq-len that is a multiple of {sequence_parallel_multiple(plans[0].tp, plans[0].cp)} "
                  f"allows sequence parallelism")
        warnings.warn(f"--tp-comm-overlap takes effect with tp > 1 and sequence parallelism, and the plan has tp "
                      f"{plans[0].tp}{'' if plans[0].tp == 1 else ' without sequence parallelism'}, so it is off; "
                      f"{remedy}.", DsautoWarning, stacklevel=2)
    if problem.pins.overlap_param_gather is False and plans[0].zero_stage == 0 and plans[0].overlap_grad_reduce:
        warnings.warn("--no-overlap-param-gather leaves the distributed optimizer's parameter gather unoverlapped, "
                      "and the plan has ZeRO 0, which gathers none, so it changes nothing; pin --zero-stage 1 to "
                      "price it.", DsautoWarning, stacklevel=2)
    best = plans[0]
    if problem.model.mtp_layers and best.engine == "deepspeed":
        warnings.warn(f"{problem.model.name}'s {problem.model.mtp_layers} multi-token-prediction layer(s) are not "
                      f"in the DeepSpeed plan: transformers, which DeepSpeed trains, does not build them; the "
                      f"plan, its memory and its time are the main model's (a Megatron-core plan, --engine "
                      f"megatron, trains them on its last pipeline stage).", DsautoWarning, stacklevel=2)
    pinned_n = problem.pins.recompute_num_layers
    widest = max((len(layers) for layers in best.stage_ranges()), default=0)
    if pinned_n and best.engine == "megatron" and pinned_n > widest:
        warnings.warn(f"--recompute-num-layers {pinned_n} checkpoints every layer of the plan's "
                      f"{'model chunks' if best.virtual_stages > 1 else 'pipeline stages'}, which hold {widest} at "
                      f"most: its files write --recompute-num-layers {widest}, the same layers.", DsautoWarning,
                      stacklevel=2)
    if best.hpz > 1 and best.hpz >= best.dp:
        # ZeRO++'s secondary partition over the whole data-parallel group is the primary one again
        warnings.warn(f"--hpz {best.hpz} spans the plan's whole data-parallel group (dp {best.dp}), so its secondary "
                      f"copy of the parameters is partitioned as the primary one: it adds their memory and saves no "
                      f"traffic; leave --hpz out, or give it fewer ranks than dp.", DsautoWarning, stacklevel=2)
    if best.zero_stage == 3 and not any(run.shard_params for run in best.layers):
        # Every layer resident (ds_persist): no partition is gathered, so these pins move nothing.
        idle = []  # (what does nothing, what gives the same plan)
        if best.offload == "optimizer+params":
            idle.append((f"--offload {best.offload} offloads no parameter", "--offload optimizer"))
        if best.hpz > 1:
            idle.append((f"--hpz {best.hpz} partitions no gather", "no --hpz"))
        if idle:
            warnings.warn(f"{' and '.join(what for what, _ in idle)}: the plan keeps every layer's parameters "
                          f"resident on the device, where it fits and runs fastest; {' and '.join(s for _, s in idle)} "
                          f"give{'s' if len(idle) == 1 else ''} the same plan, and a lower --memory-limit shards "
                          f"layers.", DsautoWarning, stacklevel=2)
    return plans


def make_plan(
    model: ModelSource = DEFAULT_MODEL,
    hardware: str | os.PathLike[str] | ClusterSpec | HardwareSpec = DEFAULT_HARDWARE,
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    memory_limit: int | str | None = None,
    global_batch: int | None = None,
    seq_len: int | None = None,
    dtype: Dtype | None = None,
    flash_attention: bool = True,
    tp: int | None = None,
    pp: int | None = None,
    zero_stage: int | None = None,
    micro_batch: int | None = None,
    checkpoint: bool | None = None,
    sequence_parallel: bool | None = None,
    cp: int | None = None,
    vpp: int | None = None,
    engine: Engine | None = None,
    ep: int | None = None,
    etp: int | None = None,
    offload: Offload | None = None,
    hpz: int | None = None,
    dist_opt_instances: int | None = None,
    recompute_modules: str | None = None,
    attention_kernel: AttentionKernel | None = None,
    tp_comm_overlap: bool | None = None,
    grad_reduce_in_fp32: bool | None = None,
    overlap_grad_reduce: bool | None = None,
    overlap_param_gather: bool | None = None,
    precision_aware_optimizer: MomentsDtype | None = None,
    attention_softmax_in_fp32: bool | None = None,
    expert_dispatcher: ExpertDispatcher | None = None,
    expert_load_balanced: bool | None = None,
    expert_capacity_factor: float | None = None,
    expert_pad_to_capacity: bool | None = None,
    fp8: bool | None = None,
    fp8_recipe: Fp8Recipe | None = None,
    fp8_param_gather: bool | None = None,
    cp_comm_type: CpCommType | None = None,
    expert_a2a_overlap: bool | None = None,
    stage_layers: str | Sequence[int] | None = None,
    recompute_num_layers: int | None = None,
    hf_trainer: bool | None = None,
    profile: Profile | str | os.PathLike[str] | None = None,
) -> Plan:
    """The fastest plan that fits: :func:`find_plans` of :func:`make_problem` with these arguments
    (documented there); ``dsauto tune`` with the same options writes this plan.

    For the runners-up, call ``find_plans(make_problem(...), top_k=4)``.
    """
    problem = make_problem(model, hardware, nodes=nodes, gpus_per_node=gpus_per_node, memory_limit=memory_limit,
                           global_batch=global_batch, seq_len=seq_len, dtype=dtype,
                           flash_attention=flash_attention, tp=tp, pp=pp, zero_stage=zero_stage,
                           micro_batch=micro_batch, checkpoint=checkpoint, sequence_parallel=sequence_parallel,
                           cp=cp, vpp=vpp, engine=engine, ep=ep, etp=etp, offload=offload, hpz=hpz,
                           dist_opt_instances=dist_opt_instances,
                           recompute_modules=recompute_modules, attention_kernel=attention_kernel,
                           tp_comm_overlap=tp_comm_overlap, grad_reduce_in_fp32=grad_reduce_in_fp32,
                           overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
                           precision_aware_optimizer=precision_aware_optimizer,
                           attention_softmax_in_fp32=attention_softmax_in_fp32, expert_dispatcher=expert_dispatcher,
                           expert_load_balanced=expert_load_balanced, expert_capacity_factor=expert_capacity_factor,
                           expert_pad_to_capacity=expert_pad_to_capacity, fp8=fp8, fp8_recipe=fp8_recipe,
                           fp8_param_gather=fp8_param_gather, cp_comm_type=cp_comm_type,
                           expert_a2a_overlap=expert_a2a_overlap, stage_layers=stage_layers,
                           recompute_num_layers=recompute_num_layers, hf_trainer=hf_trainer)
    return find_plans(problem, profile=profile)[0]
