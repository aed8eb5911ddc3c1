"""The refiner's search space: the search's best plans and the knobs around them.

The dynamic program ranks whole plans by the cost model. What the model is least sure of is left
for real steps to settle:

- which of the top plans is truly fastest (the top-K strategies, plus the best plans at the
  neighbouring micro-batch sizes of the winner);
- how many layers to checkpoint (one more or one fewer than the plan), where memory is close to
  the budget and the model's activation estimate decides feasibility;
- the reduction bucket size (ZeRO 1-3) and the ZeRO-3 prefetch size, which the model prices only
  roughly (latency per bucket, overlap) but which change both time and memory.

Every point of the space is a :class:`Candidate`: a complete, priced plan. The Optuna parameters of
a candidate are its :class:`Knobs` (``plan``, ``checkpoint_delta``, ``bucket_scale``,
``prefetch_scale``); a knob that does not apply to a plan is absent from its trial.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dsauto.cost.calibration import Calibration
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.engines.megatron import block_recompute_layers
from dsauto.errors import DsautoError
from dsauto.plan import Plan, block_recompute_set
from dsauto.search.planner import Planner

CHECKPOINT_DELTAS = (-1, 0, 1)
"""Checkpointed transformer layers relative to the plan's choice."""
BUCKET_SCALES = (0.5, 1.0, 2.0)
"""Reduction (and ZeRO 1-2 all-gather) bucket size relative to the search's choice."""
PREFETCH_SCALES = (1.0, 2.0)
"""ZeRO-3 prefetch bucket (and with it the live-parameter bound) relative to the search's choice."""
MEMORY_SLACK = 0.15
"""Candidates predicted up to this fraction over the budget stay in the space: the memory model is
least sure near the limit, and a measured step settles it (over the limit counts as infeasible)."""


@dataclass(frozen=True)
class Knobs:
    """A point of the space, as the study's trial parameters."""

    plan: str
    """Label of the base plan (one of the search's top plans or a micro-batch neighbour)."""
    checkpoint_delta: int = 0
    """Transformer layers checkpointed beyond (or, negative, below) the base plan."""
    bucket_scale: float | None = None
    """Reduction bucket relative to the base plan's; None where there are no buckets (ZeRO-0, dp 1)."""
    prefetch_scale: float | None = None
    """ZeRO-3 prefetch bucket relative to the base plan's; None where nothing is sharded."""

    def params(self) -> dict[str, Any]:
        """The Optuna parameters of this point (knobs that do not apply are left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Knobs:
        return cls(**{f.name: params.get(f.name, f.default) for f in dataclasses.fields(cls)})

    def is_base(self) -> bool:
        """The base plan itself, every knob at its search-chosen value."""
        return self.checkpoint_delta == 0 and self.bucket_scale in (None, 1.0) and self.prefetch_scale in (None, 1.0)

    def describe(self) -> str:
        parts = [self.plan]
        if self.checkpoint_delta:
            parts.append(f"ckpt{self.checkpoint_delta:+d}")
        if self.bucket_scale not in (None, 1.0):
            parts.append(f"bucket x{self.bucket_scale:g}")
        if self.prefetch_scale not in (None, 1.0):
            parts.append(f"prefetch x{self.prefetch_scale:g}")
        return " ".join(parts)


@dataclass(frozen=True)
class Candidate:
    """One complete plan of the space, with the choices that price it again under a calibration."""

    knobs: Knobs
    """Where it sits in the space."""
    strategy: Strategy
    """Global choices."""
    stage_layers: tuple[int, ...]
    """Transformer layers per pipeline stage."""
    options: tuple[LayerOption, ...]
    """Per flat layer (embedding, blocks, head)."""
    plan: Plan
    """The plan, priced by the search's cost model."""

    def price(self, planner: Planner) -> Plan:
        """The same plan priced by ``planner`` (its profile and calibration)."""
        return planner.build_plan(self.strategy, self.stage_layers, self.options,
                                  self.plan.reduce_bucket_bytes, self.plan.prefetch_bucket_bytes)


def plan_label(plan: Plan) -> str:
    """A short name of a plan's global choices and per-layer counts, unique among the search's plans."""
    layers = plan.model.num_layers
    parts = [f"z{plan.zero_stage}"]
    if plan.tp > 1 or plan.pp > 1:
        parts.append(f"tp{plan.tp}pp{plan.pp}")
    if plan.virtual_stages > 1:
        parts.append(f"vpp{plan.virtual_stages}")
    if len(set(plan.stage_layers)) > 1:
        parts.append("layers" + "+".join(map(str, plan.stage_layers)))
    if plan.tp > 1 and not plan.sequence_parallel:
        parts.append("nosp")
    parts.append(f"mb{plan.micro_batch}x{plan.grad_accum}")
    parts.append(f"ckpt{len(plan.checkpointed_layers())}/{layers}")
    for modules in plan.selective_layers():
        parts.append("sel-" + "+".join(modules))
    if plan.zero_stage == 3 and plan.dp > 1:
        sharded = sum(r.last - r.first + 1 for r in plan.layers if r.shard_params)
        parts.append(f"shard{sharded}/{layers + 2}")
    splits = sorted({r.split for r in plan.layers if r.split > 1})
    if splits:
        parts.append("split" + "+".join(map(str, splits)))
    if plan.offload != "none":
        parts.append(f"offload-{plan.offload}")
    if plan.hpz > 1:
        parts.append(f"hpz{plan.hpz}")
    if plan.dist_opt_instances > 1:
        parts.append(f"distopt{plan.dist_opt_instances}")
    return "-".join(parts)


def strategy_of(plan: Plan) -> Strategy:
    return Strategy(dims=plan.dims, zero_stage=plan.zero_stage,
                    micro_batch=plan.micro_batch, grad_accum=plan.grad_accum,
                    sequence_parallel=plan.sequence_parallel, engine=plan.engine,
                    virtual_stages=plan.virtual_stages, chunk_layout=plan.chunk_layout,
                    recompute_modules=plan.uniform_recompute_modules(),
                    offload=plan.offload, hpz=plan.hpz, dist_opt_instances=plan.dist_opt_instances,
                    attention_kernel=plan.attention_kernel, tp_comm_overlap=plan.tp_comm_overlap,
                    grad_reduce_in_fp32=plan.grad_reduce_in_fp32, expert_dispatcher=plan.expert_dispatcher,
                    fp8=plan.fp8, fp8_recipe=plan.fp8_recipe, fp8_param_gather=plan.fp8_param_gather,
                    cp_comm_type=plan.cp_comm_type, expert_a2a_overlap=plan.expert_a2a_overlap,
                    expert_load_balanced=plan.expert_load_balanced,
                    expert_capacity_factor=plan.expert_capacity_factor,
                    expert_pad_to_capacity=plan.expert_pad_to_capacity,
                    experts_gathered_whole=plan.experts_gathered_whole,
                    overlap_grad_reduce=plan.overlap_grad_reduce, overlap_param_gather=plan.overlap_param_gather,
                    precision_aware_optimizer=plan.precision_aware_optimizer,
                    attention_softmax_in_fp32=plan.attention_softmax_in_fp32)


def options_of(plan: Plan) -> tuple[LayerOption, ...]:
    return tuple(LayerOption(checkpoint=c.checkpoint, shard_params=c.shard_params, split=c.split,
                             recompute_modules=c.recompute_modules)
                 for c in (plan.layer_choice(j) for j in range(plan.model.num_layers + 2)))


SAFER_BUDGETS = (0.85, 0.7)
"""Fractions of the memory budget at which the search's best plan joins the space too: if the model
under-predicts memory, the plans it ranks best may all measure over the budget, and these are the
fallbacks that still fit (each pays for its margin in step time, which the measurements weigh)."""


def base_plans(planner: Planner, top_k: int, progress: Callable[[int, int], None] | None = None) -> list[Plan]:
    """The search's ``top_k`` plans; the best plans at half and twice the winner's micro-batch (when
    such a micro-batch divides the batch and fits); the best plans under :data:`SAFER_BUDGETS` of the
    budget; for Megatron-core, the best plan of each other model-parallel layout (:func:`layout_plans`).
    Duplicates removed, best predicted first. Every plan is priced against the real budget.
    Trials measure plans through the DeepSpeed hook, so an engine left open is DeepSpeed."""
    if planner.pins.engine is None:
        planner = Planner(planner.model, planner.cluster, planner.train,
                          dataclasses.replace(planner.pins, engine="deepspeed"), planner.profile, planner.calibration)
    plans = planner.search(top_k=top_k, progress=progress)
    best = plans[0]
    budget = planner.cluster.memory_budget_bytes
    for fraction in SAFER_BUDGETS:
        try:
            safer = planner.with_budget(budget * fraction).search(top_k=1, near_miss=False)[0]
        except DsautoError:
            break  # nothing fits a tighter budget
        plans.append(dataclasses.replace(safer, memory_budget_bytes=budget))
    per_replica = best.global_batch // best.dp
    for micro_batch in (best.micro_batch // 2, best.micro_batch * 2):
        if micro_batch < 1 or per_replica % micro_batch or planner.pins.micro_batch is not None:
            continue
        pins = dataclasses.replace(planner.pins, micro_batch=micro_batch, zero_stage=best.zero_stage)
        try:
            plans += Planner(planner.model, planner.cluster, planner.train, pins, planner.profile,
                             planner.calibration).search(top_k=1, near_miss=False)
        except DsautoError:
            continue  # nothing fits at that micro-batch
    if planner.pins.engine == "megatron":
        plans += layout_plans(planner, best)
        plans = _runnable_megatron(planner, plans)
    unique: dict[str, Plan] = {}
    for plan in plans:
        unique.setdefault(plan_label(plan), plan)
    return sorted(unique.values(), key=lambda p: p.prediction.step_seconds)


LAYOUT_MARGIN = 0.5
"""A model-parallel layout (tp x pp) joins a Megatron-core study when its best plan is predicted at
most this much slower than the search's best. Before the study measures it, nothing has checked the
layout's own terms (tensor-parallel collectives, pipeline bubble and sends), so only a gap larger
than the model can plausibly be wrong by rules it out; the sampler measures each layout once."""


def layout_plans(planner: Planner, best: Plan) -> list[Plan]:
    """The best plan of every tp x pp layout the pins leave open (tp a power of two within a node)
    that the search can build and that is predicted within :data:`LAYOUT_MARGIN` of ``best``."""
    pins, cluster = planner.pins, planner.cluster
    found = []
    tps = [pins.tp] if pins.tp else [t for t in (1, 2, 4, 8) if cluster.devices_per_node % t == 0]
    for tp in tps:
        pps = [pins.pp] if pins.pp else [p for p in range(1, cluster.world_size // tp + 1)
                                         if (cluster.world_size // tp) % p == 0]
        for pp in pps:
            if (tp, pp) == (best.tp, best.pp):
                continue
            layout = Planner(planner.model, cluster, planner.train, dataclasses.replace(pins, tp=tp, pp=pp),
                             planner.profile, planner.calibration)
            try:
                plan = layout.search(top_k=1)[0]
            except DsautoError:
                continue  # the model or the batch does not split that way, or it does not fit
            if plan.prediction.step_seconds <= (1 + LAYOUT_MARGIN) * best.prediction.step_seconds:
                found.append(plan)
    return found


def _runnable_megatron(planner: Planner, plans: list[Plan]) -> list[Plan]:
    """``plans`` without those whose ZeRO-2 / 3 needs Megatron-FSDP, when the trials' ranks are CPU
    processes: Megatron-FSDP needs CUDA, and the distributed optimizer standing in for it keeps the
    gradients whole, so the step would not be the plan's."""
    from dsauto.profile.resources import ranks_on_cpu

    if not ranks_on_cpu():
        return plans
    runnable = [p for p in plans if p.zero_stage < 2]
    if runnable:
        return runnable
    if planner.pins.zero_stage is not None:
        raise DsautoError(f"Megatron-core runs ZeRO-{planner.pins.zero_stage} as Megatron-FSDP, which needs CUDA, "
                          f"and these trials run on CPU processes; pin --zero-stage 0 or 1, or run the trials "
                          f"on a machine with GPUs.")
    runnable = []
    for zero in (1, 0):
        try:
            runnable += Planner(planner.model, planner.cluster, planner.train,
                                dataclasses.replace(planner.pins, zero_stage=zero), planner.profile,
                                planner.calibration).search(top_k=1)
        except DsautoError:
            continue
    if not runnable:
        raise DsautoError("No Megatron-core plan with ZeRO stage 0 or 1 fits the budget, and Megatron-FSDP "
                          "(ZeRO-2 / 3) needs CUDA, which these CPU trials lack; raise --memory-limit or run "
                          "the trials on a machine with GPUs.")
    return runnable


def _with_checkpoint_delta(plan: Plan, delta: int) -> tuple[LayerOption, ...] | None:
    """The plan's options with ``delta`` more (or fewer) checkpointed transformer layers; None when
    impossible. Layers are added in the stage with the highest predicted peak (its first layer not
    yet checkpointed) and removed from the stage with the most room (its last checkpointed layer).
    Megatron-core plans move by Megatron's own rule instead (:func:`_megatron_checkpoint_delta`)."""
    if plan.engine == "megatron":
        return _megatron_checkpoint_delta(plan, delta)
    options = list(options_of(plan))
    if delta == 0:
        return tuple(options)
    stages = sorted(range(plan.pp), key=lambda i: plan.stages[i].peak_bytes, reverse=delta > 0)
    for _ in range(abs(delta)):
        for i in stages:
            blocks = [j for j in plan.rank_layers()[i] if 1 <= j <= plan.model.num_layers]
            pick = ([j for j in blocks if not options[j].checkpoint][:1] if delta > 0
                    else [j for j in blocks if options[j].checkpoint][-1:])
            if pick:
                options[pick[0]] = dataclasses.replace(options[pick[0]], checkpoint=delta > 0)
                break
        else:
            return None
    return tuple(options)


def _megatron_checkpoint_delta(plan: Plan, delta: int) -> tuple[LayerOption, ...] | None:
    """The options of a Megatron-core plan that recomputes the first N + ``delta`` transformer layers
    of every pipeline stage (of every model chunk, with virtual stages), N being the plan's; None when
    that is below 0 or above the longest chunk. Megatron's block recomputation can say nothing else
    (``recompute_num_layers``: megatron/core/transformer/transformer_block.py, _checkpointed_forward),
    so a delta of 0 also turns another checkpointed set into the covering block that
    :func:`dsauto.runtime.megatron.recompute_fields` would run, and the embedding and the head,
    which Megatron never recomputes, are not checkpointed."""
    if delta and plan.selective_layers():
        return None  # under selective recomputation Megatron-core checkpoints no whole layer
    chunks = plan.stage_ranges()
    n = block_recompute_layers(plan)
    if n is None:  # the smallest N covering the plan's set, as the plugin widens it
        checkpointed = set(plan.checkpointed_layers())
        n = max((i + 1 for layers in chunks for i, layer in enumerate(layers) if layer in checkpointed), default=0)
    n += delta
    longest = max(len(layers) for layers in chunks)
    if n < 0 or n > longest:
        return None
    recomputed = block_recompute_set(plan.stage_layers, plan.virtual_stages, n, plan.chunk_layout)
    return tuple(dataclasses.replace(option, checkpoint=j in recomputed)
                 for j, option in enumerate(options_of(plan)))


def candidates(planner: Planner, plans: Sequence[Plan],
               checkpoint_deltas: Sequence[int] = CHECKPOINT_DELTAS,
               bucket_scales: Sequence[float] = BUCKET_SCALES,
               prefetch_scales: Sequence[float] = PREFETCH_SCALES,
               memory_slack: float = MEMORY_SLACK) -> list[Candidate]:
    """Every point of the space around ``plans`` that the cost model does not rule out (predicted
    peak within ``memory_slack`` of the budget), priced by ``planner``; base plans first. Checkpointing
    pinned by ``--checkpoint`` or ``--recompute-num-layers`` is kept as the plans have it."""
    budget = planner.cluster.memory_budget_bytes * (1 + memory_slack)
    if planner.pins.checkpoint is not None or planner.pins.recompute_num_layers is not None:
        checkpoint_deltas = [d for d in checkpoint_deltas if d == 0]  # the pins say which layers
    found: list[Candidate] = []
    for plan in plans:
        label, strategy = plan_label(plan), strategy_of(plan)
        megatron = plan.engine == "megatron"
        # Megatron-core's DDP reduces its gradient buffer in buckets of the plan's size under every
        # ZeRO stage (dsauto.runtime.megatron.ddp_config: bucket_size); Megatron-FSDP chooses its
        # own prefetch, which the plan's prefetch bucket only suggests, so that knob is DeepSpeed's.
        zero_buckets = plan.dp > 1 and (plan.zero_stage >= 1 or megatron)
        sharded = plan.prefetch_bucket_bytes > 0 and plan.zero_stage == 3 and plan.dp > 1 and not megatron
        for delta in checkpoint_deltas:
            options = _with_checkpoint_delta(plan, delta)
            if options is None:
                continue
            for bucket_scale in (bucket_scales if zero_buckets else (None,)):
                for prefetch_scale in (prefetch_scales if sharded else (None,)):
                    reduce_bucket = round(plan.reduce_bucket_bytes * (bucket_scale or 1.0))
                    prefetch_bucket = round(plan.prefetch_bucket_bytes * (prefetch_scale or 1.0))
                    priced = planner.build_plan(strategy, plan.stage_layers, options, reduce_bucket,
                                                prefetch_bucket)
                    if priced.prediction.peak_memory_bytes > budget:
                        continue
                    knobs = Knobs(label, delta, bucket_scale, prefetch_scale)
                    found.append(Candidate(knobs, strategy, plan.stage_layers, options, priced))
    found.sort(key=lambda c: not c.knobs.is_base())  # stable: the base plans, then their knobs
    return found


def calibrated_planner(planner: Planner, calibration: Calibration | None) -> Planner:
    """``planner`` with other correction factors."""
    return Planner(planner.model, planner.cluster, planner.train, planner.pins, planner.profile, calibration)
