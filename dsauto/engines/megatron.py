"""Megatron-core's rules and spellings that both ``megatron_args.txt`` and the Megatron-core
plugin apply: the pipeline layout, block recomputation and the sharding strategy of each ZeRO stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsauto.parallel import Degree, ParallelDims
from dsauto.plan import Plan, chunk_layers
from dsauto.spec.model import ModelSpec

DEGREES: dict[Degree, tuple[str, str]] = {
    "tp": ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
    "pp": ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
    "cp": ("--context-parallel-size", "context_parallel_size"),
    "ep": ("--expert-model-parallel-size", "expert_model_parallel_size"),
    "etp": ("--expert-tensor-parallel-size", "expert_tensor_parallel_size"),
}
"""Each degree Megatron is told, as (Megatron-LM flag, argument of ``parallel_state.
initialize_model_parallel`` and field of ``TransformerConfig``); Megatron derives the data-parallel
degree from the world size, and the expert data-parallel degree from it and ep x etp x pp
(megatron/core/parallel_state.py)."""

EXPERT_DEGREES: tuple[Degree, ...] = ("ep", "etp")
"""Degrees only a mixture of experts is told. Both are written for one, etp included: Megatron's
default etp is tp (``expert_tensor_parallel_size=None``), not 1."""


def degree_flags(dims: ParallelDims, experts: bool = False) -> list[str]:
    """The Megatron-LM flags setting the plan's degrees (a degree of 1 that is Megatron's default
    beyond tp and pp is left out; the expert degrees are written for a mixture of experts only)."""
    return [f"{flag} {dims.degree(dim)}" for dim, (flag, _) in DEGREES.items()
            if dim in ("tp", "pp") or (experts and dim in EXPERT_DEGREES)
            or (dim not in EXPERT_DEGREES and dims.degree(dim) > 1)]


def degree_fields(dims: ParallelDims, experts: bool = False) -> dict[str, int]:
    """The degrees as ``initialize_model_parallel`` / ``TransformerConfig`` keyword arguments (the
    expert degrees for a mixture of experts only)."""
    return {name: dims.degree(dim) for dim, (_, name) in DEGREES.items()
            if experts or dim not in EXPERT_DEGREES}


ATTENTION_BACKEND = {"flash": "flash", "cudnn": "fused"}
"""Megatron-LM's ``--attention-backend`` of each fused attention kernel a plan is priced with
(FlashAttention, cuDNN's fused attention through Transformer Engine)."""

FSDP_STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}
"""ZeRO stage -> Megatron-FSDP sharding strategy (megatron/core/distributed/
distributed_data_parallel_config.py: ``data_parallel_sharding_strategy``). Stage 1 is Megatron's
distributed optimizer alone; it shards optimizer states but keeps a full gradient buffer, so stages
2 and 3 need Megatron-FSDP to shard gradients (and parameters) as the plan assumes."""


@dataclass(frozen=True)
class PipelineLayout:
    """How Megatron is told the plan's transformer layers per stage; all None when its even split
    already places them."""

    first_stage_layers: int | None = None
    """``num_layers_in_first_pipeline_stage`` (``--decoder-first-pipeline-num-layers``)."""
    last_stage_layers: int | None = None
    """``num_layers_in_last_pipeline_stage`` (``--decoder-last-pipeline-num-layers``)."""
    layout: str | None = None
    """``pipeline_model_parallel_layout`` (``--pipeline-model-parallel-layout``)."""


@dataclass(frozen=True)
class MaxConnections:
    """What the plan needs of ``CUDA_DEVICE_MAX_CONNECTIONS``, the hardware queues CUDA spreads a
    process's streams over, at launch on Hopper and earlier GPUs."""

    one: bool
    """True: it must be 1 (kernels start in the order issued, so that the tensor-parallel
    collectives Megatron-core issues before the GEMMs they overlap start first:
    megatron/core/tensor_parallel/layers.py); False: it must not be 1 (unset, or more)."""
    why: str
    """What needs it, as a phrase."""

    def setting(self) -> str:
        return "CUDA_DEVICE_MAX_CONNECTIONS=1" if self.one else "CUDA_DEVICE_MAX_CONNECTIONS unset (or above 1)"


def max_connections(plan: Plan) -> MaxConnections | None:
    """The plan's need of ``CUDA_DEVICE_MAX_CONNECTIONS`` (None: either works), as Megatron-LM's
    ``validate_args`` (megatron/training/arguments.py) checks it: Megatron-FSDP asserts it is not 1
    (on every GPU); before Blackwell, tensor or context parallelism asserts it is 1 (without
    Megatron-FSDP or the expert all-to-all overlap, where it only warns); the expert all-to-all
    overlap needs more than 1 (megatron/core/transformer/moe/README.md)."""
    if plan.zero_stage in FSDP_STRATEGY:
        return MaxConnections(False, "Megatron-FSDP (validate_args asserts it is not 1)")
    if plan.expert_a2a_overlap:
        return MaxConnections(False, "the expert all-to-all overlap (Megatron-core's MoE requirements)")
    if plan.tp > 1 or plan.cp > 1:
        return MaxConnections(True, "tensor or context parallelism (validate_args asserts it before Blackwell, and "
                                    "the overlap of their collectives the plan prices relies on it)")
    return None


LAUNCH_ENVIRONMENT = "Launch environment:"
"""How megatron_args.txt begins the comment that states a variable the launch needs; the reader of
launches (:mod:`dsauto.engines.megatron_args`) takes what it sets."""

LAUNCH_VOCABULARY = "Vocabulary:"
"""How megatron_args.txt begins the comment that states the tokenizer's vocabulary (Megatron-LM reads
it from the tokenizer, not a flag); the reader of launches takes it where no --vocab-size is given."""

PLANNED_FOR = "Megatron-LM arguments of the dsauto plan for"
"""The start of the first line of dsauto's own megatron_args.txt, which names the cluster it was
planned for (``... on NODES x GPUS HARDWARE.``)."""

TE_FUSED_SOFTMAX_KEYS = (16, 16384, 8)
"""Transformer Engine's fused masked softmax takes s keys with 16 < s < 16384 and s a multiple of 8
(transformer_engine/pytorch/attention/dot_product_attention/softmax.py, ``is_kernel_available``; it also
needs the attention batches, micro-batch x heads per rank, a multiple of 4)."""


def qk_layernorm(model: ModelSpec) -> bool:
    """Megatron-core's ``qk_layernorm`` (``--qk-layernorm``) for ``model``: its query and key norms, or
    with latent attention the norms of the compressed query and key/value (DeepSeek-V2's
    ``q_a_layernorm`` and ``kv_a_layernorm``), which Megatron-core's MLA layer specs build only
    under this flag (megatron/core/models/gpt/gpt_layer_specs.py: ``q_layernorm`` / ``kv_layernorm``,
    or the layer-norm-fused up projections, else IdentityOp)."""
    return model.qk_norm or model.latent_attention


def te_softmax_fuses(seq_len: int, micro_batch: int, heads_per_rank: int, fusion: str = "1") -> bool:
    """Whether Transformer Engine's unfused attention (Megatron-LM's default layers with
    ``--attention-backend unfused``) runs its fused masked softmax, which keeps 16 bits: for the keys
    and attention batches it takes, unless ``fusion``, the launch's ``NVTE_MASKED_SOFTMAX_FUSION``
    (default 1), is 0; otherwise its torch softmax runs in fp32 (``softmax_in_fp32`` True) and keeps
    the fp32 output."""
    low, high, multiple = TE_FUSED_SOFTMAX_KEYS
    switched_off = fusion.strip().isdigit() and int(fusion) == 0
    return (not switched_off and low < seq_len < high and seq_len % multiple == 0
            and (micro_batch * heads_per_rank) % 4 == 0)


def softmax_fusion_setting(plan: Plan) -> str | None:
    """The launch environment a plan with unfused attention needs for the softmax it is priced with: its
    fp32 softmax (dsauto's plugin, the default) where Transformer Engine would fuse it, which
    ``NVTE_MASKED_SOFTMAX_FUSION=0`` turns off; None otherwise (fused attention, fp32 training, or the
    16-bit softmax, which the kernel runs)."""
    if plan.flash_attention or plan.dtype == "fp32" or not plan.attention_softmax_in_fp32:
        return None
    if not te_softmax_fuses(plan.seq_len, plan.micro_batch, plan.model.num_attention_heads // plan.tp):
        return None
    return "NVTE_MASKED_SOFTMAX_FUSION=0"


def megatron_grad_bytes(plan: Plan) -> int:
    """Bytes of one gradient in Megatron-core's gradient buffer, which its ``bucket_size`` (Megatron-LM's
    ``--ddp-bucket-size``, in parameters) fills: fp32 under bf16 (Megatron-LM's validate_args sets
    ``accumulate_allreduce_grads_in_fp32``) unless the plan reduces in bf16 (``--grad-reduce-in-bf16``),
    and the parameter dtype otherwise (distributed_data_parallel.py: the grad dtype is fp32 only with
    ``grad_reduce_in_fp32``)."""
    if plan.dtype == "bf16":
        return 4 if plan.grad_reduce_in_fp32 else 2
    return 2 if plan.dtype == "fp16" else 4


def ddp_bucket_size(plan: Plan) -> int:
    """Megatron-core's ``bucket_size`` (``--ddp-bucket-size``, in parameters) of the plan's gradient
    buckets: their bytes over :func:`megatron_grad_bytes`."""
    return max(1, plan.reduce_bucket_bytes // megatron_grad_bytes(plan))


def pipeline_layout(stage_layers: Sequence[int], virtual_stages: int = 1, mtp_layers: int = 0,
                    chunks: Sequence[int] | None = None) -> PipelineLayout:
    """The Megatron setting that places ``stage_layers`` transformer layers on each stage.

    Megatron splits layers evenly when nothing is set. First and last stage counts cover layouts
    whose middle stages are equal and whose ends are not empty (Megatron splits the remaining layers
    evenly over the middle stages: TransformerConfig.num_layers_in_first/last_pipeline_stage); any
    other layout, stages without transformer layers included, is a layout string. With virtual
    stages the layout string lists every model chunk in Megatron's order (chunk s * pp + r is rank
    r's s-th; :func:`dsauto.plan.chunk_layers`, ``chunks`` where the plan gives each its own count), from
    which Megatron reads the virtual pipeline size (PipelineParallelLayerLayout: len(layout) // pp). A
    layout string places the ``mtp_layers`` multi-token-prediction layers before the loss, where
    Megatron builds them without one.
    """
    if virtual_stages > 1:
        return PipelineLayout(layout=layout_string(chunk_layers(stage_layers, virtual_stages, chunks), mtp_layers))
    stages = list(stage_layers)
    if len(stages) == 1 or len(set(stages)) == 1:
        return PipelineLayout()
    first, *middle, last = stages
    if first > 0 and last > 0 and len(set(middle)) <= 1:
        return PipelineLayout(first_stage_layers=first, last_stage_layers=last)
    return PipelineLayout(layout=layout_string(stages, mtp_layers))


def layout_string(stage_layers: Sequence[int], mtp_layers: int = 0) -> str:
    """Megatron's pipeline layout string (megatron/core/transformer/pipeline_parallel_layer_layout.py):
    stages split by "|", E the embedding, t a transformer layer, m a multi-token-prediction layer
    (all of them in the last stage, after its transformer layers), L the loss (head), x*n repeats x."""
    def run(char: str, count: int) -> str:
        return char if count == 1 else f"{char}*{count}" if count > 1 else ""

    stages = []
    for stage, count in enumerate(stage_layers):
        last = stage == len(stage_layers) - 1
        text = ("E" if stage == 0 else "") + run("t", count)
        text += run("m", mtp_layers) + "L" if last else ""
        stages.append(text)
    return "|".join(stages)


def block_recompute_layers(plan: Plan) -> int | None:
    """N for ``--recompute-method block --recompute-num-layers N``, 0 when nothing is checkpointed.

    Megatron's block method checkpoints the first N transformer layers of every TransformerBlock
    (all of its layers when it has N or fewer; megatron/core/transformer/transformer_block.py,
    _checkpointed_forward). A block is a pipeline stage, or with virtual stages a model chunk, so N
    counts per chunk (:meth:`Plan.stage_ranges`). Returns None when the plan's checkpointed layers
    are not of that form.
    """
    checkpointed = set(plan.checkpointed_layers())
    full: list[int] = []  # chunks checkpointed entirely: their layer counts
    partial: set[int] = set()  # chunks checkpointed in part: the length of the checkpointed prefix
    for layers in plan.stage_ranges():
        flags = [layer in checkpointed for layer in layers]
        prefix = flags.index(False) if False in flags else len(flags)
        if any(flags[prefix:]):
            return None
        if prefix == len(flags):
            full.append(prefix)
        else:
            partial.add(prefix)
    longest_full = max(full, default=0)
    if not partial:
        return longest_full
    if len(partial) > 1:
        return None
    n = partial.pop()
    # A fully checkpointed chunk needs N >= its layer count; a partial one needs exactly N.
    return n if n >= longest_full else None


def selective_recompute_modules(plan: Plan) -> tuple[str, ...] | None:
    """The modules for ``--recompute-granularity selective --recompute-modules ...``: the plan's
    when every transformer layer recomputes the same set and none is checkpointed whole, as
    Megatron-core runs it (one granularity and one module list for all layers:
    TransformerConfig.recompute_granularity / recompute_modules); () when the plan recomputes no
    module selectively; None when its selective recomputation is not of that form."""
    sets = plan.selective_layers()
    if not sets:
        return ()
    modules = plan.uniform_recompute_modules()
    return modules if modules and not plan.checkpointed_layers() else None
