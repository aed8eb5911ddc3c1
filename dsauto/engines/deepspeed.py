"""DeepSpeed's spellings of what a plan also says: read by ``dsauto validate`` and by the DeepSpeed
hook, so that a ``ds_config.json`` whose DeepSpeed keys were edited away from its own ``"dsauto"``
block is refused before it trains (DeepSpeed would follow its keys, the hook the block).

Keys a Hugging Face Trainer fills in (``"auto"``) agree with anything: the Trainer sets them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from dsauto.engines.rules import hf_trainer_refusal
from dsauto.errors import DsautoWarning
from dsauto.plan import Plan
from dsauto.spec.training import DTYPE_BYTES
from dsauto.units import format_bytes, format_seconds

AUTO = "auto"
"""Hugging Face's placeholder for a value its TrainingArguments fill in."""
BATCH_KEYS = (("train_batch_size", "global_batch"), ("train_micro_batch_size_per_gpu", "micro_batch"),
              ("gradient_accumulation_steps", "grad_accum"))
"""DeepSpeed's batch keys and the plan's fields they spell (deepspeed/runtime/config.py)."""
MOE_KEY = "dsauto_moe"
"""Top-level key of ``ds_config.json`` with the DeepSpeed-MoE settings of a mixture-of-experts plan
(``deepspeed.moe.layer.MoE`` arguments: ``ep_size`` and the rest per MoE layer). DeepSpeed has no
config key for them: they are arguments of the model's MoE layers, which the hook checks."""
SUB_GROUP_SIZE = 10**9
"""``zero_optimization.sub_group_size`` of a ZeRO-3 plan (elements): DeepSpeed's default
(deepspeed/runtime/zero/config.py), written out because the cost model prices the update's
temporaries per sub-group of it (dsauto.cost.step.optimizer_step_bytes)."""
MOE_CAPACITY_FACTOR = 1.0
"""Capacity factor of DeepSpeed-MoE's gate that plans assume: DeepSpeed's default
(``deepspeed.moe.layer.MoE(capacity_factor=1.0)``, tokens beyond it dropped). Each expert gets
``ceil(k x tokens / experts x capacity_factor)`` slots (``_capacity`` in deepspeed/moe/sharded_moe.py),
every slot computed, so every expert-parallel rank runs this factor times the balanced expert work."""


def _whole(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _enabled(config: Mapping[str, Any], key: str) -> bool | str:
    section = config.get(key)
    if not isinstance(section, Mapping):
        return False
    value = section.get("enabled", False)
    return AUTO if value == AUTO else bool(value)


def config_dtype(config: Mapping[str, Any]) -> str | None:
    """The dtype DeepSpeed trains ``config`` in (``bf16``, ``fp16`` or ``fp32``); None when a
    Trainer decides (``"enabled": "auto"``)."""
    bf16 = (_enabled(config, "bf16"), _enabled(config, "bfloat16"))  # DeepSpeed reads either spelling
    fp16 = _enabled(config, "fp16")
    if AUTO in bf16 or fp16 == AUTO:
        return None
    if any(bf16) and fp16:
        return "both bf16 and fp16"
    return "bf16" if any(bf16) else "fp16" if fp16 else "fp32"


def config_contradictions(config: Mapping[str, Any], plan: Plan, batch: bool = True) -> list[str]:
    """Where the DeepSpeed keys of ``config`` say something other than ``plan``, one phrase each
    (``"zero_optimization.stage is 2 but the plan was made for ZeRO stage 3"``); empty when they agree.
    Without ``batch`` the batch keys are not compared (a Trainer may set them; the hook warns)."""
    found = []
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else zero
    if stage != AUTO and _whole(stage) != plan.zero_stage:
        found.append(f"zero_optimization.stage is {stage!r} but the plan was made for ZeRO stage {plan.zero_stage}")
    found += _offload_contradictions(zero if isinstance(zero, Mapping) else {}, plan)
    dtype = config_dtype(config)
    if dtype is not None and dtype != plan.dtype:
        found.append(f"the config trains in {dtype} (its bf16 / fp16 sections) but the plan in {plan.dtype}")
    for key, field in BATCH_KEYS if batch else ():
        value = config.get(key)
        if value is not None and value != AUTO and _whole(value) != getattr(plan, field):
            found.append(f"{key} is {value!r} but the plan's {field} is {getattr(plan, field)}")
    sequence_parallel = config.get("sequence_parallel_size", 1)
    ulysses = plan.cp if plan.engine == "deepspeed" else 1  # a Megatron-core plan's cp is its own
    if sequence_parallel != AUTO and _whole(sequence_parallel) != ulysses:
        found.append(f"sequence_parallel_size is {sequence_parallel!r} but the plan's DeepSpeed-Ulysses "
                     f"degree (cp) is {ulysses}")
    tensor_parallel = config.get("tensor_parallel")
    if isinstance(tensor_parallel, Mapping) and "autotp_size" in tensor_parallel:
        size = tensor_parallel["autotp_size"]
        if size != AUTO and _whole(size) != plan.tp:
            found.append(f"tensor_parallel.autotp_size is {size!r} but the plan's tp is {plan.tp}")
    return found


QUANTIZED_KEYS = (
    ("zero_quantized_weights", "quantizes ZeRO-3's parameter all-gathers to int8 (ZeRO++'s qwZ)"),
    ("zero_quantized_nontrainable_weights", "keeps the frozen ZeRO-3 parameters quantized"),
    ("zero_quantized_gradients", "quantizes the gradient reduction (ZeRO++'s qgZ)"),
)
"""ZeRO++'s quantized communication (deepspeed/runtime/zero/config.py), which dsauto does not price."""


def unpriced_config_settings(config: Mapping[str, Any], plan: Plan) -> list[str]:
    """Settings of ``config`` under which DeepSpeed communicates otherwise than ``plan`` is priced, one
    phrase each (empty when none); they do not contradict the plan's choices, so the hook warns
    rather than refuses. The plan prices ZeRO's gradient reductions overlapped with backward in the
    training dtype (ZeRO 1-2: each bucket all-reduced whole, ZeRO-3: reduce-scattered), its parameter
    gathers unquantized: DeepSpeed turns ``overlap_comm`` off below ZeRO-3 when the key is missing
    (ZeroConfig.overlap_comm_valid), ``use_multi_rank_bucket_allreduce: false`` reduces each
    partition's slice to its owner instead, one reduce a rank, and ``communication_data_type`` fp32
    doubles the bytes of a 16-bit plan's reductions."""
    zero = config.get("zero_optimization", {})
    zero = zero if isinstance(zero, Mapping) else {}
    found = []
    if plan.zero_stage >= 1:
        overlap = zero.get("overlap_comm")
        if overlap is False or (overlap is None and plan.zero_stage < 3):
            found.append("zero_optimization.overlap_comm is " + ("false" if overlap is False else
                         f"missing, which DeepSpeed reads as false under ZeRO stage {plan.zero_stage}")
                         + ", so the gradient reductions wait for backward where the plan overlaps them")
    for key, what in QUANTIZED_KEYS:
        if zero.get(key) is True:
            found.append(f"zero_optimization.{key} {what}, moving fewer bytes than the plan prices")
    if zero.get("use_multi_rank_bucket_allreduce") is False and zero.get("reduce_scatter") is not False \
            and plan.zero_stage in (1, 2):
        found.append("zero_optimization.use_multi_rank_bucket_allreduce is false, so each partition's gradients are "
                     "reduced to its owner, one reduce a rank, where the plan all-reduces each bucket whole")
    if str(config.get("communication_data_type", "")).lower() in ("fp32", "float32") and plan.dtype != "fp32":
        found.append(f"communication_data_type is fp32, so the gradients are reduced in 4 bytes an element "
                     f"where the plan's {plan.dtype} reduces them in 2")
    found += _bucket_differences(zero, plan)
    return found


def hf_trainer_plan_refusal(plan: Plan) -> str | None:
    """What ``plan`` does that a ``transformers`` model under Hugging Face's Trainer or accelerate
    cannot run (the setting and :func:`dsauto.engines.rules.hf_trainer_refusal`'s reason), or None:
    the plans of ``--for hf`` never do it, a plan made for ``deepspeed.initialize`` may."""
    recomputed = sorted({m for run in plan.layers for m in run.recompute_modules})
    split = max(run.split for run in plan.layers)
    for setting, why in ((f"engine {plan.engine}", hf_trainer_refusal(engine=plan.engine)),
                         (f"pp {plan.pp}", hf_trainer_refusal(pp=plan.pp)),
                         (f"cp {plan.cp}", hf_trainer_refusal(cp=plan.cp)),
                         (f"ep {plan.ep}", hf_trainer_refusal(ep=plan.ep)),
                         (f"recomputation of {'+'.join(recomputed)}", hf_trainer_refusal(recompute_modules=recomputed)),
                         (f"operators split in up to {split} slices", hf_trainer_refusal(split=split))):
        if why:
            return f"its {setting}: {why}"
    return None


def stage3_max_live_parameters(plan: Plan) -> int:
    """``zero_optimization.stage3_max_live_parameters`` of a ZeRO-3 plan (elements): twice its prefetch
    bucket, which bounds the gathered parameters as priced (dsauto.cost.zero3.gathered_params_bytes),
    and at least 1, DeepSpeed's smallest bound (a plan whose layers all stay resident prefetches
    nothing)."""
    return max(1, 2 * plan.prefetch_bucket_bytes // DTYPE_BYTES[plan.dtype])


ALLGATHER_ALIGNMENT = 2
"""DeepSpeed's ``nccl_start_alignment_factor``: ZeRO 1-2's ``allgather_bucket_size`` must be a multiple
of it (deepspeed/runtime/zero/stage_1_and_2.py asserts it)."""


def allgather_bucket_elements(plan: Plan) -> int:
    """ZeRO 1-2's ``allgather_bucket_size`` for ``plan``: its reduction bucket in elements, rounded up to
    :data:`ALLGATHER_ALIGNMENT`."""
    elements = max(1, plan.reduce_bucket_bytes // DTYPE_BYTES[plan.dtype])
    return elements + elements % ALLGATHER_ALIGNMENT


def _bucket_differences(zero: Mapping[str, Any], plan: Plan) -> list[str]:
    """Where ``zero_optimization``'s bucket sizes (elements of the training dtype) are not the plan's
    (``reduce_bucket_bytes``, ``prefetch_bucket_bytes``), whose memory and time the prediction prices
    (dsauto.cost.step: the gradient buckets, and ZeRO-3's gathered parameters, which
    stage3_max_live_parameters bounds at twice the prefetch bucket)."""
    element = DTYPE_BYTES[plan.dtype]
    planned = {"reduce_bucket_size": plan.reduce_bucket_bytes // element}
    if plan.zero_stage in (1, 2):
        planned["allgather_bucket_size"] = allgather_bucket_elements(plan)
    if plan.zero_stage == 3:
        planned.update(stage3_prefetch_bucket_size=plan.prefetch_bucket_bytes // element,
                       stage3_max_live_parameters=stage3_max_live_parameters(plan))
    found = []
    for key, elements in planned.items():
        value = zero.get(key)
        if plan.zero_stage >= 1 and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and abs(value - elements) >= 1:
            found.append(f"zero_optimization.{key} is {value:g}, where the plan is priced with "
                         f"{elements} ({format_bytes(elements * element)})")
    return found


def warn_unpriced_settings(config: Mapping[str, Any], plan: Plan, subject: str) -> None:
    """Warns, in one line beginning with ``subject``, of the settings of ``config`` that ``plan``'s
    prediction does not price (:func:`unpriced_config_settings`); nothing when there are none."""
    unpriced = unpriced_config_settings(config, plan)
    if unpriced:
        warnings.warn(f"{subject} {'; '.join(unpriced)}: the step will differ from the plan's "
                      f"{format_seconds(plan.prediction.step_seconds)}; restore the values dsauto wrote to train "
                      f"as predicted.", DsautoWarning, stacklevel=3)


def _offload_contradictions(zero: Mapping[str, Any], plan: Plan) -> list[str]:
    """Where ``zero_optimization``'s offload sections and hpZ size say something else than the plan
    (a missing section or ``"device": "none"`` is no offload: deepspeed/runtime/zero/offload_config.py)."""
    found = []
    planned_sections = (("offload_optimizer", plan.offload != "none"),
                        ("offload_param", plan.offload == "optimizer+params"))
    for key, planned in planned_sections:
        section = zero.get(key)
        device = section.get("device", "none") if isinstance(section, Mapping) else "none"
        if device == AUTO:
            continue
        if (device not in ("none", None)) != planned:
            found.append(f"zero_optimization.{key} is {'on' if not planned else 'off'} but the plan's offload is "
                         f"{plan.offload!r}")
    hpz = zero.get("zero_hpz_partition_size", 1)
    if hpz != AUTO and _whole(hpz) != plan.hpz and not (plan.hpz == 1 and _whole(hpz) in (0, 1)):
        found.append(f"zero_optimization.zero_hpz_partition_size is {hpz!r} but the plan's hpz is {plan.hpz}")
    return found
