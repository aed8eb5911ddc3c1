"""How large a search may grow: checked before any strategy is built, so that every input answers
in seconds, with a sentence saying what to change when it would not.

Two things grow without bound with the input. The global strategies number one per layout, ZeRO
stage, engine, schedule and divisor of the per-replica batch (a highly composite batch on a large
cluster has thousands of divisors), and each is priced: the pairs of a layout and a micro-batch are
counted before anything is built (:func:`check_search_size`), the strategies once built
(:func:`check_strategies`). A predicted pipeline step simulates 1F1B operation by operation
(:mod:`dsauto.cost.pipeline`), stages x micro-batches of them, and the micro-batches of a replica
reach its whole share of the global batch.
"""

from __future__ import annotations

from typing import Any

from dsauto.cost.strategy import Strategy
from dsauto.errors import DsautoError
from dsauto.parallel import divisors, layouts
from dsauto.spec.cluster import ClusterSpec
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import TrainSpec

MAX_CHOICES = 5_000
"""Pairs of a layout and a micro-batch size one search may weigh (each becomes a strategy per ZeRO
stage, engine and schedule): counted before anything is built."""
MAX_STRATEGIES = 20_000
"""Global strategies one search may price (pricing one takes about 0.2 ms, solving one more)."""
MAX_PIPELINE_OPERATIONS = 2**19
"""Stages x micro-batches of one simulated 1F1B step (about 0.2 s of simulation; a search simulates
the steps of tens of plans)."""

def _what_to_pin(model: ModelSpec) -> str:
    """What a user pins to make the search smaller; a mixture of experts multiplies the strategies by
    its expert degrees, which --ep fixes."""
    pins = "--tp, --pp, --ep or --micro-batch" if model.moe else "--tp, --pp or --micro-batch"
    return f"pin {pins}, or use a global batch with fewer divisors"


def _where(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> str:
    return f"{model.name} on {cluster.world_size} devices with a global batch of {train.global_batch}"


def choices(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, pins: Any) -> int:
    """Pairs of a layout (degrees) and a micro-batch size that pass the basic rules of
    :func:`dsauto.search.space.strategies` (tp divides the heads, pp at most the layers, dp divides
    the batch, the pins), counted without building them: a lower bound on its strategies."""
    count = 0
    for dims in layouts(cluster.world_size, cluster.devices_per_node):
        tp, pp, dp = dims.tp, dims.pp, dims.dp
        if (pins.tp is not None and tp != pins.tp) or (pins.pp is not None and pp != pins.pp):
            continue
        if model.tp_problem(tp) or pp > model.num_layers or train.global_batch % dp:
            continue
        per_replica = train.global_batch // dp
        if pins.micro_batch is not None:
            count += per_replica % pins.micro_batch == 0
        else:
            count += len(divisors(per_replica))
    return count


def check_search_size(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, pins: Any) -> None:
    """Raises DsautoError, with the numbers and what to pin, when the search would weigh more layout
    and micro-batch pairs than it can in seconds (checked before any strategy is built)."""
    count = choices(model, cluster, train, pins)
    if count > MAX_CHOICES:
        raise DsautoError(f"The search for {_where(model, cluster, train)} would weigh {count} pairs of degrees "
                          f"and micro-batch size, more than the {MAX_CHOICES} it can in seconds; {_what_to_pin(model)}.")


def check_strategies(built: list[Strategy], model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> list[Strategy]:
    """``built``, or a DsautoError when pricing them all, or simulating the pipeline of one of them,
    would take more than seconds."""
    where = _where(model, cluster, train)
    if len(built) > MAX_STRATEGIES:
        raise DsautoError(f"The search for {where} would price {len(built)} strategies, more than the "
                          f"{MAX_STRATEGIES} it can in seconds; {_what_to_pin(model)}.")
    operations = max((s.pp * s.grad_accum * getattr(s, "virtual_stages", 1) for s in built if s.pp > 1), default=0)
    if operations > MAX_PIPELINE_OPERATIONS:
        raise DsautoError(f"The search for {where} would simulate pipelines of up to {operations} stage "
                          f"micro-batches (more than {MAX_PIPELINE_OPERATIONS}); lower --global-batch, pin "
                          f"--pp 1, or pin a larger --micro-batch.")
    return built
