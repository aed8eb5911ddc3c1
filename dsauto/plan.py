"""The plan: every choice dsauto makes, with what it predicts, as one frozen, serialisable object.

The search produces a :class:`Plan`; the emitters turn it into engine configs; the runtime hooks read it
back (from ``plan.yaml`` or from the ``"dsauto"`` block of ``ds_config.json``). Engine spellings
never appear here.

Layers are numbered in execution order over the whole model: 0 is the embedding, 1..L are the
transformer layers, L+1 is the head (final norm, LM head and loss).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dsauto.parallel import ParallelDims
from dsauto.serde import from_dict, to_dict
from dsauto.spec.model import ModelSpec
from dsauto.spec.training import Dtype

PLAN_VERSION = 1

Basis = Literal["analytic", "measured", "mixed"]

Engine = Literal["deepspeed", "megatron"]
"""The engine a plan is made for: it decides which degrees can run and how memory and overlap are
priced (DeepSpeed's ZeRO partitions and buffers, or Megatron-core's fp32 gradient buffer,
distributed optimizer and overlapped reductions)."""
ENGINES: tuple[Engine, ...] = ("deepspeed", "megatron")

RecomputeModule = Literal["core_attn", "layernorm", "mlp", "moe_act", "mla_up_proj", "moe", "shared_experts"]
"""A part of a transformer layer that selective recomputation re-runs in backward instead of
keeping its activations (Korthikanti et al. 2022, Sec. 5; Megatron-core's ``recompute_modules``
names): ``core_attn`` the attention core (scores, softmax, dropout, attention over values),
``layernorm`` the pre-norms (their outputs are dropped), ``mlp`` the dense MLP, ``moe_act`` the
routed experts' activation function (its output, the second expert matrix's input, is dropped;
Megatron-core only), ``mla_up_proj`` latent attention's up projections and rotary embedding (the
queries, keys and values they make are dropped once the attention core has run; Megatron-core only),
``moe`` an MoE layer's whole MLP (router, dispatch, experts, combine and shared experts: only its input
is kept; Megatron-core only), ``shared_experts`` an MoE layer's shared experts (Megatron-core only)."""
RECOMPUTE_MODULES: tuple[RecomputeModule, ...] = ("core_attn", "layernorm", "mlp", "moe_act", "mla_up_proj", "moe",
                                                  "shared_experts")

ExpertDispatcher = Literal["alltoall", "deepep"]
"""Megatron-core's MoE token dispatcher: ``alltoall`` (``--moe-token-dispatcher-type alltoall``) or
``deepep`` (``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep``, DeepSeek's
DeepEP kernels, installed apart)."""
EXPERT_DISPATCHERS: tuple[ExpertDispatcher, ...] = ("alltoall", "deepep")

Offload = Literal["none", "optimizer", "optimizer+params"]
"""What a plan keeps in host (CPU) memory instead of device memory: nothing; the optimizer state
(fp32 master weights, Adam moments and the fp32 gradients they are updated from), updated by the
CPU; or that and, under ZeRO-3, the parameters' partitions, fetched over the host link for each use."""
OFFLOADS: tuple[Offload, ...] = ("none", "optimizer", "optimizer+params")

AttentionKernel = Literal["flash", "cudnn"]
"""The fused attention kernel a plan runs: ``flash`` (FlashAttention-2, or PyTorch's SDPA over it;
Megatron-core's ``--attention-backend flash``) or ``cudnn`` (cuDNN's fused attention, which
Transformer Engine runs as FusedAttention; Megatron-core's ``--attention-backend fused``)."""
ATTENTION_KERNELS: tuple[AttentionKernel, ...] = ("flash", "cudnn")

Fp8Recipe = Literal["delayed", "tensorwise"]
"""How an FP8 plan scales its tensors (Megatron-core's ``--fp8-recipe``, Transformer Engine's
recipes): ``delayed`` from a history of each tensor's maxima (Megatron-core's default), or
``tensorwise`` from each tensor's own maximum, found by a pass over it before the cast (current
scaling)."""
FP8_RECIPES: tuple[Fp8Recipe, ...] = ("delayed", "tensorwise")

MomentsDtype = Literal["fp32", "bf16", "fp16", "fp8"]
"""The dtype Megatron-core's precision-aware optimizer keeps Adam's two moments in
(``--exp-avg-dtype`` and ``--exp-avg-sq-dtype``)."""
MOMENT_BYTES: dict[MomentsDtype, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
"""Bytes of one moment of one parameter, by :data:`MomentsDtype`."""

CpCommType = Literal["p2p", "all_gather", "a2a"]
"""How Megatron-core's context parallelism exchanges a sequence's shards around attention
(``--cp-comm-type``, Transformer Engine's ``cp_comm_type``): ``p2p`` passes keys and values around
a ring, overlapped with attention (Megatron-core's default); ``all_gather`` all-gathers them before
attention and reduce-scatters their gradients after it (Llama 3's method); ``a2a`` trades the
sequence shard for a share of the heads, as DeepSpeed-Ulysses does."""
CP_COMM_TYPES: tuple[CpCommType, ...] = ("p2p", "all_gather", "a2a")


def stage_bounds(stage_layers: Sequence[int]) -> list[tuple[int, int]]:
    """First and last flat layer of each stage: the embedding joins stage 0, the head the last."""
    bounds, start = [], 1
    for i, n in enumerate(stage_layers):
        first = 0 if i == 0 else start
        last = start + n - 1 + (1 if i == len(stage_layers) - 1 else 0)
        bounds.append((first, last))
        start += n
    return bounds


def chunk_layers(stage_layers: Sequence[int], virtual_stages: int = 1,
                 chunks: Sequence[int] | None = None) -> list[int]:
    """Transformer layers of each model chunk, in Megatron's chunk order: chunk ``s * pp + r`` is
    the ``s``-th virtual stage of pipeline rank ``r`` (megatron/core/transformer/
    pipeline_parallel_layer_layout.py reads a layout's stages in that order). ``chunks``: the counts
    a layout gives each chunk (:attr:`Plan.chunk_layout`), which must add up to each rank's; None:
    rank r's layers split over its chunks as evenly as possible, the earlier chunks taking the
    remainder; with one virtual stage the chunks are the stages."""
    pp = len(stage_layers)
    if chunks is not None:
        if problem := chunk_layout_problem(stage_layers, virtual_stages, chunks):
            raise ValueError(problem)
        return list(chunks)
    out = [0] * (pp * virtual_stages)
    for rank, count in enumerate(stage_layers):
        base, extra = divmod(count, virtual_stages)
        for s in range(virtual_stages):
            out[s * pp + rank] = base + (1 if s < extra else 0)
    return out


def rank_totals(chunks: Sequence[int], pp: int, virtual_stages: int) -> list[int]:
    """What each of the pp pipeline ranks holds of per-chunk counts in chunk order (chunk ``s * pp + r``
    is rank r's s-th): the sum over its chunks."""
    return [sum(chunks[s * pp + r] for s in range(virtual_stages)) for r in range(pp)]


ACCOUNTED_STAGES = {"even+embedding": (True, False), "even+loss": (False, True), "even+embedding+loss": (True, True)}
"""dsauto's names (``--stage-layers``) of Megatron-core's even split that counts the embedding, the loss
or both as one transformer layer each (Megatron-LM's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split): (embedding, loss) counted, as :func:`accounted_chunks` takes them."""


def accounted_chunks(num_layers: int, pp: int, virtual_stages: int, embedding: bool,
                     loss: bool) -> list[int] | None:
    """The transformer layers of each model chunk (in chunk order; of each stage without virtual
    stages) of Megatron-core's even split that counts the embedding and the loss as a layer each
    (--account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split): the layers plus
    those counted, split evenly over the ranks and each rank's over its chunks, one fewer built in
    the first rank's first chunk and in the last rank's last (megatron/core/transformer/
    transformer_block.py, get_num_layers_to_build). None where the sum does not divide, which
    Megatron-core refuses (transformer_config.py)."""
    chunks, slots = pp * virtual_stages, num_layers + embedding + loss
    if slots % chunks:
        return None
    counts = [slots // chunks] * chunks
    counts[0] -= embedding
    counts[-1] -= loss
    return counts


def chunk_layout_problem(stage_layers: Sequence[int], virtual_stages: int, chunks: Sequence[int]) -> str | None:
    """Why ``chunks`` (layers per model chunk, in chunk order) is not a layout of ``stage_layers``
    over ``virtual_stages`` chunks a rank, or None."""
    pp = len(stage_layers)
    if len(chunks) != pp * virtual_stages:
        return f"chunk_layout {list(chunks)} must have pp x vpp = {pp * virtual_stages} entries"
    if any(n < 0 for n in chunks):
        return f"chunk_layout {list(chunks)} must not be negative"
    held = rank_totals(chunks, pp, virtual_stages)
    if held != list(stage_layers):
        return (f"chunk_layout {list(chunks)} gives the pipeline ranks {held} transformer layers, and "
                f"stage_layers {list(stage_layers)}")
    return None


def even_chunks(stage_layers: Sequence[int], virtual_stages: int, chunks: Sequence[int]) -> bool:
    """Whether ``chunks`` is the split :func:`chunk_layers` makes without a layout."""
    return list(chunks) == chunk_layers(stage_layers, virtual_stages)


def block_recompute_set(stage_layers: Sequence[int], virtual_stages: int, n: int,
                        chunks: Sequence[int] | None = None) -> frozenset[int]:
    """The transformer layers (flat numbering, 1..L) that Megatron's block recomputation of ``n``
    layers checkpoints: the first ``n`` of every model chunk (megatron/core/recompute.py, the 'block'
    method, run by each TransformerBlock, i.e. each chunk; chunks as :func:`chunk_layers`)."""
    out, start = set(), 1
    for count in chunk_layers(stage_layers, virtual_stages, chunks):
        out.update(range(start, start + min(n, count)))
        start += count
    return frozenset(out)


def rank_layers(stage_layers: Sequence[int], virtual_stages: int = 1,
                chunks: Sequence[int] | None = None) -> list[list[int]]:
    """The flat layers each pipeline rank holds, in order: the layers of its chunks (chunks hold
    consecutive layers, in chunk order; ``chunks`` as :func:`chunk_layers`), the embedding on rank 0
    and the head on the last rank. With one virtual stage, rank r holds the contiguous layers of
    :func:`stage_bounds`."""
    pp = len(stage_layers)
    ranks: list[list[int]] = [[] for _ in range(pp)]
    ranks[0].append(0)
    start = 1
    for k, count in enumerate(chunk_layers(stage_layers, virtual_stages, chunks)):
        ranks[k % pp].extend(range(start, start + count))
        start += count
    ranks[-1].append(start)
    return [sorted(layers) for layers in ranks]


def rank_chunks(stage_layers: Sequence[int], virtual_stages: int, rank: int,
                chunks: Sequence[int] | None = None) -> list[int]:
    """The model chunk (0..v-1) of each flat layer pipeline rank ``rank`` holds, in the order of
    :func:`rank_layers`: the embedding in the first rank's first chunk, the head in the last rank's
    last chunk, the transformer layers as :func:`chunk_layers` places them."""
    pp = len(stage_layers)
    counts = chunk_layers(stage_layers, virtual_stages, chunks)
    out = [0] if rank == 0 else []
    for s in range(virtual_stages):
        out += [s] * counts[s * pp + rank]
    return out + ([virtual_stages - 1] if rank == pp - 1 else [])


@dataclass(frozen=True)
class LayerChoice:
    """The per-layer choices of a run of consecutive layers that share them."""

    first: int
    """First layer of the run (0 = embedding, 1..L = transformer layers, L+1 = head)."""
    last: int
    """Last layer of the run, inclusive."""
    group: str
    """Layer group of the run: ``embedding``, ``decoder`` / ``encoder`` or ``head``."""
    stage: int
    """Pipeline stage holding these layers."""
    checkpoint: bool
    """Activation checkpointing: keep only each layer's input and recompute it in backward."""
    shard_params: bool
    """Under ZeRO-3: True keeps the parameters sharded and gathers them per use (OSDP's SDP);
    False keeps them resident on every data-parallel rank (OSDP's DP) while gradients and
    optimizer states stay sharded. Below ZeRO-3 parameters are never sharded and this is False."""
    split: int
    """Operator-splitting factor: the layer's largest matrix is computed as this many slices
    (for the head: the logits and loss in this many chunks); 1 means unsplit."""
    recompute_modules: tuple[RecomputeModule, ...] = ()
    """Selective recomputation: the parts of each transformer layer of the run re-run in backward
    (:data:`RecomputeModule`); empty for none. Only for layers not checkpointed whole."""

    def __post_init__(self) -> None:
        if self.last < self.first:
            raise ValueError(f"layer run {self.first}..{self.last} is empty")
        if self.split < 1:
            raise ValueError(f"split must be at least 1, got {self.split}")
        if self.recompute_modules and self.checkpoint:
            raise ValueError(f"layers {self.first}..{self.last} are checkpointed whole, so they cannot also "
                             f"recompute {', '.join(self.recompute_modules)} selectively")
        unknown = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if unknown or len(set(self.recompute_modules)) != len(self.recompute_modules):
            raise ValueError(f"recompute_modules {list(self.recompute_modules)} must be distinct names among "
                             f"{', '.join(RECOMPUTE_MODULES)}")


@dataclass(frozen=True)
class StagePrediction:
    """What the cost model predicts for one pipeline stage (per rank of that stage)."""

    stage: int
    """Stage index, 0 first."""
    first_layer: int
    """First layer of the stage (same numbering as :class:`LayerChoice`)."""
    last_layer: int
    """Last layer of the stage, inclusive (with virtual stages the rank holds only its chunks'
    layers in between: :meth:`Plan.rank_layers`)."""
    micro_batches_in_flight: int
    """Micro-batches whose activations the stage holds at once under 1F1B (min(pp - stage, m));
    under the interleaved schedule, its chunk passes divided by the chunks per rank, rounded up."""
    forward_seconds: float
    """Forward time of one micro-batch through the stage, communication included."""
    backward_seconds: float
    """Backward time of one micro-batch, recomputation and communication included."""
    params_bytes: int
    """Resident parameter bytes."""
    grads_bytes: int
    """Gradient bytes."""
    optimizer_bytes: int
    """Optimizer state bytes (fp32 master weights and Adam moments)."""
    activation_bytes: int
    """Activation bytes kept for backward, all micro-batches in flight."""
    transient_bytes: int
    """Largest short-lived allocation: gathered ZeRO-3 parameters, a recomputed layer, the logits."""
    peak_bytes: int
    """Predicted peak memory of the stage's ranks: the sum of the above."""
    basis: Basis = "analytic"
    """Where the stage's layer times and activations came from: the analytic device model, a
    measured profile, or both (layers the profile lacks were priced analytically)."""
    chunk_forward_seconds: tuple[float, ...] = ()
    """Under the interleaved schedule, the forward time of one micro-batch through each of the
    rank's model chunks, first chunk first (they sum to ``forward_seconds``); empty with one chunk."""
    chunk_backward_seconds: tuple[float, ...] = ()
    """The same of the backward (they sum to ``backward_seconds``)."""


@dataclass(frozen=True)
class Prediction:
    """The predicted step of the whole plan."""

    step_seconds: float
    """Time of one optimizer step."""
    tokens_per_second: float
    """Training throughput over the whole cluster."""
    mfu: float
    """Model FLOP utilisation: model FLOPs per step (6·N·tokens + attention, no recomputation; PaLM,
    Chowdhery et al. 2022, Appendix B, with causal attention counted as a fused kernel computes it,
    half the square) over step time times the cluster's peak FLOP/s."""
    tflops_per_device: float
    """Hardware FLOP/s per device in TFLOP/s, recomputation included (as Narayanan et al. 2021 count)."""
    peak_memory_bytes: int
    """The largest per-rank peak over all stages."""
    compute_seconds: float
    """Of the step: forward and backward compute of the slowest stage over all micro-batches."""
    bubble_seconds: float
    """Of the step: pipeline fill and drain."""
    exposed_comm_seconds: float
    """Of the step: data-parallel / ZeRO communication not hidden behind compute."""
    optimizer_seconds: float
    """Of the step: the optimizer update."""
    basis: Basis = "analytic"
    """What the layer costs came from: the analytic device model, a measured profile, or both."""
    profile: str = ""
    """The profile the measured costs came from (its file name), empty when analytic."""
    plain_bubble_seconds: float | None = None
    """With virtual stages: the bubble the same plan would have under plain 1F1B (one chunk per
    rank), to show what interleaving saves; None otherwise."""
    offloaded_bytes: int = 0
    """Host memory per rank holding what the plan offloads (optimizer state, gradients' fp32 copy,
    parameters' partitions); 0 without offload. A node's ranks together must fit its host memory."""
    expert_all_to_all_seconds: float = 0.0
    """Of ``compute_seconds``: the expert-parallel all-to-alls (token dispatch and combine, forward,
    backward and recomputation, with expert tensor parallelism's token gathers) of the slowest stage
    over all micro-batches; 0 without experts."""
    tp_comm_seconds: float = 0.0
    """Of ``compute_seconds``: the tensor-parallel collectives (forward, backward and recomputation)
    of the slowest stage over all micro-batches that the step waits for (under ``--tp-comm-overlap``
    what the GEMMs leave exposed); 0 without tensor parallelism."""
    p2p_seconds: float = 0.0
    """Of ``compute_seconds``: the pipeline's point-to-point transfers (each micro-batch's boundary
    activation received and sent, its gradient in backward) of the slowest stage over all
    micro-batches that the step waits for (an interleaved Megatron-core schedule overlaps the rest);
    0 without pipeline parallelism."""


@dataclass(frozen=True)
class Measurement:
    """What real training steps of the plan measured (``dsauto tune --trials``)."""

    step_seconds: float
    """Median time of one optimizer step over the timed steps, the slowest rank's."""
    tokens_per_second: float
    """Training throughput over the whole cluster at that step time."""
    peak_memory_bytes: int
    """Most live tensor bytes on any rank during a step."""
    steps: int
    """Timed steps behind the median."""
    trial: int
    """Number of the study's trial that measured it."""
    study: str
    """The study (name in its storage) that ran the trial."""


@dataclass(frozen=True)
class Ranking:
    """How the winner was chosen among plans predicted nearly as fast: a prediction a few percent
    off could reorder them, and a plan near the memory limit is the one that runs out of memory
    when memory is under-predicted, so among the plans within ``tolerance`` of the fastest the
    search takes the fastest that keeps ``safe_headroom_bytes`` free, or else the one with the most
    headroom (:mod:`dsauto.search.ranking`)."""

    tolerance: float
    """Relative step-time margin within which plans count as tied (0.03 = 3%)."""
    headroom_bytes: int
    """The winner's memory budget less its predicted peak, on its busiest rank."""
    safe_headroom_bytes: int
    """The headroom a plan keeps to count as safe; the fastest tied plan that keeps it wins, else
    the tied plan with the most headroom."""
    fastest_step_seconds: float
    """Step time of the fastest plan found (the winner's own when it is the fastest)."""
    fastest_headroom_bytes: int
    """Headroom of that fastest plan."""
    tied_plans: int
    """Plans within the tolerance of the fastest, the winner included."""


@dataclass(frozen=True)
class Plan:
    """A complete training configuration for one model on one cluster, and its predicted cost."""

    model: ModelSpec
    """The model planned for."""
    hardware: str
    """Hardware preset or file the plan was made for."""
    nodes: int
    """Nodes in the cluster."""
    gpus_per_node: int
    """Devices per node."""
    memory_budget_bytes: int
    """Per-rank memory budget the plan was made to fit."""
    dp: int
    """Data-parallel degree."""
    tp: int
    """Tensor-parallel degree (inside a node)."""
    pp: int
    """Pipeline-parallel degree."""
    zero_stage: int
    """ZeRO stage 0-3 (partitioning of optimizer states, gradients and parameters over DP ranks)."""
    sequence_parallel: bool
    """Megatron sequence parallelism (splits norm and dropout activations over TP ranks)."""
    micro_batch: int
    """Sequences per micro-batch per data-parallel rank."""
    grad_accum: int
    """Micro-batches per optimizer step per data-parallel rank (the pipeline's micro-batch count)."""
    global_batch: int
    """Sequences per optimizer step: micro_batch x grad_accum x dp."""
    seq_len: int
    """Tokens per sequence."""
    dtype: Dtype
    """Training dtype (bf16, fp16 or fp32)."""
    flash_attention: bool
    """Whether attention is fused (no s×s scores kept)."""
    padded_vocab_size: int
    """Vocabulary size after padding for TP (Megatron's rule)."""
    stage_layers: tuple[int, ...]
    """Transformer layers per pipeline stage (the embedding joins stage 0, the head the last)."""
    reduce_bucket_bytes: int
    """Gradient reduction bucket size for ZeRO / DDP."""
    prefetch_bucket_bytes: int
    """ZeRO-3 parameter prefetch bucket size."""
    layers: tuple[LayerChoice, ...]
    """Per-layer choices as runs covering layers 0..L+1 exactly once, in order."""
    stages: tuple[StagePrediction, ...]
    """Per-stage predictions."""
    prediction: Prediction
    """Whole-step prediction."""
    measured: Measurement | None = None
    """Real steps of this plan, when the refiner measured them; None for a plan only predicted."""
    engine: Engine = "deepspeed"
    """The engine the plan is priced for and runs in."""
    ranking: Ranking | None = None
    """Why the search ranked this plan first: the near-ties it weighed by memory headroom; None for
    a plan built from given choices."""
    cp: int = 1
    """Context-parallel degree: ranks sharing each sequence (Megatron's ring attention); the world
    is dp x tp x pp x cp."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank: more than 1 is Megatron's interleaved 1F1B schedule, which
    cuts the pipeline bubble by this factor for that many times the point-to-point traffic; rank
    r holds chunks r, r + pp, ... (:func:`chunk_layers`)."""
    chunk_layout: tuple[int, ...] | None = None
    """Transformer layers of each model chunk in chunk order (pp x virtual_stages entries, each rank's
    adding up to its ``stage_layers``) where a layout splits a rank's layers otherwise than evenly
    (NVIDIA's DeepSeek-V3 layouts give a last chunk one layer beside the loss); None: the even split
    of :func:`chunk_layers`. Emitted as Megatron-core's ``--pipeline-model-parallel-layout``."""
    ep: int = 1
    """Expert-parallel degree (mixtures of experts): ranks splitting the routed experts, folded inside
    tp x cp x dp (:class:`dsauto.parallel.ParallelDims`)."""
    etp: int = 1
    """Expert tensor-parallel degree: shards of each routed expert's matrices."""
    offload: Offload = "none"
    """What lives in host memory instead of on the device (:data:`Offload`); DeepSpeed's
    ``offload_optimizer`` / ``offload_param``, Megatron-core's optimizer CPU offload."""
    hpz: int = 1
    """ZeRO++ hierarchical partitioning (DeepSpeed ZeRO-3): each rank also keeps a secondary
    partition of the sharded parameters over this many ranks of its node, so that backward
    gathers them inside the node; 1 is plain ZeRO-3."""
    dist_opt_instances: int = 1
    """Megatron-core's partial distributed optimizer (``num_distributed_optimizer_instances``): the
    dp x cp replicas form this many instances of consecutive ranks, each sharding the optimizer
    state over its own ranks only (a node's, when an instance fills one); gradients are
    reduce-scattered inside an instance and all-reduced across instances. 1 shards over all of dp x cp."""
    attention_kernel: AttentionKernel = "flash"
    """The fused attention kernel the plan is priced with and runs (:data:`AttentionKernel`);
    ``cudnn`` only in a 16-bit Megatron-core plan with fused attention."""
    tp_comm_overlap: bool = False
    """Megatron-core's ``--tp-comm-overlap``: Transformer Engine's userbuffers overlap the
    tensor-parallel all-gathers and reduce-scatters with the linear layers' GEMMs (tp > 1 with
    sequence parallelism)."""
    grad_reduce_in_fp32: bool = True
    """Megatron-core under bf16: gradients accumulated and reduced in fp32 (its default); False is
    ``--grad-reduce-in-bf16`` (a bf16 gradient buffer, half the bytes and half the reduction)."""
    overlap_grad_reduce: bool = True
    """Megatron-core's ``--overlap-grad-reduce``: gradient buckets reduced during the last backward (its
    plans' default); False: reduced at once after the backward, exposed (Megatron-LM's default launch,
    only when pinned). Only False in a Megatron-core plan of ZeRO 0-1."""
    overlap_param_gather: bool = True
    """Megatron-core's ``--overlap-param-gather`` under the distributed optimizer: parameters gathered
    during the next forward (its plans' default); False: at once after the optimizer step, exposed.
    Only False in a Megatron-core plan of ZeRO 0-1, and False whenever ``overlap_grad_reduce`` is."""
    expert_dispatcher: ExpertDispatcher = "alltoall"
    """The MoE token dispatcher the plan is priced with and runs (:data:`ExpertDispatcher`);
    ``deepep`` only in a Megatron-core plan of a mixture of experts."""
    fp8: bool = False
    """FP8 training: the transformer layers' linear layers run in FP8 (Megatron-core's ``--fp8-format
    hybrid`` through Transformer Engine); only in a bf16 or fp16 Megatron-core plan."""
    fp8_recipe: Fp8Recipe = "delayed"
    """The FP8 scaling recipe (:data:`Fp8Recipe`); read only when ``fp8``."""
    fp8_param_gather: bool = False
    """Megatron-core's ``--fp8-param-gather``: the transformer layers' weights are FP8 tensors,
    gathered at one byte a parameter; only with ``fp8`` and ZeRO 1-3."""
    cp_comm_type: CpCommType = "p2p"
    """How context parallelism exchanges the sequence's shards (:data:`CpCommType`); other than
    ``p2p`` only in a Megatron-core plan with cp > 1."""
    expert_a2a_overlap: bool = False
    """Megatron-core's ``--overlap-moe-expert-parallel-comm``: the expert all-to-alls of one
    micro-batch overlap another's compute; only in a 16-bit Megatron-core plan of a mixture of
    experts with ep > 1, the interleaved schedule when pp > 1 and no checkpointed layer."""
    experts_gathered_whole: bool = False
    """True: ZeRO-3 gathers each MoE layer's experts at once, as DeepSpeed runs a ``transformers``
    model (a plan for Hugging Face's Trainer: :attr:`dsauto.cost.strategy.Strategy.experts_gathered_whole`);
    only in a DeepSpeed plan of a mixture of experts."""
    expert_load_balanced: bool = False
    """Megatron-core's ``--moe-router-force-load-balancing``: the routers spread the tokens evenly over
    the experts (a benchmarking option, only when pinned); only in a Megatron-core plan of a mixture of
    experts."""
    expert_capacity_factor: float | None = None
    """Megatron-core's ``--moe-expert-capacity-factor``: each expert takes at most this times its mean
    share of a rank's routed tokens and drops the rest (only when pinned); None: dropless. Only in a
    Megatron-core plan of a mixture of experts."""
    expert_pad_to_capacity: bool = False
    """Megatron-core's ``--moe-pad-expert-input-to-capacity``: every expert takes exactly its capacity;
    only with ``expert_capacity_factor``, and not under DeepEP's dispatcher."""
    attention_softmax_in_fp32: bool = True
    """Megatron-core's unfused attention in 16 bits: the softmax on an fp32 copy of the scores, its fp32
    output kept (TransformerConfig's default, dsauto's plugin); False: in 16 bits (Megatron-LM's
    default launch), only in a 16-bit Megatron-core plan with unfused attention."""
    precision_aware_optimizer: MomentsDtype | None = None
    """Megatron-core's ``--use-precision-aware-optimizer`` (Transformer Engine's FusedAdam) with Adam's
    moments in this dtype, and the fp32 main weights kept as the 16 bits the bf16 weights lack; None:
    Megatron-core's own optimizer (fp32 main weights and moments). Only when pinned, in a bf16
    Megatron-core plan with the distributed optimizer (ZeRO 1) and the optimizer on the device."""
    version: int = PLAN_VERSION
    """Plan format version."""

    def __post_init__(self) -> None:
        self._check_values()
        if self.micro_batch * self.grad_accum * self.dp != self.global_batch:
            raise ValueError(
                f"micro_batch({self.micro_batch}) * grad_accum({self.grad_accum}) * dp({self.dp}) "
                f"!= global_batch({self.global_batch})"
            )
        self.dims.check_world(self.world_size)
        if len(self.stage_layers) != self.pp or sum(self.stage_layers) != self.model.num_layers:
            raise ValueError(
                f"stage_layers {list(self.stage_layers)} must have pp={self.pp} entries summing to "
                f"{self.model.num_layers} layers"
            )
        if any(n < 0 for n in self.stage_layers):
            raise ValueError(f"stage_layers {list(self.stage_layers)} must not be negative")
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {', '.join(OFFLOADS)}, got {self.offload!r}")
        least_zero = {"none": 0, "optimizer": 1, "optimizer+params": 3}[self.offload]
        if self.zero_stage < least_zero:
            raise ValueError(f"offload {self.offload!r} needs ZeRO stage {least_zero} or above, not {self.zero_stage}")
        if self.hpz < 1:
            raise ValueError(f"hpz must be at least 1, got {self.hpz}")
        if self.hpz > 1 and self.zero_stage != 3:
            raise ValueError(f"hpz {self.hpz} needs ZeRO stage 3, not {self.zero_stage}")
        if self.hpz > 1 and (self.dp % self.hpz or self.gpus_per_node % self.hpz):
            raise ValueError(f"hpz {self.hpz} must divide dp ({self.dp}) and the {self.gpus_per_node} devices of a node")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, "
                             f"got {self.attention_kernel!r}")
        if self.attention_kernel == "cudnn" and (self.engine != "megatron" or not self.flash_attention
                                                 or self.dtype == "fp32"):
            raise ValueError(f"attention_kernel cudnn needs a Megatron-core plan (not {self.engine}) with fused "
                             f"attention (flash_attention {self.flash_attention}) in bf16 or fp16 (not {self.dtype})")
        if self.tp_comm_overlap and (self.engine != "megatron" or self.tp == 1 or not self.sequence_parallel):
            raise ValueError(f"tp_comm_overlap needs a Megatron-core plan (not {self.engine}) with tp > 1 (not "
                             f"{self.tp}) and sequence parallelism (not {self.sequence_parallel})")
        if self.expert_dispatcher not in EXPERT_DISPATCHERS:
            raise ValueError(f"expert_dispatcher must be one of {', '.join(EXPERT_DISPATCHERS)}, "
                             f"got {self.expert_dispatcher!r}")
        if self.experts_gathered_whole and (self.engine != "deepspeed" or not self.model.moe):
            raise ValueError(f"experts_gathered_whole needs a DeepSpeed plan (not {self.engine}) of a mixture of "
                             f"experts")
        if self.expert_load_balanced and (self.engine != "megatron" or not self.model.moe):
            raise ValueError(f"expert_load_balanced needs a Megatron-core plan (not {self.engine}) of a mixture of "
                             f"experts ({self.model.name} has {self.model.num_experts} experts)")
        if self.expert_capacity_factor is not None and (self.engine != "megatron" or not self.model.moe
                                                        or not self.expert_capacity_factor > 0):
            raise ValueError(f"expert_capacity_factor needs a Megatron-core plan (not {self.engine}) of a mixture of "
                             f"experts ({self.model.name} has {self.model.num_experts} experts) and a factor above 0 "
                             f"(not {self.expert_capacity_factor})")
        if self.expert_pad_to_capacity and (self.expert_capacity_factor is None or self.expert_dispatcher == "deepep"):
            raise ValueError(f"expert_pad_to_capacity needs expert_capacity_factor (not {self.expert_capacity_factor}) "
                             f"and a dispatcher other than deepep (not {self.expert_dispatcher})")
        if self.expert_dispatcher == "deepep" and (self.engine != "megatron" or not self.model.moe):
            raise ValueError(f"expert_dispatcher deepep needs a Megatron-core plan (not {self.engine}) of a "
                             f"mixture of experts ({self.model.name} has {self.model.num_experts} experts)")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {', '.join(CP_COMM_TYPES)}, got {self.cp_comm_type!r}")
        if self.cp_comm_type != "p2p" and (self.engine != "megatron" or self.cp == 1):
            raise ValueError(f"cp_comm_type {self.cp_comm_type} needs a Megatron-core plan (not {self.engine}) "
                             f"with cp > 1 (not {self.cp})")
        if self.expert_a2a_overlap and (
                self.engine != "megatron" or not self.model.moe or self.dims.ep == 1 or self.dtype == "fp32"
                or (self.pp > 1 and self.virtual_stages == 1) or any(c.checkpoint for c in self.layers)):
            raise ValueError(f"expert_a2a_overlap needs a 16-bit Megatron-core plan (not {self.engine}, {self.dtype}) "
                             f"of a mixture of experts with ep > 1 (not {self.dims.ep}), the interleaved schedule "
                             f"when pp > 1 (pp {self.pp}, {self.virtual_stages} chunks) and no checkpointed layer")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {self.fp8_recipe!r}")
        if self.fp8 and (self.engine != "megatron" or self.dtype == "fp32"):
            raise ValueError(f"fp8 needs a Megatron-core plan (not {self.engine}) in bf16 or fp16 (not {self.dtype})")
        if self.fp8_param_gather and (not self.fp8 or self.zero_stage == 0):
            raise ValueError(f"fp8_param_gather needs fp8 (not {self.fp8}) and ZeRO stage 1-3 (not {self.zero_stage})")
        if not self.attention_softmax_in_fp32 and (self.engine != "megatron" or self.dtype == "fp32"):
            raise ValueError(f"attention_softmax_in_fp32 False needs a 16-bit Megatron-core plan, not {self.engine} "
                             f"in {self.dtype}")
        if not self.attention_softmax_in_fp32 and self.flash_attention:
            raise ValueError("attention_softmax_in_fp32 False applies to unfused attention only (flash_attention "
                             "False)")
        if self.precision_aware_optimizer is not None:
            if self.precision_aware_optimizer not in MOMENT_BYTES:
                raise ValueError(f"precision_aware_optimizer must be one of {', '.join(MOMENT_BYTES)} or None, got "
                                 f"{self.precision_aware_optimizer!r}")
            if self.engine != "megatron" or self.dtype != "bf16":
                raise ValueError(f"precision_aware_optimizer needs a bf16 Megatron-core plan, not {self.engine} in "
                                 f"{self.dtype}")
            if self.zero_stage != 1 or self.offload != "none":
                raise ValueError(f"precision_aware_optimizer needs ZeRO stage 1 (not {self.zero_stage}) and the "
                                 f"optimizer on the device (offload {self.offload!r})")
        if not (self.overlap_grad_reduce and self.overlap_param_gather) and (
                self.engine != "megatron" or self.zero_stage >= 2):
            raise ValueError(f"overlap_grad_reduce and overlap_param_gather False need a Megatron-core plan (not "
                             f"{self.engine}) of ZeRO stage 0-1 (not {self.zero_stage})")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError("overlap_param_gather needs overlap_grad_reduce, as Megatron-LM requires")
        if not self.grad_reduce_in_fp32 and (self.engine != "megatron" or self.dtype != "bf16"):
            raise ValueError(f"grad_reduce_in_fp32 False (bf16 gradients) needs a Megatron-core plan (not "
                             f"{self.engine}) in bf16 (not {self.dtype})")
        replicas = self.dp * self.cp
        if self.dist_opt_instances < 1 or self.dist_opt_instances > 1 and (
                self.engine != "megatron" or self.zero_stage != 1 or replicas % self.dist_opt_instances
                or self.dist_opt_instances == replicas):
            raise ValueError(f"dist_opt_instances {self.dist_opt_instances} needs a Megatron-core plan with ZeRO "
                             f"stage 1 (not {self.engine}, {self.zero_stage}) and must divide dp x cp ({replicas}) "
                             f"into instances of at least 2 ranks")
        if self.virtual_stages < 1 or (self.virtual_stages > 1 and self.pp == 1):
            raise ValueError(f"virtual_stages {self.virtual_stages} needs pp > 1, got pp={self.pp}")
        if self.chunk_layout is not None and (
                problem := chunk_layout_problem(self.stage_layers, self.virtual_stages, self.chunk_layout)):
            raise ValueError(problem)
        if self.chunk_layout is not None and self.engine != "megatron":
            raise ValueError("chunk_layout is Megatron-core's --pipeline-model-parallel-layout; the plan's engine "
                             f"is {self.engine}")
        stage_of = [0] * (self.model.num_layers + 2)
        for rank, layers in enumerate(rank_layers(self.stage_layers, self.virtual_stages, self.chunk_layout)):
            for layer in layers:
                stage_of[layer] = rank
        expected = 0
        for run in self.layers:
            if run.first != expected:
                raise ValueError(f"layer runs must cover layers in order; run starts at {run.first}, "
                                 f"expected {expected}")
            if run.last < len(stage_of) and {stage_of[run.first], stage_of[run.last]} != {run.stage}:
                raise ValueError(f"layers {run.first}..{run.last} are not all on stage {run.stage} "
                                 f"of the layout {list(self.stage_layers)}")
            if run.shard_params and self.zero_stage != 3:
                raise ValueError(f"layers {run.first}..{run.last} shard parameters, which needs ZeRO "
                                 f"stage 3, not {self.zero_stage}")
            expected = run.last + 1
        if expected != self.model.num_layers + 2:
            raise ValueError(f"layer runs cover {expected} layers, expected {self.model.num_layers + 2}")

    def _check_values(self) -> None:
        """Each value in its range, before the consistency checks combine them (a hand-edited or
        corrupted plan is refused when read, not half-applied in a training job)."""
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        for name in ("nodes", "gpus_per_node", "dp", "tp", "pp", "micro_batch", "grad_accum", "global_batch",
                     "seq_len", "memory_budget_bytes", "padded_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.seq_len > self.model.max_position_embeddings and self.model.position_embedding == "learned":
            raise ValueError(f"seq_len {self.seq_len} exceeds the model's {self.model.max_position_embeddings} "
                             f"learned positions")
        if (problem := self.model.tp_problem(self.tp)) is not None:
            raise ValueError(f"tp={self.tp} cannot split the model: {problem}")
        if self.gpus_per_node % self.tp:
            raise ValueError(f"tp={self.tp} does not divide the {self.gpus_per_node} devices of a node")
        if self.padded_vocab_size < self.model.vocab_size or self.padded_vocab_size % self.tp:
            raise ValueError(f"padded_vocab_size {self.padded_vocab_size} must be at least the vocabulary "
                             f"({self.model.vocab_size}) and divisible by tp={self.tp}")
        if min(self.reduce_bucket_bytes, self.prefetch_bucket_bytes) < 0:
            raise ValueError(f"bucket sizes must not be negative, got reduce {self.reduce_bucket_bytes} and "
                             f"prefetch {self.prefetch_bucket_bytes}")
        for run in self.layers:
            if not 0 <= run.stage < self.pp:
                raise ValueError(f"layers {run.first}..{run.last} are on stage {run.stage}, outside "
                                 f"0..{self.pp - 1}")
        negative = [f"{where}.{name}" for where, values in
                    [("prediction", self.prediction)] + [(f"stages[{s.stage}]", s) for s in self.stages]
                    for name, value in vars(values).items()
                    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0]
        if negative:
            raise ValueError(f"{', '.join(negative)} must not be negative")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dims(self) -> ParallelDims:
        """The degrees as one value (their rank order and placement rules live there)."""
        return ParallelDims(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelDims)})

    @property
    def gathers_params_overlapped(self) -> bool:
        """Megatron-core's ``overlap_param_gather`` as the plan runs it: only with the distributed
        optimizer or Megatron-FSDP (ZeRO 1-3), which own a parameter gather."""
        return self.zero_stage >= 1 and self.overlap_param_gather

    def layer_choice(self, layer: int) -> LayerChoice:
        """The choices applying to ``layer`` (flat numbering)."""
        for run in self.layers:
            if run.first <= layer <= run.last:
                return run
        raise IndexError(f"layer {layer} is outside 0..{self.model.num_layers + 1}")

    def stage_ranges(self) -> list[range]:
        """The transformer layers (flat numbering, 1..L) of each model chunk, in chunk order: the
        pipeline stages, or with virtual stages each rank's chunks (see :func:`chunk_layers`)."""
        ranges, start = [], 1
        for count in self.chunks():
            ranges.append(range(start, start + count))
            start += count
        return ranges

    def rank_layers(self) -> list[list[int]]:
        """The flat layers each pipeline rank holds (:func:`rank_layers`)."""
        return rank_layers(self.stage_layers, self.virtual_stages, self.chunk_layout)

    def chunks(self) -> list[int]:
        """Transformer layers of each model chunk, in chunk order (:func:`chunk_layers`)."""
        return chunk_layers(self.stage_layers, self.virtual_stages, self.chunk_layout)

    def checkpointed_layers(self) -> tuple[int, ...]:
        """Transformer layers (1..L) that the plan checkpoints."""
        return tuple(i for run in self.layers if run.checkpoint
                     for i in range(run.first, run.last + 1) if 1 <= i <= self.model.num_layers)

    def selective_layers(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        """Transformer layers (1..L) that recompute modules selectively, by their module set."""
        out: dict[tuple[str, ...], list[int]] = {}
        for run in self.layers:
            if run.recompute_modules:
                out.setdefault(tuple(run.recompute_modules), []).extend(
                    i for i in range(run.first, run.last + 1) if 1 <= i <= self.model.num_layers)
        return {modules: tuple(layers) for modules, layers in out.items() if layers}

    def uniform_recompute_modules(self) -> tuple[str, ...]:
        """The modules every transformer layer recomputes selectively when they all share one set
        (Megatron-core's single ``recompute_modules``), else ()."""
        sets = self.selective_layers()
        if len(sets) == 1:
            modules, layers = next(iter(sets.items()))
            if len(layers) == self.model.num_layers:
                return modules
        return ()

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "the plan") -> Plan:
        return from_dict(cls, data, where)


def deepspeed_bf16_optimizer(engine: str, zero_stage: int, pp: int, dtype: str) -> bool:
    """Whether DeepSpeed wraps the optimizer in its BF16_Optimizer: bf16 through the pipeline engine
    without ZeRO, the gradients accumulated in bf16, DeepSpeed's default ``grad_accum_dtype``
    (deepspeed/runtime/engine.py, ``_do_optimizer_sanity_check``). Outside a pipeline it wraps 16-bit
    training without ZeRO in FP16_UnfusedOptimizer (dsauto.cost.step.optimizer_step_bytes).

    BF16_Optimizer (deepspeed/runtime/bf16_optimizer.py, ``_setup_for_real_optimizer``) flattens the
    16-bit parameters, keeps fp32 main weights of this rank's 1/dp partition only (and the moments
    the wrapped optimizer makes for them), and a gradient accumulator in ``grad_accum_dtype`` for
    every parameter (``fp32_groups_gradients_flat``) into which the pipeline engine adds ``.grad``
    after each micro-batch's backward (pipe/engine.py, ``update_hp_grads``), ``.grad`` kept beside it
    until the step; at the step it casts its partition of the accumulator to fp32 for the wrapped
    optimizer, then all-gathers the updated 16-bit partitions (``update_lp_params``). Over more than one
    data-parallel replica dsauto plans such a pipeline as ZeRO-1 instead
    (dsauto.engines.rules.deepspeed_bf16_pipeline_refusal; dsauto.cost.terms prices its state)."""
    return engine == "deepspeed" and zero_stage == 0 and pp > 1 and dtype == "bf16"
