"""The DeepSpeed hook: applies the per-layer part of a plan around ``deepspeed.initialize``.

The global part of a plan (batch, precision, ZeRO stage, buckets) is plain DeepSpeed config. The
per-layer part has no DeepSpeed key, so the hook applies it to the model:

1. before the engine is built (:func:`prepare_model`): the plan is checked against the model (block
   count, shape, layer names); operator splitting re-parameterises the layers it names
   (:mod:`dsauto.runtime.split`); the blocks the plan checkpoints are wrapped
   (:mod:`dsauto.runtime.checkpointing`), and the modules the plan recomputes selectively
   (:mod:`dsauto.runtime.recompute`). All must happen first: ZeRO-3 converts and partitions
   the parameters and hooks every submodule while the engine is built, and the optimizer is built
   over the parameters that exist then;
2. after the engine is built (:func:`apply_persistence`): under ZeRO-3 the parameters of the layer
   groups the plan replicates are made persistent.
3. for a plan with cp > 1 (DeepSpeed-Ulysses), before the engine is built: DeepSpeed's
   sequence-parallel groups become its ``mpu`` and the blocks' attention is wrapped in
   ``DistributedAttention`` (:mod:`dsauto.runtime.ulysses`).
4. for a plan with pp > 1 (DeepSpeed's pipeline engine): the model must be the ``PipelineModule``
   that :func:`dsauto.runtime.pipeline.pipeline_module` cut into the plan's stages and whose
   checkpointed blocks it wrapped as each rank built them; the hook checks that it was cut for
   this plan and passes it on.

Persistence under ZeRO-3. DeepSpeed keeps a parameter resident when ``param.ds_persist`` is set:
the coordinator never releases it after use (``PartitionedParameterCoordinator.__params_to_release``
in deepspeed/runtime/zero/partitioned_param_coordinator.py) and the ZeRO-3 optimizer all-gathers
every parameter of its ``persistent_parameters`` list after each optimizer step
(``DeepSpeedZeroOptimizer_Stage3._post_step`` in deepspeed/runtime/zero/stage3.py). That list is
built once, by ``DeepSpeedZeRoOffload.mark_persistent_parameters`` (parameter_offload.py), from
``stage3_param_persistence_threshold``; the stage-3 optimizer holds the same list object. The hook
sets ``ds_persist`` from the plan and rewrites that list in place, so the plan's resident
parameters are re-gathered after every step. Gradients and optimizer states are untouched: ZeRO-3
still reduce-scatters every gradient to its owner and keeps fp32 master weights and Adam moments
for its partition only, persistent or not. Like DeepSpeed's own persistent parameters, they are
resident from the end of the first optimizer step (during the first forward the coordinator records
its trace and releases everything it gathered).

The rule for the threshold: the plan decides for every matrix (a parameter of two or more
dimensions): resident if its layer group is replicated, partitioned if sharded, whatever its size.
DeepSpeed's threshold still keeps vectors (norm weights, biases) of at most
``stage3_param_persistence_threshold`` elements resident in sharded groups too, as DeepSpeed would:
gathering each tiny vector per use costs a collective's latency for a negligible saving.
``stage3_model_persistence_threshold`` is not applied to the plan's choices.

Tested with DeepSpeed 0.19.8 (torch 2.13.0+cpu, gloo backend, ``DS_ACCELERATOR=cpu``). The hook
reads these internals, which a DeepSpeed release may change: ``engine.optimizer.parameter_offload``
(``DeepSpeedZeroOptimizer_Stage3``), its ``persistent_parameters`` list and
``param_numel_persistence_threshold``, and the ZeRO parameter attributes ``ds_persist``,
``ds_shape``, ``ds_numel`` and ``ds_id`` (deepspeed/runtime/zero/partition_parameters.py).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from dsauto.engines.deepspeed import config_contradictions, warn_unpriced_settings
from dsauto.errors import DsautoError, DsautoWarning
from dsauto.plan import Plan
from dsauto.plan_io import PLAN_KEY, check_artifact_set, plan_from_data
from dsauto.runtime.checkpointing import checkpoint_module
from dsauto.runtime.layers import ModelLayers, check_plan_matches, find_layers
from dsauto.runtime.pipeline import check_pipeline_module
from dsauto.runtime.recompute import apply_selective_recompute
from dsauto.runtime.split import (
    Replacements,
    chunk_head_loss,
    require_chunkable,
    split_block,
    split_embedding,
)
from dsauto.runtime.ulysses import sequence_parallel_mpu, wrap_attention
from dsauto.units import counted

TESTED_DEEPSPEED_VERSIONS = ("0.19.8",)
"""DeepSpeed releases the hook's tests pass with (it reads engine internals, see the module doc)."""

ORIGINAL = "_dsauto_original"
"""Attribute of the function :func:`dsauto.deepspeed.install` puts in place of ``deepspeed.initialize``
that holds DeepSpeed's own."""

_PREPARED = "_dsauto_prepared"


@dataclass
class AppliedPlan:
    """What the hook did to one model; the engine carries it as ``engine.dsauto_plan``."""

    plan: Plan
    """The plan applied."""
    layers: ModelLayers
    """Where the plan's layers are in the model."""
    checkpointed: tuple[int, ...] = ()
    """Flat layers (1..L) wrapped in activation checkpointing."""
    splits: dict[int, int] = field(default_factory=dict)
    """Flat layer -> number of slices (head: token chunks), for the layers split."""
    replacements: Replacements = field(default_factory=dict)
    """Parameters replaced by splitting: old -> new slices; emptied once the model and optimizer
    point at the slices (:func:`initialize`), so that the old parameters are freed."""
    resident: tuple[int, ...] = ()
    """Under ZeRO-3: flat layers whose parameters are persistent (replicated groups)."""
    recomputed: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Flat layers (1..L) that recompute modules selectively, and those modules
    (:mod:`dsauto.runtime.recompute`)."""


def warn_if_untested(version: str) -> None:
    """Warns when the running DeepSpeed is not one the hook was tested with."""
    if version.split("+")[0] not in TESTED_DEEPSPEED_VERSIONS:
        warnings.warn(f"dsauto's DeepSpeed hook is tested with DeepSpeed {', '.join(TESTED_DEEPSPEED_VERSIONS)} "
                      f"and this is {version}; it reads ZeRO-3 internals (see dsauto.runtime.deepspeed) "
                      f"that another release may have changed.", DsautoWarning, stacklevel=3)


def plan_from_config(config: dict[str, Any]) -> Plan | None:
    """The plan in the config's ``"dsauto"`` block, or None when there is none."""
    if PLAN_KEY not in config:
        return None
    return plan_from_data(config[PLAN_KEY], f"the {PLAN_KEY!r} block of the DeepSpeed config")


def check_config(plan: Plan, config: dict[str, Any]) -> None:
    """Refuses a config whose DeepSpeed keys contradict the plan, or a plan this hook cannot apply."""
    if plan.engine != "deepspeed":
        raise DsautoError(
            f"This plan was made for {plan.engine} (its memory and overlap are priced as that engine "
            f"runs); train it with dsauto.megatron, or re-plan with --engine deepspeed."
        )
    if plan.tp > 1:
        raise DsautoError(
            f"DeepSpeed has no tensor parallelism of its own, but this plan has tp={plan.tp}; run it with "
            f"the Megatron-core plugin (dsauto.megatron), or re-plan with --engine deepspeed."
        )
    # The batch keys are left to check_engine: a Trainer may fill them with its own values.
    problems = config_contradictions(config, plan, batch=False)
    if problems:
        raise DsautoError(f"The config's {'; '.join(problems)}, so DeepSpeed and the {PLAN_KEY!r} plan would "
                          f"train differently; re-plan with dsauto, or restore the values it wrote.")
    warn_unpriced_settings(config, plan, "The config's")


def check_moe_layers(plan: Plan, model: nn.Module) -> None:
    """Refuses a model whose DeepSpeed-MoE layers (``deepspeed.moe.layer.MoE``) disagree with the
    plan: their count with the plan's MoE layers, their ``num_experts`` with the model's experts, their
    ``ep_size`` with the plan's ep; and a plan with ep > 1 for a model without them (DeepSpeed splits
    experts only inside its own MoE layers). A model with other MoE layers (a Hugging Face
    Mixtral) trains with every expert on every rank, as an ep = 1 plan prices it."""
    from deepspeed.moe.layer import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    moe_layers = len(plan.model.moe_layers())
    if not layers:
        if plan.ep > 1:
            raise DsautoError(
                f"The plan splits the experts over ep={plan.ep} ranks, but the model has no "
                f"deepspeed.moe.layer.MoE layers, in which alone DeepSpeed splits experts; build its "
                f"{moe_layers} MoE layers with deepspeed.moe.layer.MoE(ep_size={plan.ep}), or re-plan with --ep 1.")
        return
    if len(layers) != moe_layers:
        raise DsautoError(f"The model has {len(layers)} deepspeed.moe.layer.MoE layers but the plan's model "
                          f"{plan.model.name} has {moe_layers} MoE layers; plan the model that is trained.")
    for i, layer in enumerate(layers):
        if layer.num_experts != plan.model.num_experts:
            raise DsautoError(f"DeepSpeed-MoE layer {i} has {layer.num_experts} experts but the plan's model "
                              f"has {plan.model.num_experts}; plan the model that is trained.")
        if layer.ep_size != plan.ep:
            raise DsautoError(f"DeepSpeed-MoE layer {i} has ep_size={layer.ep_size} but the plan's expert-"
                              f"parallel degree is ep={plan.ep}; build the layers with ep_size={plan.ep} "
                              f"or re-plan with --ep {layer.ep_size}.")


def prepare_model(plan: Plan, model: nn.Module) -> AppliedPlan:
    """Checks the plan against ``model`` and applies splitting, checkpointing and selective
    recomputation (before the engine)."""
    if getattr(model, _PREPARED, False):
        raise DsautoError(f"This {type(model).__name__} was already prepared by dsauto.deepspeed.initialize "
                          f"(its layers are split or wrapped); build a fresh model for another engine.")
    layers = find_layers(model)
    check_plan_matches(plan, layers)
    _check_transformers_experts(plan, layers)
    _check_transformers_attention(plan, model)
    if any(run.split > 1 for run in plan.layers) and any(hasattr(p, "ds_id") for p in model.parameters()):
        raise DsautoError(
            "The plan splits operators, but this model was built inside deepspeed.zero.Init (its "
            "parameters are already partitioned, e.g. by a Hugging Face model created after "
            "TrainingArguments(deepspeed=...)); build the model first, or re-plan without splitting."
        )
    head = layers.num_layers + 1
    if plan.layer_choice(head).split > 1:
        require_chunkable(layers.head, plan.layer_choice(head).split)
    applied = AppliedPlan(plan=plan, layers=layers)
    applied.recomputed = apply_selective_recompute(plan, layers)  # checks every block before changing one
    for run in plan.layers:
        if run.split == 1:
            continue
        for layer in range(run.first, run.last + 1):
            applied.splits[layer] = run.split
            if layer == 0:
                embedding = layers.embedding if layers.embedding is not None else model
                applied.replacements.update(split_embedding(model, embedding, run.split))
            elif layer == head:
                chunk_head_loss(layers.head, run.split)
            else:
                applied.replacements.update(split_block(layers.block(layer), run.split))
    applied.checkpointed = plan.checkpointed_layers()
    for layer in applied.checkpointed:
        checkpoint_module(layers.block(layer))
    setattr(model, _PREPARED, True)
    return applied


def _check_transformers_attention(plan: Plan, model: nn.Module) -> None:
    """Refuses a plan priced with fused attention for a ``transformers`` model that computes its
    attention eagerly (``config._attn_implementation`` 'eager': what transformers picks where SDPA
    cannot run the model, gpt-oss's sinks among them), which keeps each layer's scores and softmax
    for backward, a micro-batch x heads x sequence x sequence tensor or more, that the plan does not count."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not plan.flash_attention or implementation != "eager" or not type(model).__module__.startswith("transformers."):
        return
    raise DsautoError(f"This {type(model).__name__} computes attention eagerly (attn_implementation 'eager'), which "
                      f"keeps every layer's {plan.micro_batch} x {plan.model.num_attention_heads} x {plan.seq_len} x "
                      f"{plan.seq_len} attention scores for backward, and the plan was priced with fused attention, "
                      f"which keeps none; load the model with attn_implementation='sdpa' or 'flash_attention_2', or "
                      f"re-plan with --no-flash-attention.")


def _check_transformers_experts(plan: Plan, layers: ModelLayers) -> None:
    """Refuses a plan of a mixture of experts whose pricing is not how a ``transformers`` model's
    experts run: Llama 4's ``Llama4TextMoe`` computes every expert on every token
    (ModelSpec.transformers_dense_experts), and ZeRO-3 gathers a transformers MoE layer's experts
    whole, which only a plan for Hugging Face's Trainer prices (Plan.experts_gathered_whole)."""
    if not plan.model.moe or not type(layers.blocks[0]).__module__.startswith("transformers."):
        return
    if plan.model.transformers_dense_experts:
        raise DsautoError(f"This {type(layers.blocks[0]).__name__} computes each of its {plan.model.num_experts} "
                          f"experts on every token, and the plan prices top-{plan.model.moe_top_k} routing; train a "
                          f"model that routes each token to its experts (or Megatron-core's).")
    sharded = any(run.shard_params for run in plan.layers)
    if plan.zero_stage == 3 and sharded and not plan.experts_gathered_whole:
        raise DsautoError("The plan prices ZeRO-3 gathering one expert matrix at a time, and a transformers model's "
                          "MoE layer is gathered whole (its experts are one 3-D parameter per matrix); re-plan with "
                          "--for hf.")


def repoint_parameters(model_parameters: Any, replacements: Replacements) -> Any:
    """``model_parameters`` (tensors, or param-group dicts) with replaced parameters swapped for
    their slices, in place of each; a lazy iterable is left as is (it yields the new ones)."""
    if not replacements or model_parameters is None or not isinstance(model_parameters, (list, tuple)):
        return model_parameters
    if model_parameters and isinstance(model_parameters[0], dict):
        return [{**group, "params": _swap(group["params"], replacements)} for group in model_parameters]
    return _swap(model_parameters, replacements)


def repoint_optimizer(optimizer: Any, replacements: Replacements) -> None:
    """Re-points a torch optimizer built before splitting at the slices (each in its source's group).

    An optimizer that already holds state for a replaced parameter cannot be re-pointed (the state
    has the old shape) and is refused. Callables and config-built optimizers are built later by
    DeepSpeed over the new parameters and need nothing.
    """
    groups = getattr(optimizer, "param_groups", None)
    if not replacements or groups is None:
        return
    stale = [p for p in getattr(optimizer, "state", {}) if p in replacements]
    if stale:
        raise DsautoError(
            f"The optimizer passed to dsauto.deepspeed.initialize already has state for {len(stale)} "
            f"parameter(s) that the plan's operator splitting replaces; build the optimizer before "
            f"training, or give it as a callable or in the DeepSpeed config."
        )
    for group in groups:
        group["params"] = _swap(group["params"], replacements)


def _swap(params: Iterable[Any], replacements: Replacements) -> list[Any]:
    out: list[Any] = []
    for p in params:
        out.extend(replacements.get(p, (p,)) if isinstance(p, nn.Parameter) else (p,))
    return out


def check_engine(engine: Any, plan: Plan) -> None:
    """Refuses an engine whose data-parallel size is not the plan's, and warns when its batch is not
    the plan's (Hugging Face's ``"auto"`` batch keys take TrainingArguments' values)."""
    dp = getattr(engine, "dp_world_size", plan.dp)
    if plan.cp > 1:
        # Under Ulysses DeepSpeed's data-parallel group is the dp x cp sequence-data-parallel one.
        sp = getattr(engine, "sequence_parallel_size", plan.cp)
        if sp != plan.cp:
            raise DsautoError(f"The plan runs DeepSpeed-Ulysses over cp={plan.cp} ranks but DeepSpeed runs "
                              f"sequence_parallel_size {sp}; pass no mpu of your own, or re-plan with --cp {sp}.")
        dp = getattr(engine, "seq_dp_world_size", plan.dp * plan.cp) // sp
    if dp != plan.dp:
        raise DsautoError(
            f"The plan is for {plan.dp} data-parallel ranks but DeepSpeed runs {dp}; launch "
            f"{plan.world_size} processes or re-plan for {counted(dp * plan.world_size // plan.dp, 'device')}."
        )
    micro = engine.train_micro_batch_size_per_gpu() if hasattr(engine, "train_micro_batch_size_per_gpu") else plan.micro_batch
    accum = engine.gradient_accumulation_steps() if hasattr(engine, "gradient_accumulation_steps") else plan.grad_accum
    if (micro, accum) != (plan.micro_batch, plan.grad_accum):
        warnings.warn(
            f"The plan's time and memory are for micro-batches of {plan.micro_batch} with "
            f"{plan.grad_accum} accumulation steps, but DeepSpeed runs {micro} with {accum}; set "
            f"per_device_train_batch_size={plan.micro_batch} and gradient_accumulation_steps="
            f"{plan.grad_accum} (TrainingArguments), or the config's batch keys.", DsautoWarning, stacklevel=3)


def deepspeed_initialize() -> Any:
    """DeepSpeed's own ``initialize``, also while :func:`dsauto.deepspeed.install` routes
    ``deepspeed.initialize`` through the hook."""
    import deepspeed

    return getattr(deepspeed.initialize, ORIGINAL, deepspeed.initialize)


def apply_persistence(engine: Any, applied: AppliedPlan) -> None:
    """Under ZeRO-3, makes the plan's replicated layer groups persistent (see the module doc)."""
    if engine.zero_optimization_stage() != 3:
        return
    offload = _parameter_offload(engine)
    threshold = int(offload.param_numel_persistence_threshold)
    plan, resident = applied.plan, []
    for layer, params in enumerate(applied.layers.parameters_by_layer()):
        replicated = not plan.layer_choice(layer).shard_params
        if replicated:
            resident.append(layer)
        for p in params:
            p.ds_persist = replicated or (len(p.ds_shape) < 2 and p.ds_numel <= threshold)
    # In place: the stage-3 optimizer holds the same list object (stage3.py, __init__:
    # self.persistent_parameters = self.parameter_offload.persistent_parameters).
    offload.persistent_parameters[:] = [p for p in engine.module.parameters() if p.ds_persist]
    applied.resident = tuple(resident)


def _parameter_offload(engine: Any) -> Any:
    # DeepSpeedZeroOptimizer_Stage3 owns a DeepSpeedZeRoOffload; without an optimizer the engine
    # holds the DeepSpeedZeRoOffload itself (engine.py, _configure_zero_optimizer).
    optimizer = engine.optimizer
    offload = getattr(optimizer, "parameter_offload", optimizer)
    persistent = getattr(offload, "persistent_parameters", None)
    if not isinstance(persistent, list) or not hasattr(offload, "param_numel_persistence_threshold"):
        import deepspeed

        raise RuntimeError(
            f"DeepSpeed {deepspeed.__version__}'s ZeRO-3 optimizer {type(optimizer).__name__} has no "
            f"parameter_offload.persistent_parameters list; the dsauto hook is tested with DeepSpeed "
            f"{', '.join(TESTED_DEEPSPEED_VERSIONS)}."
        )
    if getattr(optimizer, "persistent_parameters", persistent) is not persistent:
        raise RuntimeError("DeepSpeed's ZeRO-3 optimizer and parameter offload hold different "
                           "persistent_parameters lists; the dsauto hook cannot register persistent "
                           f"parameters (tested with DeepSpeed {', '.join(TESTED_DEEPSPEED_VERSIONS)}).")
    return offload


def initialize(forwarded: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize(**forwarded)`` (its keyword arguments), applying the plan of the config
    it is given; a config without a plan is passed through untouched."""
    resolved = config_dict(forwarded.get("args"), forwarded.get("config"), forwarded.get("config_params"))
    plan = plan_from_config(resolved) if resolved is not None and forwarded.get("model") is not None else None
    ds_initialize = deepspeed_initialize()
    if plan is None:
        return ds_initialize(**forwarded)
    import deepspeed

    # Every rank reads the same plan and config: what dsauto's checks warn of is said once a job.
    # DeepSpeed's own initialize runs outside, its warnings and filters as they are.
    model, model_parameters, optimizer = (forwarded.get(k) for k in ("model", "model_parameters", "optimizer"))
    with _warnings_from_rank_zero():
        warn_if_untested(deepspeed.__version__)
        check_config(plan, resolved)
        if plan.pp > 1:  # DeepSpeed's pipeline engine: the PipelineModule was cut and wrapped for the plan
            layout: Any = check_pipeline_module(plan, model)
        else:
            check_moe_layers(plan, model)
            layout = applied = prepare_model(plan, model)
            if plan.cp > 1:  # DeepSpeed-Ulysses: its groups as the mpu, DistributedAttention in the model
                forwarded["mpu"] = sequence_parallel_mpu(plan, forwarded.get("mpu"))
                wrap_attention(applied.layers, plan, forwarded["mpu"])
            forwarded["model_parameters"] = repoint_parameters(model_parameters, applied.replacements)
            repoint_optimizer(optimizer, applied.replacements)
            # The replaced parameters are garbage once the model and the optimizer point at their
            # slices: kept in the mapping, they would hold a whole unsplit copy of every split layer.
            applied.replacements = {}
        check_world_size(plan)  # after the model's checks, which say more of a plan for another model
    engine, ds_optimizer, dataloader, scheduler = ds_initialize(**forwarded)
    with _warnings_from_rank_zero():
        check_engine(engine, plan)
    if plan.pp == 1:
        apply_persistence(engine, layout)
    engine.dsauto_plan = layout
    return engine, ds_optimizer, dataloader, scheduler


RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
"""Where launchers say a process's rank before its process group exists: torchrun's and DeepSpeed's
launcher, Open MPI, MPICH and Intel MPI, and Slurm's srun."""


@contextlib.contextmanager
def _warnings_from_rank_zero() -> Iterator[None]:
    """The hook's warnings (DsautoWarning) on the job's rank 0 only: the rank of the initialised
    process group, else the first of :data:`RANK_VARIABLES` the launcher set; a process that says
    none is rank 0. Wrapped around dsauto's own checks only, not DeepSpeed's initialize."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    else:
        rank = int(next((os.environ[name] for name in RANK_VARIABLES if os.environ.get(name, "").isdigit()), "0"))
    if rank == 0:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DsautoWarning)
        yield


def check_world_size(plan: Plan) -> None:
    """Refuses a launch of another number of ranks than the plan's before DeepSpeed builds anything
    (its own batch assertion would end the run with a traceback): the ranks of the initialised
    process group, else the launcher's ``WORLD_SIZE``; nothing to check when neither says."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if world is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world = int(os.environ["WORLD_SIZE"])
    if world is not None and world != plan.world_size:
        raise DsautoError(f"The plan is for {plan.world_size} ranks ({plan.dims.describe()}) but this launch has "
                          f"{world}; launch {plan.world_size} processes or re-plan for {counted(world, 'device')}.")


def config_dict(args: Any, config: Any, config_params: Any) -> dict[str, Any] | None:
    """The config as DeepSpeed will read it, found where ``deepspeed.initialize`` looks (without
    changing ``args``); None when there is none or it cannot be read (DeepSpeed then says why)."""
    found = config if config is not None else config_params
    for name in ("deepspeed_config", "deepscale_config"):
        if found is None and getattr(args, name, None) is not None:
            found = getattr(args, name)
    if found is None or isinstance(found, dict):
        return found
    if isinstance(found, (str, os.PathLike)) and Path(found).is_file():
        check_artifact_set(Path(found))  # not a file of one plan beside the plan.yaml of another
    # The same reader as deepspeed.initialize: a JSON/HJSON path, or a base64-encoded config.
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    try:
        loaded = load_ds_config(found)
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None
