"""The DeepSpeed config of a plan (``ds_config.json``), and its validation by DeepSpeed's own parser.

Engine spellings live here. The config carries what DeepSpeed's keys can say (batch, precision, ZeRO
stage and buckets, optimizer); the per-layer choices (which ZeRO-3 groups stay resident, which layers
are checkpointed or split) and the pipeline layout ride along in the top-level ``"dsauto"`` block,
which DeepSpeed ignores (``DeepSpeedConfig`` reads only the keys it knows at the top level) and the
dsauto hook reads back.

Hugging Face's Trainer and accelerate read the same file (``TrainingArguments(deepspeed=...)``) but
own some of its values: written ``for hf``, the config says ``"auto"`` where TrainingArguments
decides (batch keys, gradient clipping, the optimizer's hyperparameters; no scheduler section, so
the Trainer's ``lr_scheduler_type`` applies) and keeps the plan's values where the plan decides
(ZeRO stage, buckets, prefetch and persistence, dtype). HF fills the ``"auto"`` values from
TrainingArguments and refuses a config whose other values contradict them (a bf16 plan needs
``bf16=True``).
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any, Literal
from unittest import mock

from dsauto.engines.deepspeed import (
    MOE_CAPACITY_FACTOR,
    MOE_KEY,
    SUB_GROUP_SIZE,
    allgather_bucket_elements,
    hf_trainer_plan_refusal,
    stage3_max_live_parameters,
)
from dsauto.errors import DsautoError, DsautoWarning
from dsauto.plan import Plan
from dsauto.plan_io import PLAN_ID_KEY, PLAN_KEY, plan_id
from dsauto.spec.training import DTYPE_BYTES

# Optimizer hyperparameters are the user's, not the planner's: these are the usual GPT pre-training
# values (Brown et al. 2020, Table 2.1 / Appendix B: betas 0.9 and 0.95, eps 1e-8, weight decay 0.1)
# and are meant to be edited. "torch_adam" makes DeepSpeed build torch.optim.AdamW instead of its
# fused CPU/GPU Adam, whose C++/CUDA extension otherwise compiles for minutes on first use
# (deepspeed/runtime/engine.py, get_optimizer_configuration), and "fused" (passed on to it) runs
# torch's one-kernel update (torch >= 2.4, CPU and CUDA) instead of its default multi-tensor one:
# measured 2.1-2.8x faster on an H100 (13.6-17.6 against 34.3-41.6 ps per parameter, three runs;
# benchmarks/results/device_layers_h100-80gb.md) and 7x on a CPU, with no partition-sized temporaries.
OPTIMIZER_PARAMS: dict[str, Any] = {
    "lr": 3e-4,
    "betas": [0.9, 0.95],
    "eps": 1e-8,
    "weight_decay": 0.1,
    "torch_adam": True,
    "fused": True,
}

GRADIENT_CLIPPING = 1.0
STEPS_PER_PRINT = 10

# ZeRO-3 knobs the plan does not choose. Parameters smaller than the persistence threshold stay
# resident whatever the plan says (DeepSpeed's default, 1e5 elements: norms and biases, whose
# per-use all-gathers would cost latency for no memory); which whole layer groups stay resident is
# the plan's per-run ``shard_params`` and the hook applies it by setting ``ds_persist``.
# The plan prices a sharded layer as gathered for its forward and again for its backward, with one
# matrix in use and the next one prefetched. DeepSpeed's default reuse distance (1e9 elements) would
# instead keep every parameter that is used again within 1e9 elements gathered from its forward to
# its backward, which for any model under a billion parameters per rank is all of them (measured:
# +16 MiB, the whole model, on a 4M-parameter GPT); a reuse distance of 0 releases each module's
# parameters after use, as priced (PartitionedParameterCoordinator.release_sub_module).
STAGE3_PARAM_PERSISTENCE_THRESHOLD = 100_000
STAGE3_MAX_REUSE_DISTANCE = 0


Target = Literal["deepspeed", "hf"]

AUTO = "auto"
"""Hugging Face's placeholder for a value TrainingArguments fills in."""
HF_AUTO_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping")
"""Top-level keys TrainingArguments owns (per_device_train_batch_size, gradient_accumulation_steps,
the world size, max_grad_norm); HF computes train_batch_size from the other two and the world size."""
HF_AUTO_OPTIMIZER = ("lr", "betas", "eps", "weight_decay")
"""Optimizer hyperparameters TrainingArguments owns (learning_rate, adam_beta1/2, adam_epsilon,
weight_decay)."""


def dtype_bytes(plan: Plan) -> int:
    """Bytes per element of the plan's training dtype."""
    if plan.dtype not in DTYPE_BYTES:
        raise DsautoError(
            f"The plan's dtype {plan.dtype!r} is not one of {', '.join(DTYPE_BYTES)}; re-plan with a "
            f"supported dtype."
        )
    return DTYPE_BYTES[plan.dtype]


def ds_config(plan: Plan, target: Target = "deepspeed") -> dict[str, Any]:
    """The DeepSpeed config of ``plan``, with the whole plan under the ``"dsauto"`` key; for
    ``target="hf"`` in Hugging Face's convention (see the module doc)."""
    if target not in ("deepspeed", "hf"):
        raise DsautoError(f"The config target {target!r} is not deepspeed or hf; write it for one of those.")
    if target == "hf" and (why := hf_trainer_plan_refusal(plan)):
        raise DsautoError(f"Hugging Face's Trainer and accelerate cannot run this plan, {why}; re-plan with --for "
                          f"hf (hf_trainer=True).")
    config = _deepspeed_config(plan)
    return hf_convention(config) if target == "hf" else config


def hf_convention(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a :func:`ds_config`) with ``"auto"`` where Hugging Face's TrainingArguments own
    the value; the plan's values stay where the plan decides."""
    config = copy.deepcopy(config)
    # A transformers model's experts are its own modules, which take no DeepSpeed-MoE arguments
    # (ep is 1 under the Trainer: hf_trainer_plan_refusal): nothing would read the block.
    config.pop(MOE_KEY, None)
    for key in HF_AUTO_KEYS:
        config[key] = AUTO
    params = config.get("optimizer", {}).get("params", {})
    for key in HF_AUTO_OPTIMIZER:
        params[key] = AUTO
    # The plan's dtype stays; both switches are written so that HF checks them against
    # TrainingArguments' bf16 / fp16 instead of keeping an fp32 plan's silence.
    config.setdefault("bf16", {"enabled": False})
    config.setdefault("fp16", {"enabled": False})
    zero = config.get("zero_optimization", {})
    if zero.get("stage") == 3:
        # Trainer.save_model then writes whole weights (gathered once, at saving) rather than only
        # DeepSpeed's sharded checkpoint; training steps are unaffected.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return config


def resolve_auto(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with Hugging Face's ``"auto"`` values replaced by the plan's (batch) and dsauto's
    defaults (clipping, optimizer), as DeepSpeed would get them from TrainingArguments that follow
    the plan; a config without ``"auto"`` is returned as is."""
    plan = config.get(PLAN_KEY) if isinstance(config.get(PLAN_KEY), dict) else {}
    values = {"train_batch_size": plan.get("global_batch"), "train_micro_batch_size_per_gpu": plan.get("micro_batch"),
              "gradient_accumulation_steps": plan.get("grad_accum"), "gradient_clipping": GRADIENT_CLIPPING}
    resolved = copy.deepcopy(config)
    for key, value in values.items():
        if resolved.get(key) == AUTO:
            if value is None:
                resolved.pop(key)  # no plan to say: DeepSpeed's own default
            else:
                resolved[key] = value
    params = resolved.get("optimizer", {}).get("params", {}) if isinstance(resolved.get("optimizer"), dict) else {}
    for key in HF_AUTO_OPTIMIZER:
        if params.get(key) == AUTO:
            params[key] = OPTIMIZER_PARAMS[key]
    return resolved


def _deepspeed_config(plan: Plan) -> dict[str, Any]:
    config: dict[str, Any] = {
        # DeepSpeed checks train_batch_size == micro x accumulation x data-parallel world size
        # (deepspeed/runtime/config.py, _batch_assertion); under pipeline or tensor parallelism its
        # world size is the data-parallel size from the mpu, so dp is the right factor.
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "steps_per_print": STEPS_PER_PRINT,
        "gradient_clipping": GRADIENT_CLIPPING,
        "wall_clock_breakdown": False,
    }
    element_bytes = dtype_bytes(plan)
    if plan.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif plan.dtype == "fp16":
        # loss_scale 0 selects dynamic loss scaling (DeepSpeedFP16Config).
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    config["optimizer"] = {"type": "AdamW", "params": dict(OPTIMIZER_PARAMS)}
    if plan.offload != "none":
        # An offloaded optimizer runs on the host: DeepSpeedCPUAdam (vectorised, what the plan prices;
        # deepspeed/runtime/engine.py, get_optimizer_configuration), not torch's AdamW.
        config["optimizer"]["params"]["torch_adam"] = False
        del config["optimizer"]["params"]["fused"]  # a torch AdamW argument, not DeepSpeedCPUAdam's
    config["zero_optimization"] = _zero_section(plan, element_bytes)
    if plan.cp > 1 and plan.engine == "deepspeed":
        # DeepSpeed-Ulysses: ZeRO partitions and reduces over the sequence-data-parallel ranks
        # (dp x cp), and the batch keys count the dp replicas only (deepspeed/runtime/config.py
        # divides the world by sequence_parallel_size). The hook builds the sequence-parallel
        # groups and the model's DistributedAttention (dsauto.runtime.deepspeed).
        config["sequence_parallel_size"] = plan.cp
    if plan.pp > 1:
        # Of the "pipeline" keys DeepSpeed parses (get_pipeline_config), only the uniform
        # activation_checkpoint_interval and the partitioning of activations/gradients across TP
        # ranks reach the PipelineEngine; "stages" and "partition" are parsed but unused (the
        # PipelineModule takes them as arguments). The interval stays 0: the hook checkpoints the
        # layers the plan chose, and the stage partition comes from the dsauto block.
        config["pipeline"] = {"activation_checkpoint_interval": 0}
    config[PLAN_KEY] = plan.to_dict()
    config[PLAN_ID_KEY] = plan_id(plan)  # ties the file to the other artifacts of its set
    if plan.model.moe:
        config[MOE_KEY] = deepspeed_moe_settings(plan)
    return config


def deepspeed_moe_settings(plan: Plan) -> dict[str, Any]:
    """The arguments of ``deepspeed.moe.layer.MoE`` for each MoE layer of the plan's model (flat
    layer numbers, 1..L as in the plan): DeepSpeed has no config key for expert parallelism, so the
    model's MoE layers must be built with them; the hook checks ``ep_size`` and ``num_experts``
    (:mod:`dsauto.runtime.deepspeed`). Beside the ``"dsauto"`` block, which is exactly the plan."""
    model = plan.model
    return {"layers": [{"layer": i + 1, "ep_size": plan.ep, "num_experts": model.num_experts,
                        "k": model.moe_top_k, "capacity_factor": MOE_CAPACITY_FACTOR}
                       for i in model.moe_layers()]}


def _zero_section(plan: Plan, element_bytes: int) -> dict[str, Any]:
    # DeepSpeed's bucket sizes count elements, not bytes (deepspeed/runtime/zero/config.py); ZeRO
    # reduces gradients and gathers parameters in the training dtype unless told otherwise
    # (communication_data_type and grad_accum_dtype default to the model dtype).
    reduce_bucket = max(1, plan.reduce_bucket_bytes // element_bytes)
    section: dict[str, Any] = {"stage": plan.zero_stage}
    if plan.zero_stage == 0:
        # Without ZeRO the engine all-reduces in fixed-size buckets (MEMORY_OPT_ALLREDUCE_SIZE); the
        # bucket keys below would be parsed and ignored.
        return section
    section.update({
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": reduce_bucket,
    })
    if plan.zero_stage < 3:
        # Stages 1 and 2 all-gather the updated parameter partitions after the step in buckets.
        section["allgather_bucket_size"] = allgather_bucket_elements(plan)
        # Each gradient bucket all-reduced whole, as priced (DeepSpeed's default from 0.16; 0.15
        # reduced each partition's slice to its owner instead): stage_1_and_2.py average_tensor.
        section["use_multi_rank_bucket_allreduce"] = True
    else:
        section.update({
            "stage3_prefetch_bucket_size": max(0, plan.prefetch_bucket_bytes // element_bytes),
            "stage3_param_persistence_threshold": STAGE3_PARAM_PERSISTENCE_THRESHOLD,
            # Prefetching piles gathered parameters up to this bound (every module fetch, even of a
            # module without parameters, prefetches another bucket: PartitionedParameterCoordinator.
            # fetch_sub_module), so it is what bounds the gathered parameters, as priced
            # (dsauto.cost.zero3.gathered_params_bytes; measured in benchmarks/results/accuracy.md).
            "stage3_max_live_parameters": stage3_max_live_parameters(plan),
            "stage3_max_reuse_distance": STAGE3_MAX_REUSE_DISTANCE,
            "sub_group_size": SUB_GROUP_SIZE,  # the update's sub-groups, as priced
        })
        if plan.hpz > 1:
            section["zero_hpz_partition_size"] = plan.hpz  # ZeRO++ hierarchical partitioning
    section.update(offload_sections(plan))
    return section


def offload_sections(plan: Plan) -> dict[str, Any]:
    """The ``zero_optimization`` keys of the plan's offload (deepspeed/runtime/zero/offload_config.py):
    the optimizer state to pinned host memory (ZeRO 1-3), and under ZeRO-3 the parameters too."""
    sections: dict[str, Any] = {}
    if plan.offload != "none":
        sections["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if plan.offload == "optimizer+params":
        sections["offload_param"] = {"device": "cpu", "pin_memory": True}
    return sections


def ds_config_text(plan: Plan, target: Target = "deepspeed") -> str:
    """``ds_config.json``'s text: the config as indented JSON, ending in a newline."""
    return json.dumps(ds_config(plan, target), indent=2) + "\n"


def write_ds_config(plan: Plan, path: Path | str, target: Target = "deepspeed") -> Path:
    """Writes ``plan``'s DeepSpeed config to ``path`` (not validated; see :func:`validate_ds_config`)."""
    path = Path(path)
    path.write_text(ds_config_text(plan, target))
    return path


class _DataParallelView:
    """Answers DeepSpeedConfig's two questions about the process group as rank 0 of ``dp`` ranks.

    ``DeepSpeedConfig.__init__`` asks ``deepspeed.comm.get_rank()`` first and falls back to a world
    size of 1 when that raises (it does whenever no process group exists), and only then asks the
    ``mpu`` for the data-parallel world size. Standing in for both lets DeepSpeed's own batch check
    run against ``dp`` without creating a process group.
    """

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_rank(self, group: Any = None) -> int:
        return 0

    def get_world_size(self, group: Any = None) -> int:
        return self.dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


READ_WITHOUT_MPU = {"sequence_parallel_size"}
"""Top-level keys DeepSpeed's parser reads only where no ``mpu`` is given (deepspeed/runtime/config.py,
``DeepSpeedConfig.__init__``: Hugging Face's ``zero.Init``, whose data-parallel world is the world
over ``sequence_parallel_size``); the check runs with one, so they are not reported unread."""


class _ReadKeys(dict):
    """A config that notes the top-level keys DeepSpeed's parser reads (``get``, ``[]``, ``in``), so
    that a misspelt key, which it would leave unused without a word, can be named."""

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__(data)
        self.read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def _check_optimizer_and_scheduler(config: dict[str, Any], cpu_optimizer: bool) -> None:
    """Refuses what DeepSpeed's parser passes and ``deepspeed.initialize`` then fails on: an optimizer
    or scheduler type it has no class for, and a parameter that class does not take (a misspelt
    ``weight_decay`` is a TypeError at the first line of training). The class is the one
    ``DeepSpeedEngine._configure_basic_optimizer`` and ``_scheduler_from_config`` build
    (deepspeed/runtime/engine.py): for Adam and AdamW torch's with ``torch_adam``, DeepSpeedCPUAdam
    with the optimizer offloaded to the CPU (``cpu_optimizer``), else FusedAdam, each after DeepSpeed
    takes out its own keys; another name of DeepSpeed's list or of torch.optim, its class. Where the
    class is not importable here (an optional package), nothing is checked."""
    import inspect

    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    for key in ("optimizer", "scheduler"):
        section = config.get(key)
        if not isinstance(section, dict) or not isinstance(section.get("type"), str):
            continue
        name, params = section["type"], dict(section.get("params") or {})
        if key == "optimizer":
            lowered = name.lower()
            if "max_grad_norm" in params:  # DeepSpeed refuses it by name (_configure_basic_optimizer)
                raise DsautoError("optimizer.params max_grad_norm is refused by deepspeed.initialize, which clips "
                                  "gradients by the top-level gradient_clipping; move the value there.")
            if lowered in ("adam", "adamw"):
                # Adam's name forces AdamW unless adam_w_mode says otherwise (DeepSpeed's default: True)
                decoupled = params.pop("adam_w_mode", True) or lowered == "adamw"
                params.pop("fp32_optimizer_states", None)
                if params.pop("torch_adam", False):
                    cls: Any = torch.optim.AdamW if decoupled else torch.optim.Adam
                else:
                    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

                    cls = DeepSpeedCPUAdam if cpu_optimizer else FusedAdam
            elif lowered in DEEPSPEED_OPTIMIZERS:
                continue  # DeepSpeed's own (Lamb, Lion, ...) or mup's: built from optional ops
            else:
                cls = getattr(torch.optim, name, None)
            known = "DeepSpeed's optimizers or torch.optim"
        else:
            cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)
            known = "deepspeed.runtime.lr_schedules or torch.optim.lr_scheduler"
        if not inspect.isclass(cls):
            raise DsautoError(f"{key}.type {name!r} is none of {known}, so deepspeed.initialize would fail; "
                              f"check its spelling.")
        accepted = inspect.signature(cls.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            continue
        unknown = sorted(set(params) - set(accepted) - {"self"})
        if unknown:
            raise DsautoError(f"{key}.params {', '.join(map(repr, unknown))} {'are' if len(unknown) > 1 else 'is'} no "
                              f"parameter of {cls.__name__}, which DeepSpeed builds for {key} {name!r}, so "
                              f"deepspeed.initialize would fail; check the spelling (it takes "
                              f"{', '.join(n for n in accepted if n not in ('self', 'params', 'model_params', 'optimizer'))}).")


def validate_ds_config(config: dict[str, Any], dp: int) -> None:
    """Runs DeepSpeed's own config parser on ``config`` as if on ``dp`` data-parallel ranks.

    Raises :class:`DsautoError` with DeepSpeed's message when it rejects the config, and when the
    config combines pipeline parallelism with ZeRO 2 or 3, which DeepSpeed refuses later, when its
    pipeline engine starts. Hugging Face's ``"auto"`` values are checked as the plan's (see
    :func:`resolve_auto`). Not thread-safe: during the call, one module-level name of DeepSpeed's
    is replaced (see below).
    """
    # Imported here: importing DeepSpeed takes seconds, and only validation needs it.
    import deepspeed.runtime.config as ds_runtime_config

    config = _ReadKeys(resolve_auto(config))  # Hugging Face's convention: checked with the plan's values

    view = _DataParallelView(dp)
    try:
        # DeepSpeedConfig reads the rank from the module-level name ``dist`` (deepspeed.comm) of
        # deepspeed/runtime/config.py; replacing that one name for the duration of the call makes
        # it see rank 0 of dp ranks, with no process group and no global left changed afterwards.
        with mock.patch.object(ds_runtime_config, "dist", view):
            parsed = ds_runtime_config.DeepSpeedConfig(config, mpu=view)
    except (AssertionError, ValueError, TypeError, KeyError, AttributeError,  # a section of the wrong type
            ds_runtime_config.DeepSpeedConfigError) as exc:
        raise DsautoError(f"DeepSpeed rejects the config: {_one_line(exc)}.") from None
    if parsed.world_size != dp:
        # DeepSpeed swallows errors while finding its world size and falls back to 1; if it ever
        # stops asking the names replaced above, its batch check would run against 1, silently.
        raise RuntimeError(f"DeepSpeed parsed the config with world size {parsed.world_size}, "
                           f"expected the data-parallel size {dp}")
    unread = sorted(set(config) - config.read - {PLAN_KEY, PLAN_ID_KEY, MOE_KEY} - READ_WITHOUT_MPU)
    if unread:
        warnings.warn(f"DeepSpeed's config parser reads no top-level key {', '.join(map(repr, unread))}, which "
                      f"it leaves unused: check {'their' if len(unread) > 1 else 'its'} spelling.", DsautoWarning,
                      stacklevel=2)
    offload = parsed.zero_config.offload_optimizer  # DeepSpeed's CPU Adam on cpu and nvme (zero_use_cpu_optimizer)
    _check_optimizer_and_scheduler(dict(config), offload is not None and str(offload.device).split(".")[-1] in (
        "cpu", "nvme"))
    plan_block = config.get(PLAN_KEY)
    pp = plan_block.get("pp", 1) if isinstance(plan_block, dict) else 1
    if pp > 1 and parsed.zero_optimization_stage >= 2:
        # deepspeed/runtime/pipe/engine.py asserts zero stage < 2 in PipelineEngine.__init__.
        raise DsautoError(
            f"DeepSpeed's pipeline engine refuses ZeRO stage {parsed.zero_optimization_stage} with "
            f"pipeline parallelism (pp={pp}); use ZeRO stage 0 or 1, or pp=1."
        )


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line, without a trailing full stop."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        # A pydantic ValidationError (DeepSpeed's section models forbid unknown keys): name each
        # offending key instead of repeating pydantic's multi-line report.
        text = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in errors())
        text = f"{getattr(exc, 'title', 'config')}: {text}"
    else:
        text = " ".join(str(exc).split()) or type(exc).__name__
    return text.rstrip(".")
