"""The planner: global strategies by branch and bound, per-stage layer choices by the DP, layouts.

For every global strategy (degrees, ZeRO stage, micro-batch) the cost model prices each layer group
under each per-layer option once. A lower bound on the step time (every layer at its fastest option,
perfectly balanced stages, no memory limit) orders the strategies; they are solved best bound first,
and the search stops when the next bound cannot beat the K-th best plan found (branch and bound,
as Galvatron's and Alpa's searches prune with bounds). Solving a strategy runs the stage DP for
every pipeline position (the first stage with the embedding, the middle ones, the last with the
head; each with its own number of micro-batches in flight), answering every possible layer count
at once, then picks the layout (first and last stage layer counts, middle stages of q or q + 1
layers) with the least 1F1B step time. The result is exact for the cost model up to the memory rounding of the DP (memory is
rounded up, so a plan never exceeds the budget).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from dsauto.cost.calibration import Calibration
from dsauto.cost.layer import CostModel, LayerCost, gathered_unit_params
from dsauto.cost.measured import MeasuredCosts
from dsauto.cost.step import (
    bucket_bytes,
    deepspeed_pipeline_applies,
    first_chunk_share,
    gradient_transient_bytes,
    held_bucket_bytes,
    in_flight,
    layer_group_of,
    p2p_exposed_seconds,
    p2p_hidden_fraction,
    predict_step,
    prefetch_bytes,
    stage_constant_bytes,
)
from dsauto.cost.strategy import LayerOption, Strategy
from dsauto.cost.terms import sharded_gather_bytes
from dsauto.cost.zero3 import (
    head_moment_bytes,
    layer_backward_bytes,
    regathered_head_bytes,
    sharded_param_bytes,
    zero3_moments_apply,
)
from dsauto.errors import DsautoError
from dsauto.plan import LayerChoice, Plan, block_recompute_set, chunk_layers, rank_layers, rank_totals
from dsauto.search.dp import solve_prefixes
from dsauto.search.space import (
    Constraints,
    allowed,
    explain_empty_space,
    layer_options,
    offloaded_variants,
    pinned_stage_layers,
    strategies,
)
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.model import LayerGroup, ModelSpec, layer_groups, mixed_layer_kinds
from dsauto.spec.training import TrainSpec
from dsauto.units import format_bytes

EMBEDDING, BLOCK, HEAD = 0, 1, 2

BLOCK_NS_TRIED = 1
"""Below the most layers any model chunk checkpoints, how many smaller N of Megatron's block
recomputation :meth:`Planner._solve` tries."""

MEMORY_STEPS = 4096
"""Resolution of the DP's memory axis: each layer's memory above its smallest option is rounded up
to 1/4096 of the stage's whole range of choice, so the rounding costs well under 1% of the budget."""

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class _Priced:
    """One strategy's per-group, per-option costs as arrays (groups x options)."""

    strategy: Strategy
    options: tuple[LayerOption, ...]
    time: np.ndarray  # fwd + bwd per micro-batch, plus per-step costs spread over the micro-batches
    compute: np.ndarray  # fwd + bwd per micro-batch alone (for the lower bound)
    static: np.ndarray
    activation: np.ndarray
    transient: np.ndarray
    p2p_seconds: float
    optimizer_seconds: float  # whole replica
    constant_bytes: float  # what every rank holds besides its layers (reduction buckets)
    budget_bytes: float  # for layers: the device budget less constant_bytes
    reserves: tuple[float, ...] = ()  # per pipeline rank: bytes of budget_bytes kept back (_fit_tighter)
    zero3: _Zero3Rows | None = None  # ZeRO-3's moments, exact but for the gathered parameters (_fit_zero3)
    left_out: np.ndarray | None = None  # the gradients ``static`` leaves out (_counted_state), or None
    comm_overlap_efficiency: float = 0.0  # the device's, for the transfers the strategy overlaps (p2p_hidden)
    mixed_layers: bool = False  # layers of several kinds, priced apart per stage (spec.model.mixed_layer_kinds)

    @property
    def p2p_hidden(self) -> float:
        """The share of the steady-state pipeline transfers compute hides (cost.step.p2p_hidden_fraction):
        derived from the strategy, so that a copy for another chunk count has its own."""
        return p2p_hidden_fraction(self.strategy, self.comm_overlap_efficiency)

    def reserve(self, rank: int) -> float:
        return self.reserves[rank] if self.reserves else 0.0

    def lower_bound(self, num_layers: int) -> float:
        s = self.strategy
        # Valid because the predicted step is at least (m + p - 1) times the mean stage time plus
        # the optimizer of its slowest stage; per-step gathers and gradient sync only add to it.
        fastest = self.compute.min(axis=1)  # inf marks the options a group may not take
        total = fastest[EMBEDDING] + fastest[HEAD] + num_layers * fastest[BLOCK]
        v = s.virtual_stages
        # at least (1 - hidden) of the transfers are waited for (cost.step.p2p_exposed_seconds)
        p2p = 2 * v * self.p2p_seconds * (1 - self.p2p_hidden) if s.pp > 1 else 0.0
        # The step is m * slowest plus each other rank's first chunk, at least 1/v of its stage
        # (cost.step.interleaved_makespan), >= (m + (p - 1) / v) * mean stage time. Predictions simulate
        # the interleaved schedule, which takes that of balanced chunks and more of uneven ones (the
        # head's). A layout heavier in its first ranks fills in less: with as many micro-batches as
        # ranks and a light last rank (a small vocabulary) the bound exceeds such a plan by up to 1.5%,
        # so a strategy that close to the best may be bounded out; a bound true of every layout,
        # about (m + (p - 1) / (2 v)) x the mean, would solve 60% more strategies for gpt3-175b
        # (tests/search/test_dimension_oracle.py checks the bound on solved plans).
        # Layers of several kinds (local and global attention, dense and MoE) are priced apart in each
        # chunk, so a first chunk may hold much less than 1/v of its stage: only m x the mean is kept;
        # so too where a pinned layout gives the chunks their own counts.
        fill = 0.0 if (self.mixed_layers or s.chunk_layout is not None) and v > 1 else (s.pp - 1) / v
        return (s.grad_accum + fill) * (total / s.pp + p2p) + self.optimizer_seconds / s.pp

    def least_memory(self, num_layers: int, recompute_num_layers: int | None = None) -> float:
        """A lower bound on the peak memory of the busiest rank, whatever the layout: the mean over
        the stages of their smallest model state and kept activations (each stage holds at least the
        last stage's micro-batches in flight), the smallest transient of any layer, and what every
        rank holds besides its layers. Under ``--recompute-num-layers N`` at most N layers of each
        model chunk are checkpointed."""
        s = self.strategy
        flight = in_flight(s.pp - 1, s.pp, s.grad_accum, s.virtual_stages)
        kept = np.where(np.isfinite(self.time), self.static + flight * self.activation, np.inf)
        smallest = kept.min(axis=1)
        blocks = smallest[BLOCK] * num_layers
        if recompute_num_layers is not None:
            checkpointed = np.array([o.checkpoint for o in self.options])
            with_ = kept[BLOCK][checkpointed].min(initial=np.inf)
            without = kept[BLOCK][~checkpointed].min(initial=np.inf)
            most = min(num_layers, recompute_num_layers * s.virtual_stages * s.pp)
            blocks = most * min(with_, without) + (num_layers - most) * without
        least_transient = np.where(np.isfinite(self.time), self.transient, np.inf).min()
        per_stage = (blocks + smallest[EMBEDDING] + smallest[HEAD]) / s.pp
        least = per_stage + least_transient + self.constant_bytes
        if self.left_out is not None:
            # Where the layers' columns bound a moment before any gradient exists, the end of
            # backward holds the whole model state besides: at least that too.
            state = np.where(np.isfinite(self.time), self.static + self.left_out, np.inf).min(axis=1)
            least = max(least, (state[BLOCK] * num_layers + state[EMBEDDING] + state[HEAD]) / s.pp)
        return least

    def least_state(self, num_layers: int) -> float:
        """A lower bound on the model state (weights, gradients and optimizer state the device holds)
        of the busiest rank, whatever the layout and the per-layer choices: the mean over the stages
        of each layer's smallest state. Beside :meth:`least_memory` it tells a plan that cannot fit
        its state from one whose activations are what overflows."""
        static = self.static if self.left_out is None else self.static + self.left_out
        state = np.where(np.isfinite(self.time), static, np.inf).min(axis=1)
        return (state[BLOCK] * num_layers + state[EMBEDDING] + state[HEAD]) / self.strategy.pp


def chunk_checkpoints(options: Sequence[LayerOption], stage_layers: Sequence[int], virtual_stages: int,
                      chunks: Sequence[int] | None = None) -> list[int]:
    """How many transformer layers each model chunk checkpoints whole under per-layer ``options``
    (embedding, transformer layers 1..L, head), chunks in the order of :func:`dsauto.plan.chunk_layers`."""
    counts, start = [], 1
    for count in chunk_layers(stage_layers, virtual_stages, chunks):
        counts.append(sum(options[layer].checkpoint for layer in range(start, start + count)))
        start += count
    return counts


def block_recompute_options(options: Sequence[LayerOption], stage_layers: Sequence[int],
                            virtual_stages: int, chunks: Sequence[int] | None = None) -> list[LayerOption]:
    """Per-layer ``options`` (embedding, transformer layers 1..L, head) with their whole-layer
    checkpointing as Megatron-core runs it: ``--recompute-method block --recompute-num-layers N``
    checkpoints the first N layers of every model chunk (:func:`dsauto.plan.block_recompute_set`), one
    N for all, so a per-layer choice becomes the smallest N that checkpoints as many layers as any chunk
    asks for (more recomputation where a chunk asked for fewer, never more memory). Options that
    recompute modules selectively are left as they are (one granularity for every layer)."""
    layers = range(1, len(options) - 1)
    if any(options[layer].recompute_modules for layer in layers):
        return list(options)
    covered = block_recompute_set(stage_layers, virtual_stages,
                                  max(chunk_checkpoints(options, stage_layers, virtual_stages, chunks)), chunks)
    return [dataclasses.replace(option, checkpoint=layer in covered) if layer in layers else option
            for layer, option in enumerate(options)]


def _gradient_free_moment(strategy: Strategy) -> bool:
    """Whether a moment of the strategy's step holds a stage's activations in flight before any
    gradient exists, so that the layer DP bounds its peak without the layers' gradients (a lower
    bound, whose plans the prediction checks: :meth:`Planner._fit_tighter`): the loss of the first
    micro-batch under DeepSpeed's pipeline engine over one replica (:func:`deepspeed_pipeline_moment_peak`
    in dsauto.cost.step), and of a step's only micro-batch under DeepSpeed without ZeRO."""
    return deepspeed_pipeline_applies(strategy) or (
        strategy.engine == "deepspeed" and strategy.zero_stage == 0 and strategy.dims.replicas > 1
        and strategy.grad_accum == 1)


def _counted_state(strategy: Strategy, cost: LayerCost) -> float:
    """The model state the layer DP counts for a layer priced ``cost``: its static bytes, less its
    gradients where the bound is a moment before any gradient exists (:func:`_gradient_free_moment`),
    so that each pipeline stage leaves out its own gradients, not the whole model's."""
    return cost.static_bytes - (cost.grads_bytes if _gradient_free_moment(strategy) else 0.0)


def _beside_activations(strategy: Strategy, grads_bytes: float, bucket: int) -> float:
    """Of a rank's constant bytes (:func:`dsauto.cost.step.stage_constant_bytes` of its gradients,
    ``grads_bytes``), those alive at the moments the layer DP prices: the kept state, the
    activations in flight and a layer's transient. DeepSpeed without ZeRO flattens its gradients
    into a copy for the all-reduce only after backward, when the activations are gone
    (``predict_step`` takes the largest of the moments), so that copy is not counted with them; and
    the pipeline engine's constant is its gradients', which the layers' columns already leave out
    (:func:`_counted_state`)."""
    if deepspeed_pipeline_applies(strategy) or (
            strategy.engine == "deepspeed" and strategy.zero_stage == 0 and strategy.dims.replicas > 1):
        return 0.0
    return stage_constant_bytes(strategy, bucket, grads_bytes)


def _without_dominated_exchanges(space: list[Strategy], priced: list[_Priced | None]
                                 ) -> tuple[list[Strategy], list[_Priced | None]]:
    """``space`` and its prices less the strategies whose context-parallel exchange (``cp_comm_type``)
    is dominated: a twin that differs only in it costs no more time and no more memory in every
    group and option, so the dynamic program cannot find a better plan for the dominated one (the
    exchange enters the step only through these arrays). A partial distributed optimizer's variant
    goes with its one-instance twin."""
    twins: dict[Strategy, list[_Priced]] = {}
    for s, p in zip(space, priced):
        if p is not None and s.dims.cp > 1 and p.zero3 is None:
            twins.setdefault(dataclasses.replace(s, cp_comm_type="p2p"), []).append(p)
    dropped: set[Strategy] = set()
    for members in twins.values():
        for i, a in enumerate(members):
            for j, b in enumerate(members):
                if j == i or b.strategy in dropped:
                    continue
                arrays = ((b.time, a.time), (b.compute, a.compute), (b.static, a.static),
                          (b.activation, a.activation), (b.transient, a.transient))
                no_worse = all(np.all((y <= x) | (np.isinf(x) & np.isinf(y))) for y, x in arrays)
                if no_worse and (j < i or any(np.any(y < x) for y, x in arrays)):  # equal twins: keep the first
                    dropped.add(a.strategy)
                    break
    if not dropped:
        return space, priced
    keep = [k for k, s in enumerate(space)
            if s not in dropped and dataclasses.replace(s, dist_opt_instances=1) not in dropped]
    return [space[k] for k in keep], [priced[k] for k in keep]


@dataclass(frozen=True)
class _Zero3Rows:
    """ZeRO-3's moments (dsauto.cost.zero3) per group and option, exact but for what depends on
    several layers' options: the gathered parameters of the stage and a tied table's second copy."""

    activation: np.ndarray
    transient: np.ndarray  # each layer's moment without its gathered unit
    sharded: np.ndarray  # bool: the option keeps the layer sharded
    params: np.ndarray  # the layer's parameter bytes where sharded (their sum: the sharded bytes)
    units: np.ndarray  # its gathered unit's bytes where sharded (their max: the prefetch bucket)
    regathered: np.ndarray  # per option of the head: the tied table's second copy when sharded


def _zero3_moment_rows(model: ModelSpec, groups: Sequence[LayerGroup], options: Sequence[LayerOption],
                       cost: CostModel, time: np.ndarray, act: np.ndarray, trans: np.ndarray,
                       awaiting: float) -> _Zero3Rows:
    """ZeRO-3's moments (dsauto.cost.zero3) in the layer DP's arrays, in place, as a lower bound of
    the prediction: a layer's backward holds the weight gradient ``awaiting`` its hook, the loss
    its head's moment (:func:`head_moment_bytes`); the gathered parameters, which the prediction
    counts for the stage at every moment (:func:`dsauto.cost.zero3.gathered_params_bytes`), are
    counted at every moment for the embedding and the head (their floor) and at their own moment
    for a block (its unit in use). A tied head's second copy depends on the embedding's option too:
    a sharded embedding's moment is at least the least of the head's (``time``: inf where an option
    is not allowed). Returns the rows without those bounds, for :meth:`Planner._fit_zero3`."""
    dynamic, ctx = cost.calibration.activation_memory, cost.context
    shape = trans.shape
    sharded, params, units = np.zeros(shape, dtype=bool), np.zeros(shape), np.zeros(shape)
    in_use = np.zeros(shape)
    trans[[EMBEDDING, BLOCK]] += awaiting
    head = groups[HEAD]
    for gi, group in enumerate(groups):
        for oi, option in enumerate(options):
            if ctx.shards(option):
                sharded[gi, oi] = True
                params[gi, oi] = dynamic * sharded_param_bytes([group], [option], [0], ctx.tp, ctx.dtype_bytes)
                units[gi, oi] = dynamic * gathered_unit_params(group, option, ctx.tp, ctx.experts_gathered_whole) * ctx.dtype_bytes
                in_use[gi, oi] = dynamic * sharded_gather_bytes(group, option, ctx)
    trans -= in_use
    trans[BLOCK] += dynamic * layer_backward_bytes(cost.tokens, model.hidden_size, model.ffn_hidden_size, ctx.tp,
                                                   ctx.dtype_bytes)
    for oi, option in enumerate(options):
        trans[HEAD, oi] = head_moment_bytes(trans[HEAD, oi], head, option,
                                            option.shard_params and not model.tied_embeddings,
                                            cost.tokens, ctx.tp, ctx.dtype_bytes, dynamic)
    # The head's kept activations are freed by its backward, before any other layer's: they belong
    # to the loss's moment alone (one stage, one micro-batch in flight).
    trans[HEAD] += act[HEAD]
    act[HEAD] = 0.0
    regathered = np.array([dynamic * regathered_head_bytes(head, option, model.tied_embeddings, ctx.tp,
                                                           ctx.dtype_bytes) for option in options])
    exact = _Zero3Rows(act.copy(), trans.copy(), sharded, params, units, regathered)
    trans[BLOCK] += in_use[BLOCK]
    for row in (EMBEDDING, HEAD):
        act[row] += np.where(sharded[row], np.minimum(params[row], 2 * units[row]), 0.0)
    if model.tied_embeddings:
        finite = np.isfinite(time[HEAD])
        least = (trans[HEAD] + regathered)[finite].min() if finite.any() else 0.0
        trans[EMBEDDING] = np.where(sharded[EMBEDDING], np.maximum(trans[EMBEDDING], least), trans[EMBEDDING])
    return exact


@dataclass(frozen=True)
class _Solved:
    strategy: Strategy
    stage_layers: tuple[int, ...]
    options: tuple[LayerOption, ...]  # per flat layer
    objective: float = math.inf  # the layer DP's step time of it
    plan: Plan | None = dataclasses.field(default=None, compare=False)  # its plan, where already built


def _takes_fastest(priced: _Priced, options: Sequence[LayerOption]) -> bool:
    """Whether every layer of ``options`` (one per flat layer) takes its fastest option in ``priced``."""
    rows = [EMBEDDING, *[BLOCK] * (len(options) - 2), HEAD]
    return all(priced.time[row, priced.options.index(option)] <= priced.time[row].min()
               for row, option in zip(rows, options))


def _plan_options(plan: Plan) -> list[LayerOption]:
    """``plan``'s option of each flat layer."""
    return [LayerOption(c.checkpoint, c.shard_params, c.split, c.recompute_modules)
            for c in (plan.layer_choice(j) for j in range(plan.model.num_layers + 2))]


def _needless_selective(strategy: Strategy, bound: float, fitted: dict[Strategy, tuple[Plan, _Priced]]) -> bool:
    """Whether selective recomputation cannot help ``strategy`` (whose lower bound is ``bound``): its
    twin without it already has a plan whose every layer takes its fastest option, and recomputing
    parts of each layer only adds time to them. With one stage that plan is then at least as fast as
    any of ``strategy``; with more, a layout that only the memory freed would fit could be faster,
    unless ``strategy``'s bound rules it out. (A twin plan that merely checkpoints no layer is not
    enough: the memory freed may let the head split its loss less, or a layer stay resident.)"""
    if not strategy.recompute_modules:
        return False
    twin = fitted.get(dataclasses.replace(strategy, recompute_modules=()))
    if twin is None or not _takes_fastest(twin[1], _plan_options(twin[0])):
        return False
    return strategy.pp == 1 or bound >= twin[0].prediction.step_seconds


def _one_stage_order(picked: Sequence[int]) -> list[int]:
    """A one-stage DP's choices, solved in the order embedding, head, blocks, in flat layer order."""
    return [picked[0], *picked[2:], picked[1]]


NEAR_MISS_BUDGETS = (1.05, 1.25)
"""The looser budgets, as multiples of the device's, under which a search that fits nothing looks
for the nearest plan to quote (:meth:`Planner._near_miss`)."""


class Planner:
    """Searches plans for one model, cluster and workload. Pure: same inputs, same plans."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                 pins: Constraints | None = None, profile: MeasuredCosts | None = None,
                 calibration: Calibration | None = None):
        """``calibration`` overrides the correction factors stored with ``profile``."""
        self.model, self.cluster, self.train = model, cluster, train
        self.pins = pins or Constraints()
        self.profile = profile
        self.calibration = calibration
        self._mixed_layers = mixed_layer_kinds(model, train.seq_len)

    def _price(self, strategy: Strategy) -> _Priced:
        groups = layer_groups(self.model, self.train.seq_len, self.train.dtype_bytes, strategy.tp)
        cost = CostModel(self.cluster, self.train, strategy, self.model.hidden_size, self.profile,
                         self.calibration)
        options = layer_options(strategy)
        shape = (3, len(options))
        time, compute, static, act, trans = (np.full(shape, np.inf), np.full(shape, np.inf),
                                             np.zeros(shape), np.zeros(shape), np.zeros(shape))
        left_out = np.zeros(shape) if _gradient_free_moment(strategy) else None
        optimizer, grads = 0.0, 0.0
        for gi, group in enumerate(groups):
            first: LayerCost | None = None  # the group's cost under options[0]
            for oi, option in enumerate(options):
                if not allowed(group.kind, option, self.pins, strategy.recompute_modules):
                    continue
                c = cost.layer(group, option)
                if oi == 0:
                    first = c
                compute[gi, oi] = c.forward_seconds + c.backward_seconds
                time[gi, oi] = compute[gi, oi] + c.step_seconds / strategy.grad_accum
                static[gi, oi] = _counted_state(strategy, c)
                if left_out is not None:
                    left_out[gi, oi] = c.static_bytes - static[gi, oi]
                act[gi, oi] = c.activation_bytes
                trans[gi, oi] = c.transient_bytes
            if first is None:  # options[0] is not one this group may take
                first = cost.layer(group, options[0])
            # The optimizer update does not depend on the per-layer option. Gradients of the whole
            # replica bound any one stage's (ZeRO-0's flattened copy).
            optimizer += group.count * first.optimizer_seconds
            grads += group.count * first.grads_bytes
        bucket = bucket_bytes(groups, strategy.tp, self.train.dtype_bytes)
        # Any stage may hold the model's largest matrix (a bound: predict_step uses its own stage's).
        largest_grad = max(gathered_unit_params(g, o, strategy.tp, strategy.experts_gathered_whole)
                           for g in groups for o in options) * self.train.dtype_bytes
        zero3 = None
        if zero3_moments_apply(strategy):
            zero3 = _zero3_moment_rows(self.model, groups, options, cost, time, act, trans,
                                       min(largest_grad * cost.calibration.static_memory,
                                           grads * strategy.dims.replicas))
        held_bucket = held_bucket_bytes(strategy, bucket, self.train.dtype_bytes)
        constant = (_beside_activations(strategy, grads, held_bucket)
                    + gradient_transient_bytes(strategy, bucket, largest_grad * cost.calibration.static_memory,
                                               grads * (strategy.dims.replicas if strategy.zero_stage >= 2 else 1)))
        return _Priced(strategy, options, time, compute, static, act, trans,
                       cost.p2p_seconds() if strategy.pp > 1 else 0.0, optimizer, constant,
                       self.cluster.memory_budget_bytes - constant, zero3=zero3, left_out=left_out,
                       comm_overlap_efficiency=self.cluster.device.comm_overlap_efficiency,
                       mixed_layers=self._mixed_layers)

    def _price_selective(self, strategy: Strategy, plain: _Priced) -> _Priced:
        """``strategy``, which recomputes modules selectively, priced from ``plain``: the same
        strategy without selective recomputation. Only the transformer layers' row changes: the
        options of both start with the same uncheckpointed ones (:func:`layer_options`), which the
        embedding and head take, and the CostModel does not depend on the strategy's modules."""
        if plain.zero3 is not None:
            return self._price(strategy)  # ZeRO-3's moments span the rows (_zero3_moment_rows)
        options = layer_options(strategy)
        cost = CostModel(self.cluster, self.train, strategy, self.model.hidden_size, self.profile,
                         self.calibration)
        block = layer_groups(self.model, self.train.seq_len, self.train.dtype_bytes, strategy.tp)[BLOCK]
        arrays = {name: getattr(plain, name).copy() for name in ("time", "compute", "static", "activation",
                                                                 "transient")}
        if plain.left_out is not None:
            arrays["left_out"] = plain.left_out.copy()
        arrays["time"][BLOCK] = arrays["compute"][BLOCK] = np.inf
        for name in ("static", "activation", "transient", "left_out"):
            if name in arrays:
                arrays[name][BLOCK] = 0.0
        for oi, option in enumerate(options):
            if allowed(block.kind, option, self.pins, strategy.recompute_modules):
                c = cost.layer(block, option)
                arrays["compute"][BLOCK, oi] = c.forward_seconds + c.backward_seconds
                arrays["time"][BLOCK, oi] = arrays["compute"][BLOCK, oi] + c.step_seconds / strategy.grad_accum
                arrays["static"][BLOCK, oi] = _counted_state(strategy, c)
                arrays["activation"][BLOCK, oi] = c.activation_bytes
                arrays["transient"][BLOCK, oi] = c.transient_bytes
                if "left_out" in arrays:
                    arrays["left_out"][BLOCK, oi] = c.static_bytes - arrays["static"][BLOCK, oi]
        return dataclasses.replace(plain, strategy=strategy, options=options, **arrays)

    def _stage_dp(self, priced: _Priced, sequence: Sequence[int], flight: int, reserve: float = 0.0,
                  prefixes: int | None = None, lead: int = 0, recompute_n: int | None = None,
                  checkpointed: int | None = None):
        """Prefix DP over the layer groups in ``sequence`` with ``flight`` micro-batches in flight,
        ``reserve`` bytes of the layer budget kept back; answered for the first ``prefixes`` layers
        only when given. The memory unit is the whole sequence's either way, so each prefix's answer
        does not depend on ``prefixes``. The transformer layers follow the ``lead`` rows of the
        embedding or head; under Megatron's block recomputation of ``recompute_n`` layers each takes
        the checkpointing that :meth:`_pinned_recompute` gives its position, or, where given, the first
        ``checkpointed`` of them are checkpointed and no others (a rank of a pinned chunk layout, whose
        block recomputation checkpoints that many of its layers)."""
        rows = np.asarray(sequence, dtype=np.int64)
        time = priced.time[rows]
        wanted = (self._pinned_recompute(len(rows) - lead, priced.strategy.virtual_stages, recompute_n)
                  if checkpointed is None else np.arange(max(len(rows) - lead, 0)) < checkpointed)
        if wanted is not None:
            option_checkpoints = np.array([o.checkpoint for o in priced.options])
            block_rows = np.arange(len(rows)) >= lead
            wrong = np.zeros(time.shape, dtype=bool)
            wrong[block_rows] = option_checkpoints[None, :] != wanted[:, None]
            time = np.where(wrong, np.inf, time)
        finite = np.isfinite(time)
        memory = np.where(finite, priced.static[rows] + flight * priced.activation[rows], 0.0)
        transient = np.where(finite, priced.transient[rows], 0.0)
        baseline = np.where(finite, memory, np.inf).min(axis=1)
        delta = np.where(finite, memory - baseline[:, None], 0.0)
        unit = max(delta.max(axis=1).sum() / MEMORY_STEPS, 1.0)
        q_memory = np.ceil(delta / unit - 1e-9).astype(np.int64)
        # The transient and the room are not rounded (the DP subtracts one from the other before it
        # rounds down), so the smallest choices fit however close their peak is to the budget; the
        # room gains 1e-9 of a unit against the float division.
        room = priced.budget_bytes - reserve - np.concatenate([[0.0], np.cumsum(baseline)])
        budgets = np.maximum(room, -unit) / unit + 1e-9
        n = len(rows) if prefixes is None else prefixes
        return solve_prefixes(time[:n], q_memory[:n], transient[:n] / unit, budgets[: n + 1])

    @staticmethod
    def _pinned_recompute(blocks: int, virtual_stages: int, n: int | None) -> np.ndarray | None:
        """Under Megatron's block recomputation of ``n`` layers (``--recompute-num-layers N``): whether the j-th transformer layer a pipeline rank's DP
        adds is checkpointed, for j < ``blocks``; None without the pin. A rank of j layers splits them
        over its chunks as :func:`dsauto.plan.chunk_layers` does (the earlier chunks taking the
        remainder), so its (j + 1)-th layer lengthens a chunk of j // v layers, which Megatron's block
        method checkpoints when that is below N: every prefix of the DP then checkpoints exactly the
        layers Megatron would on a rank of that many (:meth:`_block_order` puts them in place); None
        where each layer is chosen alone."""
        if n is None:
            return None
        return np.arange(max(blocks, 0)) // virtual_stages < n

    def _block_order(self, options: Sequence[LayerOption], stage_layers: Sequence[int],
                     virtual_stages: int, n: int | None, chunks: Sequence[int] | None = None) -> list[LayerOption]:
        """``options`` (one per flat layer) with each rank's transformer layers reordered so that,
        under ``--recompute-num-layers N``, its checkpointed ones are the first N of each of its model
        chunks (the DP checkpoints the right number per rank, by position: :meth:`_pinned_recompute`);
        unchanged where ``n`` is None."""
        if n is None:
            return list(options)
        out, L = list(options), self.model.num_layers
        wanted = block_recompute_set(stage_layers, virtual_stages, n, chunks)
        for held in rank_layers(stage_layers, virtual_stages, chunks):
            blocks = [j for j in held if 1 <= j <= L]
            picked = {flag: [out[j] for j in blocks if out[j].checkpoint == flag] for flag in (True, False)}
            assert len(picked[True]) == sum(j in wanted for j in blocks), \
                "the DP checkpoints as many layers per rank as the block method"
            for j in blocks:
                out[j] = picked[j in wanted].pop(0)
        return out

    def _solve(self, priced: _Priced) -> _Solved | None:
        """The layer DP's plan of one strategy. Megatron-core checkpoints the first N layers of every
        model chunk, one N for all (--recompute-method block); where the DP's own choice checkpoints
        another number in some chunk, the N of the chunk that chose most and the few below it
        (:data:`BLOCK_NS_TRIED`, down to the fewest any chunk chose) are solved for exactly
        (:meth:`_pinned_recompute`), and the fastest whose predicted peak fits is the strategy's plan.
        An N above them checkpoints more than every chunk needed; far below them, the chunk that
        needed most must shed layers to others."""
        s = priced.strategy
        if s.chunk_layout is not None and not s.recompute_modules and self.pins.recompute_num_layers is None:
            # A pinned layout whose chunks hold unequal counts: every N from none to the largest chunk
            # (every layer), each rank's DP checkpointing as many layers as N does in its chunks.
            candidates = [c for n in range(max(s.chunk_layout) + 1) if (c := self._solve_layout(priced, n)) is not None]
            return self._fastest_fitting(candidates)
        solved = self._solve_layout(priced, self.pins.recompute_num_layers)
        if solved is None or s.engine != "megatron" or s.recompute_modules or self.pins.recompute_num_layers is not None:
            return solved
        counts = chunk_checkpoints(solved.options, solved.stage_layers, s.virtual_stages)
        if min(counts) == max(counts):  # the first N of each chunk, as many as the DP chose
            return dataclasses.replace(solved, options=tuple(block_recompute_options(
                solved.options, solved.stage_layers, s.virtual_stages)))
        candidates = []
        for n in range(max(counts), max(min(counts), max(counts) - BLOCK_NS_TRIED) - 1, -1):
            candidate = self._solve_layout(priced, n)
            if candidate is not None:
                candidates.append(candidate)
        return self._fastest_fitting(candidates)

    def _fastest_fitting(self, candidates: list[_Solved]) -> _Solved | None:
        """Of one strategy's solutions, the fastest by the DP whose predicted peak fits, else the DP's fastest."""
        # The DP bounds memory at its moments; the prediction decides: the fastest by the DP whose
        # predicted peak fits (where none does, the DP's fastest goes on to the planner's own fitting).
        candidates.sort(key=lambda c: c.objective)
        built = []
        for candidate in candidates:
            built.append(dataclasses.replace(candidate, plan=self._plan_of(candidate)))
            if built[-1].plan.prediction.peak_memory_bytes <= self.cluster.memory_budget_bytes:
                return built[-1]
        return built[0] if built else None

    def _plan_of(self, solved: _Solved) -> Plan:
        """The plan of a solution, built once."""
        return solved.plan or self.build_plan(solved.strategy, solved.stage_layers, solved.options)

    def _solve_layout(self, priced: _Priced, recompute_n: int | None) -> _Solved | None:
        """The layer DP's plan of one strategy over its layouts, each layer's options chosen alone, or
        under Megatron's block recomputation of ``recompute_n`` layers where given."""
        s, L = priced.strategy, self.model.num_layers
        m, p, v = s.grad_accum, s.pp, s.virtual_stages
        if p == 1:
            sequence = [EMBEDDING, HEAD] + [BLOCK] * L
            solution = self._stage_dp(priced, sequence, in_flight(0, 1, m), priced.reserve(0), lead=2,
                                      recompute_n=recompute_n)
            if not np.isfinite(solution.best_time[L + 2]):
                return None
            picked = solution.choices(L + 2)
            flat = _one_stage_order(picked)
            return _Solved(s, (L,), tuple(priced.options[o] for o in flat), float(solution.best_time[L + 2]))

        # Layouts: middle stages of q or q + 1 layers, the extra ones on the last r middle stages
        # (later stages hold fewer micro-batches in flight, so they have room to spare); the first
        # and last stages take any split of the rest. Equal middle stages (r = 0) are Megatron's
        # first/last-stage flags; the rest need its pipeline layout string.
        # With v chunks per rank (interleaved 1F1B) every stage but the last holds at least v layers, one
        # a chunk; the last holds at least one (below). A pinned layout (--stage-layers) is the one
        # layout tried, and may leave chunks empty.
        mids = p - 2
        pinned = pinned_stage_layers(self.pins, L, p, v)
        # The last stage may hold a single layer: its chunks then leave the last one to the head (and
        # the prediction layers beside it), as NVIDIA's DeepSeek-V3 layouts do ("...|tt|mL").
        least_last = 1
        if pinned is None:
            q_values = [q for q in range(max(1, L // p - 1), -(-L // p) + 2)
                        if mids * q <= L - v - least_last and q >= v] if mids else [0]
            if not q_values:
                return None
            middles = [[q + (1 if i >= mids - r else 0) for i in range(mids)]
                       for q in q_values for r in range(mids if mids else 1)]
            # The first and last stages share the layers the middle ones leave, at most
            # L - mids * min(q), the first keeping at least v of them and the last least_last: no
            # layout reads either DP past that less least_last layers (and its embedding or head).
            ends, most_mid = L - mids * min(q_values) - least_last + 1, max(q_values) + 1
        else:
            middles = [list(pinned[1:-1])]
            ends, most_mid = max(pinned[0], pinned[-1]) + 1, max(pinned[1:-1], default=0)
        # A pinned chunk layout under block recomputation: each rank checkpoints the first N layers of
        # each of its chunks, so many of its layers in all (the DP places them by count).
        checkpointed: list[int | None] = [None] * p
        if s.chunk_layout is not None and recompute_n is not None:
            checkpointed = rank_totals([min(recompute_n, count) for count in s.chunk_layout], p, v)
        first = self._stage_dp(priced, [EMBEDDING] + [BLOCK] * (L - 1), in_flight(0, p, m, v), priced.reserve(0),
                               ends, lead=1, recompute_n=recompute_n, checkpointed=checkpointed[0])
        last = self._stage_dp(priced, [HEAD] + [BLOCK] * (L - 1), in_flight(p - 1, p, m, v), priced.reserve(p - 1),
                              ends, lead=1, recompute_n=recompute_n, checkpointed=checkpointed[-1])

        def middle_key(i: int) -> tuple[int, int | None]:
            return in_flight(i, p, m, v), checkpointed[i]

        middle = {}
        for i in range(1, p - 1):
            if middle_key(i) not in middle:
                reserve = max(priced.reserve(k) for k in range(1, p - 1) if middle_key(k) == middle_key(i))
                middle[middle_key(i)] = self._stage_dp(priced, [BLOCK] * most_mid, middle_key(i)[0], reserve,
                                                       recompute_n=recompute_n, checkpointed=checkpointed[i])
        sends = 2 * v * priced.p2p_seconds

        def waited(t: np.ndarray) -> np.ndarray:
            """Stage times with the transfers the step waits for (cost.step.p2p_exposed_seconds)."""
            with np.errstate(invalid="ignore"):
                return np.where(np.isfinite(t), t + p2p_exposed_seconds(t, sends, priced.p2p_hidden), np.inf)

        if v > 1:  # the interleaved objective's first chunks: the share of a stage of n layers, the ends' times
            shares = np.array([first_chunk_share(n, v) for n in range(L + 1)])
            emb, head = (float(np.where(np.isfinite(priced.time[g]), priced.time[g], np.inf).min())
                         for g in (EMBEDDING, HEAD))
        # Row i: the best times of the (i + 1)-th rank's DP, by its number of layers.
        mid_best = np.array([middle[middle_key(i)].best_time for i in range(1, p - 1)]
                            or np.zeros((0, most_mid + 1)))
        mid_waited, first_waited, last_waited = waited(mid_best), waited(first.best_time), waited(last.best_time)
        mid_rows = np.arange(mids)
        best, best_layout = math.inf, None
        for counts in middles:
            rest = L - sum(counts)
            if rest < v + least_last and pinned is None:
                continue
            mid_times = mid_waited[mid_rows, counts]
            if mids and not np.isfinite(mid_times).all():
                continue
            n_first = np.arange(v, rest - least_last + 1) if pinned is None else np.array([pinned[0]])
            t_first = first_waited[n_first + 1]
            t_last = last_waited[rest - n_first + 1]
            mid_sum = mid_times.sum() if mids else 0.0
            mid_max = mid_times.max() if mids else 0.0
            # The closed forms of the schedules as the search objective (predictions simulate them).
            slowest = np.maximum(np.maximum(t_first, t_last), mid_max)
            if v == 1:
                makespan = t_first + t_last + mid_sum + ((m - 1) * slowest if m > 1 else 0.0)
            else:  # interleaved: each rank's fill and drain is its first chunk (cost.step.interleaved_makespan)
                # A rank's first chunk: its share of the transformer layers, the embedding on the
                # first rank (the head sits in the last rank's last chunk), and its two boundaries.
                ends = 2 * priced.p2p_seconds
                w_first = (first.best_time[n_first + 1] - emb) * shares[n_first] + emb + ends
                w_last = (last.best_time[rest - n_first + 1] - head) * shares[rest - n_first] + ends
                w_mid = mid_best[mid_rows, counts] * shares[counts] + ends if mids else np.zeros(1)
                w_mid_max = w_mid[int(np.argmax(mid_times))] if mids else 0.0
                with np.errstate(invalid="ignore"):  # inf - inf where a stage cannot fit
                    # the slowest stage's own fill is not added (ties: first, middle, last, as predicted)
                    w_slowest = np.where(t_first >= np.maximum(mid_max, t_last), w_first,
                                         np.where(mid_max >= t_last, w_mid_max, w_last))
                    makespan = m * slowest + w_first + w_last + w_mid.sum() - w_slowest
                makespan = np.where(np.isfinite(slowest), makespan, np.inf)
            k = int(np.argmin(makespan))
            if np.isfinite(makespan[k]) and makespan[k] < best:
                best, best_layout = makespan[k], (int(n_first[k]), counts, rest - int(n_first[k]))
        if best_layout is None:
            return None
        n_first, counts, n_last = best_layout
        stage_layers = (n_first, *counts, n_last)
        per_rank = [list(first.choices(n_first + 1))]
        for i, c in enumerate(counts):
            per_rank.append(list(middle[middle_key(i + 1)].choices(c)))
        tail = last.choices(n_last + 1)
        per_rank.append(list(tail[1:]) + [tail[0]])  # the head is the rank's last layer
        flat = [0] * (L + 2)
        for choices, layers in zip(per_rank, rank_layers(stage_layers, v, s.chunk_layout)):
            for choice, layer in zip(choices, layers):
                flat[layer] = choice
        return _Solved(s, stage_layers,
                       tuple(self._block_order([priced.options[o] for o in flat], stage_layers, v, recompute_n,
                                               s.chunk_layout)),
                       float(best))

    def _fit_looser(self, priced: _Priced, solved: _Solved, fits: Plan) -> Plan:
        """``fits``, or a faster plan of the same strategy that fits too.

        The layer DP adds up each moment's largest part of a rank's memory (kept state, activations,
        the largest transient, the stage's buffers), which can overstate the peak the prediction
        finds: the buffers are bounded with the whole replica's gradients and largest matrix, where
        ``predict_step`` takes its own stage's. When the DP gave up a faster option
        and its plan leaves more than 1% of the budget unused, the DP runs again with its layer
        budget raised by what was left, a few times at most, and the fastest plan that fits is kept."""
        if _takes_fastest(priced, solved.options):
            return fits
        budget = self.cluster.memory_budget_bytes
        best, last, raised = fits, fits, 0.0
        for _ in range(3):
            slack = budget - last.prediction.peak_memory_bytes
            if slack <= 0.01 * budget:
                break
            raised += slack
            again = self._solve(dataclasses.replace(priced, budget_bytes=priced.budget_bytes + raised))
            if again is None:
                break
            last = self._plan_of(again)
            if last.prediction.peak_memory_bytes > budget:
                break
            if last.prediction.step_seconds < best.prediction.step_seconds:
                best = last
        return best

    def _fit_tighter(self, priced: _Priced, over: Plan, solved: _Solved) -> Plan | None:
        """A plan of ``priced``'s strategy that fits once the moments the layer DP prices only in
        part (the engine's buffers around the loss, the pipeline's boundary tensors, a Megatron-core
        last stage's copy of a tied embedding) are counted: the DP runs again with each pipeline
        rank's layer budget cut by what the prediction found beyond the DP's count on that rank (or,
        when that was already cut, by the overshoot), a few times at most, and the first plan that
        fits is kept (None when none does)."""
        budget = self.cluster.memory_budget_bytes
        reserves = [0.0] * priced.strategy.pp
        plan = over
        for _ in range(4):
            grown = [max(r, m) for r, m in zip(reserves, self._uncounted(priced, plan, solved.options))]
            if grown == reserves:
                grown = [r + plan.prediction.peak_memory_bytes - budget for r in reserves]
            reserves = grown
            solved = self._solve(dataclasses.replace(priced, reserves=tuple(reserves)))
            if solved is None:
                return None
            plan = self._plan_of(solved)
            if plan.prediction.peak_memory_bytes <= budget:
                return plan
        return None

    def _fit_zero3(self, priced: _Priced) -> Plan | None:
        """The fastest plan of a ZeRO-3 strategy (one stage) that fits with the gathered parameters
        counted exactly, or None. They are min(S, 2b) (:func:`dsauto.cost.zero3.gathered_params_bytes`:
        S the sharded layers' parameter bytes, b their largest unit), a sum or a bound on a max over
        the layers, which the DP prices in two regimes: S, each sharded layer's parameters at every
        moment; or 2u for each unit u a sharded layer may gather, the layers kept to units of at
        most u. Each regime counts a plan at or above its prediction, and each plan exactly in the
        regime its own min(S, 2b) takes, so the fastest of the regimes' plans that fits is the
        fastest plan that fits. A tied table's second copy (a chunked head's) adds the embedding's
        residency to the regimes."""
        z = priced.zero3
        assert z is not None and priced.strategy.pp == 1
        budget = self.cluster.memory_budget_bytes
        best: Plan | None = None
        embedding_choices = (False, True) if self.model.tied_embeddings else (None,)
        for embedding_sharded in embedding_choices:
            time, trans = priced.time.copy(), z.transient.copy()
            if embedding_sharded is not None:
                time[EMBEDDING, z.sharded[EMBEDDING] != embedding_sharded] = np.inf
                if embedding_sharded:
                    trans[HEAD] += z.regathered
            regimes = [(time, z.activation + z.params, 0.0)]
            for unit in np.unique(z.units[z.sharded & np.isfinite(time)]):
                regimes.append((np.where(z.sharded & (z.units > unit), np.inf, time), z.activation, 2 * unit))
            for masked, act, gathered in regimes:
                candidate = dataclasses.replace(priced, time=masked, activation=act, transient=trans,
                                                budget_bytes=priced.budget_bytes - gathered)
                solved = self._solve(candidate)
                if solved is None:
                    continue
                plan = self._plan_of(solved)
                if plan.prediction.peak_memory_bytes <= budget and (
                        best is None or plan.prediction.step_seconds < best.prediction.step_seconds):
                    best = plan
        return best

    def _uncounted(self, priced: _Priced, plan: Plan, options: Sequence[LayerOption]) -> list[float]:
        """Per pipeline rank: bytes of ``plan``'s predicted peak beyond what the layer DP counts for
        that rank's layers under ``options`` (the stage's constant, kept state, activations in
        flight and the largest transient)."""
        s, L = priced.strategy, self.model.num_layers
        out = []
        for i, held in enumerate(plan.rank_layers()):
            flight = in_flight(i, s.pp, s.grad_accum, s.virtual_stages)
            cells = [(EMBEDDING if j == 0 else HEAD if j == L + 1 else BLOCK, priced.options.index(options[j]))
                     for j in held]
            counted = (priced.constant_bytes + sum(priced.static[c] + flight * priced.activation[c] for c in cells)
                       + max(priced.transient[c] for c in cells))
            out.append(max(0.0, plan.stages[i].peak_bytes - counted))
        return out

    def _fit_update(self, priced: _Priced) -> Plan | None:
        """The fastest plan of ``priced``'s strategy whose optimizer update fits too, or None.

        The update's memory holds every layer's parameters, gradients and optimizer state plus
        option-independent temporaries (:func:`dsauto.cost.step.optimizer_step_bytes`); of the
        per-layer options only ZeRO-3 residency changes it. So with one stage and identical
        transformer layers, a plan fits the update exactly when few enough layers are resident: for
        each residency of the embedding and the head, the DP runs with at most k resident layers,
        and k is the largest that fits (fewer resident layers never use more memory). Under ZeRO 0-2
        the update does not depend on the per-layer options, and no other choice can help.
        """
        s, L = priced.strategy, self.model.num_layers
        sharded = np.array([o.shard_params for o in priced.options])
        if s.pp != 1 or s.zero_stage != 3 or sharded.all() or not sharded.any():
            return None

        def only(row: int, shard: bool) -> list[np.ndarray]:
            time = priced.time[row].copy()
            time[sharded != shard] = np.inf
            return [time] + [getattr(priced, name)[row] for name in ("compute", "static", "activation", "transient")]

        extra = [only(EMBEDDING, False), only(EMBEDDING, True), only(HEAD, False), only(HEAD, True),
                 only(BLOCK, True)]
        base = len(priced.time)
        names = ("time", "compute", "static", "activation", "transient")
        ext = dataclasses.replace(priced, **{name: np.vstack([getattr(priced, name)] + [e[n] for e in extra])
                                             for n, name in enumerate(names)})
        block_sharded = base + 4
        flight = in_flight(0, 1, s.grad_accum)
        budget = self.cluster.memory_budget_bytes

        def plan_for(embedding: int, head: int, resident: int) -> Plan | None:
            sequence = [embedding, head] + [BLOCK] * resident + [block_sharded] * (L - resident)
            solution = self._stage_dp(ext, sequence, flight, lead=2, recompute_n=self.pins.recompute_num_layers)
            if not np.isfinite(solution.best_time[L + 2]):
                return None
            picked = solution.choices(L + 2)
            flat = _one_stage_order(picked)
            plan = self.build_plan(s, (L,), tuple(ext.options[o] for o in flat))
            return plan if plan.prediction.peak_memory_bytes <= budget else None

        best: Plan | None = None
        for embedding in (base, base + 1):
            for head in (base + 2, base + 3):
                fits = plan_for(embedding, head, 0)
                if fits is None:
                    continue
                low, high = 0, L  # plan_for(low) fits; find the largest resident count that does
                while low < high:
                    middle = (low + high + 1) // 2
                    plan = plan_for(embedding, head, middle)
                    if plan is None:
                        high = middle - 1
                    else:
                        low, fits = middle, plan
                if best is None or fits.prediction.step_seconds < best.prediction.step_seconds:
                    best = fits
        return best

    def search(self, top_k: int = 1, progress: Progress | None = None, within: float = 0.0,
               near_miss: bool = True) -> list[Plan]:
        """The ``top_k`` fastest plans, best first, and every other plan predicted within ``within``
        (a fraction: 0.03 is 3%) of the fastest, one per strategy. Raises DsautoError when nothing
        fits, quoting how far the nearest plan is over the budget; ``near_miss`` False spares the
        searches under looser budgets that may take (:meth:`_near_miss`), for a caller that reads
        no sentence."""
        space = strategies(self.model, self.cluster, self.train, self.pins)
        if not space:
            raise explain_empty_space(self.model, self.cluster, self.train, self.pins)
        L = self.model.num_layers
        # A layer's costs do not depend on how its rank's layers are chunked: price each strategy
        # once for all its virtual-stage counts (but the expert all-to-alls' overlap, whose share of
        # paired passes does: steady_pair_fraction).
        by_base: dict[Strategy, _Priced] = {}

        def price(s: Strategy) -> _Priced:
            base = s if s.expert_a2a_overlap else dataclasses.replace(s, virtual_stages=1, chunk_layout=None)
            if base not in by_base:
                plain = by_base.get(dataclasses.replace(base, recompute_modules=()))
                by_base[base] = self._price_selective(base, plain) if base.recompute_modules and plain else \
                    self._price(base)
            return dataclasses.replace(by_base[base], strategy=s)

        # A partial distributed optimizer's variant is priced when the search reaches it: its bound is
        # at least its one-instance twin's (the same passes; more optimizer state per rank to update),
        # so most variants are bounded out unpriced.
        single = set(space)
        priced: list[_Priced | None] = [None if s.dist_opt_instances > 1 and
                                        dataclasses.replace(s, dist_opt_instances=1) in single else price(s)
                                        for s in space]
        space, priced = _without_dominated_exchanges(space, priced)
        twin_bound = {p.strategy: p.lower_bound(L) for p in priced if p is not None}
        bounds = [p.lower_bound(L) if p is not None else twin_bound[dataclasses.replace(s, dist_opt_instances=1)]
                  for s, p in zip(space, priced)]
        order = sorted(range(len(priced)), key=lambda i: (bounds[i], i))
        kept: list[tuple[float, int, Plan]] = []  # max-heap by step time via negation
        near: list[tuple[float, int, Plan]] = []  # beyond the top_k, within ``within`` of the best
        best = math.inf
        spilled: list[int] = []  # strategies with no plan that fits: offload may make one fit
        fitted: dict[Strategy, tuple[Plan, _Priced]] = {}  # each strategy's plan once solved, as priced

        def bounded_out(bound: float) -> bool:
            return len(kept) >= top_k and bound >= max(-kept[0][0], best * (1 + within))

        host_short: list[Plan] = []
        over: list[Plan] = []  # the DP's plans over the budget, for the sentence when nothing fits

        def consider(i: int, candidate: _Priced, bound: float) -> bool:
            """Solves one strategy and keeps its plan; False when no plan of it fits."""
            nonlocal best
            solved = self._solve(candidate)
            plan = None if solved is None else self._plan_of(solved)
            if plan is not None and plan.prediction.peak_memory_bytes > self.cluster.memory_budget_bytes:
                if bounded_out(bound):
                    return True  # whatever fits would be slower than the plans kept
                over.append(plan)
                # Over the budget at a moment the layer DP does not see (the optimizer update):
                # look for the per-layer choices that fit it too.
                plan = self._fit_update(candidate) or (self._fit_zero3(candidate) if candidate.zero3 is not None
                                                       else self._fit_tighter(candidate, plan, solved))
            elif plan is not None and solved is not None and not bounded_out(bound):
                plan = self._fit_looser(candidate, solved, plan)
            if plan is not None and not self._host_fits(plan):
                host_short.append(plan)  # fits the device, not the node's host memory
                return False
            if plan is None:
                return False
            fitted[candidate.strategy] = (plan, candidate)  # (see _needless_selective)
            item = (-plan.prediction.step_seconds, -i, plan)
            best = min(best, plan.prediction.step_seconds)
            if len(kept) < top_k:
                heapq.heappush(kept, item)
            elif item[0] > kept[0][0]:
                near.append(heapq.heapreplace(kept, item))
            else:
                near.append(item)
            return True

        for done, i in enumerate(order):
            if progress:
                progress(done, len(order))
            if bounded_out(bounds[i]):
                break  # every remaining strategy is bounded out
            if priced[i] is None:
                priced[i] = price(space[i])
                bounds[i] = priced[i].lower_bound(L)
                if bounded_out(bounds[i]):
                    continue
            if _needless_selective(priced[i].strategy, bounds[i], fitted):
                continue
            if not consider(i, priced[i], bounds[i]):
                spilled.append(i)
            if progress:
                progress(done + 1, len(order))
        offloaded: list[_Priced] = []  # every offloaded variant priced, for the bounds a no-fit error quotes
        for i, candidate, bound in self._offloaded(spilled, priced, bounds, bounded_out, offloaded):
            consider(i, candidate, bound)
        if not kept:
            raise DsautoError(self._does_not_fit([p for p in priced if p is not None] + offloaded, host_short,
                                                 over, near_miss))
        near = [e for e in near if -e[0] <= best * (1 + within)] if within > 0 else []
        return [plan for _, _, plan in sorted(kept + near, key=lambda e: (-e[0], -e[1]))]

    def with_budget(self, budget_bytes: int) -> Planner:
        """The same problem's planner under another per-device memory budget."""
        cluster = dataclasses.replace(self.cluster, memory_limit_bytes=int(budget_bytes))
        return Planner(self.model, cluster, self.train, self.pins, self.profile, self.calibration)

    def _near_miss(self) -> tuple[Plan, float] | None:
        """Where no plan fits and the layer DP built none over the budget either (it refuses a layer
        that leaves no room), the fastest plan within the first of :data:`NEAR_MISS_BUDGETS` times the
        budget that has one, and that factor; None beyond them."""
        for factor in NEAR_MISS_BUDGETS:
            try:
                return self.with_budget(self.cluster.memory_budget_bytes * factor).search(near_miss=False)[0], factor
            except DsautoError:
                continue
        return None

    def _does_not_fit(self, priced: Sequence[_Priced], host_short: Sequence[Plan] = (), over: Sequence[Plan] = (),
                      near_miss: bool = False) -> str:
        """The sentence for a search that found no plan within the budget. The layers' lower bound
        (:meth:`_Priced.least_memory`) is quoted only where it exceeds the budget: a bound at or below it
        says nothing of what a plan needs (the plans went over at a moment the bound leaves out, such as
        the optimizer update, or the host's memory held no offload). Raising --memory-limit is offered
        only where the user set it below the device's memory less its reserve, and unpinning only the
        choices the user pinned, by their options. Where plans fit the devices but not the node's host
        memory (``host_short``), that is what it says. Where no plan fits at some moment the bound
        leaves out, the plan nearest to fitting is quoted with its peak and stage: of the layer DP's
        plans over the budget (``over``), the one with the least peak, else (``near_miss``) the
        fastest under a slightly looser budget (:meth:`_near_miss`)."""
        fits_on = f"{self.model.name} does not fit on {self.cluster.world_size} x {self.cluster.device.name}"
        if host_short:
            need = min(self._node_host_bytes(plan) for plan in host_short)
            return (f"{fits_on}: its plans that fit the devices offload {format_bytes(need)} a node, more than the "
                    f"{format_bytes(self.cluster.hardware.host_memory_bytes)} of host memory the hardware gives; add "
                    f"nodes, or give a hardware file with more host_memory_bytes.")
        budget = self.cluster.memory_budget_bytes
        least = min((p.least_memory(self.model.num_layers, self.pins.recompute_num_layers) for p in priced),
                    default=math.inf)
        where = f"{fits_on} with {format_bytes(budget)} per device under any allowed setting"
        why = (f"the smallest plan needs at least {format_bytes(least)} per device" if budget < least < math.inf else
               "no plan priced stays within it at every moment of the step")
        if not budget < least < math.inf:
            nearest = min(over, key=lambda plan: plan.prediction.peak_memory_bytes, default=None)
            which = "the plan nearest to fitting"
            if nearest is None and near_miss and (found := self._near_miss()):
                nearest, factor = found
                which = f"the fastest plan within {factor - 1:.0%} more"
            if nearest is not None:
                stage = max(nearest.stages, key=lambda st: st.peak_bytes)
                peak = nearest.prediction.peak_memory_bytes
                why += (f" ({which}, {nearest.dims.describe()} ZeRO {nearest.zero_stage} micro-batch "
                        f"{nearest.micro_batch}, peaks at {format_bytes(peak)}"
                        f"{f' on pipeline stage {stage.stage}' if nearest.pp > 1 else ''}, "
                        f"{format_bytes(peak - budget)} over)")
        state = min((p.least_state(self.model.num_layers) for p in priced), default=math.inf)
        if budget < least < math.inf and 0 < state < math.inf:  # 0: all of it offloaded
            # Which remedy can work: a state over the budget needs more sharding or devices, one
            # within it leaves the activations and buffers to cut (checkpointing, micro-batch).
            why += (f", its model state alone at least {format_bytes(state)}" if state > budget else
                    f", of which its model state at least {format_bytes(state)}, the rest activations and buffers")
        limit = self.cluster.memory_limit_bytes  # 0: the device's memory less its reserve
        ceiling = self.cluster.device.memory_bytes - self.cluster.device.memory_reserve_bytes
        raise_limit = 0 < limit < ceiling and not least > ceiling  # a higher limit could then fit a plan
        # An option that sets a constant is pinned where the field holds it (a launch's sequence
        # parallelism on is the search's own default, not --no-sequence-parallel); who runs the plan
        # (--for hf, and the engine it implies) is no choice to unpin.
        pinned = [f.metadata["flag"] for f in dataclasses.fields(self.pins)
                  if "flag" in f.metadata and getattr(self.pins, f.name) != f.default
                  and f.name not in (("hf_trainer", "engine") if self.pins.hf_trainer else ())
                  and getattr(self.pins, f.name) == f.metadata.get("const", getattr(self.pins, f.name))]
        remedies = ["add devices", *(["raise --memory-limit"] if raise_limit else []),
                    *([f"unpin {', '.join(pinned)}"] if pinned else [])]
        remedy = remedies[0] if len(remedies) == 1 else f"{', '.join(remedies[:-1])} or {remedies[-1]}"
        return f"{where}: {why}; {remedy}."

    def _offloaded(self, spilled: list[int], priced: Sequence[_Priced], bounds: Sequence[float],
                   bounded_out: Callable[[float], bool],
                   tried: list[_Priced]) -> Iterator[tuple[int, _Priced, float]]:
        """The post-pass of the search: each strategy that fitted nowhere (``spilled``, filled while
        the main pass runs) once more with its optimizer offloaded, and under DeepSpeed ZeRO-3 with
        its parameters too, unless the user pinned ``offload``. Offloading only adds time (the host
        link and the CPU's update), so a strategy that fits without it is never offloaded, and the
        offloaded strategies, priced lazily, are bounded out like the others (their bound includes
        the CPU's update). Every variant priced is appended to ``tried``, those over the budget too."""
        by_base: dict[Strategy, _Priced] = {}  # priced once for all virtual-stage counts
        for i in sorted(spilled, key=lambda i: (bounds[i], i)):
            for strategy in offloaded_variants(priced[i].strategy, self.cluster, self.pins):
                if bounded_out(bounds[i]):
                    return  # offloading only adds to the bound
                unchunked = dataclasses.replace(strategy, virtual_stages=1, chunk_layout=None)
                if unchunked not in by_base:
                    by_base[unchunked] = self._price(unchunked)
                candidate = dataclasses.replace(by_base[unchunked], strategy=strategy)
                tried.append(candidate)
                bound = candidate.lower_bound(self.model.num_layers)
                if candidate.least_memory(self.model.num_layers, self.pins.recompute_num_layers) > \
                        self.cluster.memory_budget_bytes:
                    continue  # does not fit even so
                if not bounded_out(bound):
                    yield i, candidate, bound

    def _node_host_bytes(self, plan: Plan) -> float:
        """The state a node's ranks offload to its host memory under ``plan``."""
        return plan.prediction.offloaded_bytes * self.cluster.devices_per_node

    def _host_fits(self, plan: Plan) -> bool:
        """Whether the state a node's ranks offload fits in the node's host memory."""
        return plan.offload == "none" or self._node_host_bytes(plan) <= self.cluster.hardware.host_memory_bytes

    def build_plan(self, strategy: Strategy, stage_layers: Sequence[int],
                   options: Sequence[LayerOption], reduce_bucket: int | None = None,
                   prefetch_bucket: int | None = None) -> Plan:
        """The Plan of an explicit assignment, with its prediction (also used to price given configs);
        ``reduce_bucket`` and ``prefetch_bucket`` (bytes) replace the buffer sizes the search picks."""
        step = predict_step(self.model, self.cluster, self.train, strategy, stage_layers, options,
                            self.profile, self.calibration, reduce_bucket, prefetch_bucket)
        groups = layer_groups(self.model, self.train.seq_len, self.train.dtype_bytes, strategy.tp)
        stage_of = [0] * (self.model.num_layers + 2)
        for rank, held in enumerate(rank_layers(stage_layers, strategy.virtual_stages, strategy.chunk_layout)):
            for layer in held:
                stage_of[layer] = rank
        runs: list[LayerChoice] = []
        for j, option in enumerate(options):
            name = layer_group_of(groups, j, self.model.num_layers).name
            key = (name, stage_of[j], option.checkpoint, option.shard_params, option.split,
                   option.recompute_modules)
            if runs and (runs[-1].group, runs[-1].stage, runs[-1].checkpoint, runs[-1].shard_params,
                         runs[-1].split, runs[-1].recompute_modules) == key:
                runs[-1] = LayerChoice(runs[-1].first, j, *key)
            else:
                runs.append(LayerChoice(j, j, *key))
        bucket = bucket_bytes(groups, strategy.tp, self.train.dtype_bytes)
        return Plan(
            model=self.model, hardware=self.cluster.hardware.name, nodes=self.cluster.nodes,
            gpus_per_node=self.cluster.devices_per_node,
            memory_budget_bytes=self.cluster.memory_budget_bytes, **dataclasses.asdict(strategy.dims),
            zero_stage=strategy.zero_stage,
            sequence_parallel=strategy.sequence_parallel, micro_batch=strategy.micro_batch,
            grad_accum=strategy.grad_accum, global_batch=self.train.global_batch,
            seq_len=self.train.seq_len, dtype=self.train.dtype,
            flash_attention=self.train.flash_attention,
            padded_vocab_size=self.model.padded_vocab_size(strategy.tp),
            stage_layers=tuple(stage_layers),
            reduce_bucket_bytes=bucket if reduce_bucket is None else reduce_bucket,
            prefetch_bucket_bytes=(prefetch_bytes(groups, strategy.tp, self.train.dtype_bytes, options,
                                                  self.model.num_layers, strategy.experts_gathered_whole)
                                   if prefetch_bucket is None else prefetch_bucket),
            layers=tuple(runs), stages=step.stages, prediction=step.prediction, engine=strategy.engine,
            virtual_stages=strategy.virtual_stages, chunk_layout=strategy.chunk_layout, offload=strategy.offload,
            hpz=strategy.hpz,
            dist_opt_instances=strategy.dist_opt_instances, attention_kernel=strategy.attention_kernel,
            tp_comm_overlap=strategy.tp_comm_overlap, expert_dispatcher=strategy.expert_dispatcher, fp8=strategy.fp8,
            fp8_recipe=strategy.fp8_recipe, fp8_param_gather=strategy.fp8_param_gather,
            cp_comm_type=strategy.cp_comm_type, expert_a2a_overlap=strategy.expert_a2a_overlap,
            expert_load_balanced=strategy.expert_load_balanced,
            expert_capacity_factor=strategy.expert_capacity_factor,
            expert_pad_to_capacity=strategy.expert_pad_to_capacity,
            experts_gathered_whole=strategy.experts_gathered_whole,
            overlap_grad_reduce=strategy.overlap_grad_reduce,
            overlap_param_gather=strategy.overlap_param_gather,
            precision_aware_optimizer=strategy.precision_aware_optimizer,
            attention_softmax_in_fp32=strategy.attention_softmax_in_fp32 or not (
                strategy.engine == "megatron" and self.train.dtype != "fp32" and not self.train.flash_attention),
            # bf16 gradients as they take effect (the cost model prices them so too): Megatron-core under bf16.
            grad_reduce_in_fp32=strategy.grad_reduce_in_fp32 or not (
                strategy.engine == "megatron" and self.train.dtype == "bf16"),
        )
