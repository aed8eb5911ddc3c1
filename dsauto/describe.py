"""The plan for people: the summary of one plan and the runner-up table.

The one rendering of a plan for people: printed by ``dsauto tune``, ``dsauto plan`` and ``dsauto
explain``, and written as the comment header of ``plan.yaml`` (:mod:`dsauto.plan_io`). Layer
numbers are spelled here too (``layers 1-3, 6``), for the emitters' and the hooks' messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dsauto.plan import LayerChoice, Plan, deepspeed_bf16_optimizer
from dsauto.spec.model import layer_groups
from dsauto.units import format_bytes, format_count, format_flops, format_seconds, counted


CP_EXCHANGES = {"p2p": "a ring of keys and values", "all_gather": "keys and values all-gathered",
                "a2a": "all-to-all over heads"}
"""How a Megatron-core plan's context parallelism exchanges the shards, in words."""


def _optimizer_text(plan: Plan) -> str:
    """The optimizer wrapper DeepSpeed runs where it holds memory a ZeRO optimizer does not."""
    if deepspeed_bf16_optimizer(plan.engine, plan.zero_stage, plan.pp, plan.dtype):
        return " with its BF16_Optimizer (a 16-bit gradient accumulator, counted with the optimizer state)"
    if plan.engine == "deepspeed" and plan.zero_stage == 0 and plan.dtype in ("bf16", "fp16"):
        return " with its FP16_UnfusedOptimizer (fp32 copies of the gradients at the update)"
    return ""


def _activations_text(plan: Plan) -> str:
    """What a DeepSpeed plan's activations are priced as, where Hugging Face's modeling code keeps
    more than fused kernels would (:func:`dsauto.spec.model.unfused_extra_widths`)."""
    model = plan.model
    kept = [part for part, present in (("fp32 RMSNorms", model.norm == "rmsnorm"),
                                       ("fp32 LayerNorms", model.layernorm_fp32),
                                       ("the gated activation's output", model.gated_mlp),
                                       (f"the {model.gelu_formula} GeLU's products", bool(model.gelu_formula)))
            if present]
    if plan.engine != "deepspeed" or not kept:
        return ""
    return f"; activations as Hugging Face's modeling code keeps them ({', '.join(kept)})"


def _layer_range(run: LayerChoice) -> str:
    return f"{run.first}" if run.first == run.last else f"{run.first}-{run.last}"


def _choice_text(plan: Plan, run: LayerChoice) -> str:
    parts = []
    if plan.zero_stage == 3 and plan.dp > 1:
        parts.append("params sharded" if run.shard_params else "params resident")
    if run.group not in ("embedding", "head"):
        parts.append("checkpointed" if run.checkpoint else
                     f"recomputes {'+'.join(run.recompute_modules)} (selective)" if run.recompute_modules
                     else "activations kept")
    if run.split > 1:
        parts.append(f"loss in {run.split} chunks" if run.group == "head" else f"split x{run.split}")
    return ", ".join(parts) or "default"


def describe_plan(plan: Plan) -> str:
    """The plan as a short report: degrees, batch, layout, per-layer choices, prediction, memory.

    The one rendering of a plan for people: printed by ``dsauto tune`` and ``dsauto explain`` and
    written as the comment header of ``plan.yaml``.
    """
    pred = plan.prediction
    sp = ", sequence parallel" if plan.sequence_parallel and plan.tp > 1 else ""
    sp += " with its collectives overlapped (--tp-comm-overlap)" if plan.tp_comm_overlap else ""
    attention = ({"flash": "flash attention", "cudnn": "cuDNN fused attention"}[plan.attention_kernel]
                 if plan.flash_attention else "eager attention")
    lines = [
        f"dsauto plan: {plan.model.name} on {plan.nodes} x {plan.gpus_per_node} {plan.hardware} "
        f"({counted(plan.world_size, 'device')}), {format_count(plan.model.num_parameters())} parameters"
        f"{_mtp_parameters_text(plan)}",
        f"  engine      {plan.engine}{_optimizer_text(plan)}{_activations_text(plan)}"
        + ("" if plan.ranking is None else f"; {_ranking_text(plan)}"),
        f"  degrees     {plan.dims.describe()}; {counted(plan.world_size, 'device')} = "
        f"dp {plan.dp} x tp {plan.tp} x pp {plan.pp}" + (f" x cp {plan.cp}" if plan.cp > 1 else "")
        + (" (DeepSpeed-Ulysses)" if plan.cp > 1 and plan.engine == "deepspeed" else "")
        + (f" ({CP_EXCHANGES[plan.cp_comm_type]})" if plan.cp > 1 and plan.engine == "megatron" else "")
        + f", ZeRO stage {plan.zero_stage}"
        + (f" with ZeRO++ secondary partitions over {plan.hpz} ranks (hpz={plan.hpz})" if plan.hpz > 1 else "")
        + _unoverlapped_text(plan) + sp,
        f"  batch       micro-batch {plan.micro_batch} x {plan.grad_accum} accumulation steps x dp "
        f"{plan.dp} = {plan.global_batch} sequences of {plan.seq_len} tokens; {plan.dtype}"
        f"{'' if plan.grad_reduce_in_fp32 else ' (gradients too)'}"
        f"{_moments_text(plan)}"
        f"{'' if plan.attention_softmax_in_fp32 else ', the unfused softmax in 16 bits'}"
        f"{f', linear layers in FP8 ({plan.fp8_recipe} scaling)' if plan.fp8 else ''}"
        f"{' with FP8 weights' if plan.fp8_param_gather else ''}, {attention}",
        f"  layout      {plan.pp} stage{'s' if plan.pp > 1 else ''}, transformer layers per stage "
        f"{_run_lengths(plan.stage_layers)}"
        + (f" (per model chunk, in Megatron's chunk order: {_run_lengths(plan.chunk_layout)})"
           if plan.chunk_layout is not None else "") + _interleaving_text(plan),
        "  layers      (0 = embedding, 1-{0} = {1} layers, {2} = head{3})".format(
            plan.model.num_layers, plan.model.architecture, plan.model.num_layers + 1, _mtp_text(plan)),
    ]
    for run in plan.layers:
        lines.append(f"    {_layer_range(run):>9}  {run.group:<10} stage {run.stage:<3} {_choice_text(plan, run)}")
    lines += [
        f"  predicted ({pred.basis})  step {format_seconds(pred.step_seconds)}, "
        f"{format_count(pred.tokens_per_second)} tokens/s, MFU {pred.mfu:.1%}{mfu_basis(plan)}, "
        f"{format_flops(pred.tflops_per_device * 1e12)} per device run (recomputation included)",
        f"              compute {format_seconds(pred.compute_seconds)}, bubble "
        f"{format_seconds(pred.bubble_seconds)}, exposed comm {format_seconds(pred.exposed_comm_seconds)}, "
        f"optimizer {format_seconds(pred.optimizer_seconds)}",
    ]
    if pred.tp_comm_seconds or pred.p2p_seconds:
        lines.append(f"              of compute, waited for: tensor-parallel collectives "
                     f"{format_seconds(pred.tp_comm_seconds)}, pipeline transfers {format_seconds(pred.p2p_seconds)}")
    if plan.offload != "none" or plan.hpz > 1:
        lines.append(_host_and_hpz_text(plan))
    if plan.dist_opt_instances > 1:
        lines.append(_dist_opt_instances_text(plan))
    if plan.model.moe:
        dims = plan.dims
        lines.append(f"  experts     {plan.model.num_experts} per MoE layer, top-{plan.model.moe_top_k}: ep {dims.ep} x "
                     f"etp {dims.etp} over the {dims.stage_ranks} ranks of a stage, expert data parallel "
                     f"{dims.expert_dp}{', routing forced to balance' if plan.expert_load_balanced else ''}"
                     f"{_capacity_text(plan)}; "
                     f"{'DeepEP dispatch' if plan.expert_dispatcher == 'deepep' else 'all-to-all'} "
                     f"{format_seconds(pred.expert_all_to_all_seconds)} per step ("
                     f"{'beside another micro-batch, overlapped' if plan.expert_a2a_overlap else 'in compute'})")
    if plan.measured is not None:
        got = plan.measured
        lines.append(
            f"  measured    step {format_seconds(got.step_seconds)} ({_relative(pred.step_seconds, got.step_seconds)} "
            f"predicted), {format_count(got.tokens_per_second)} tokens/s, peak "
            f"{format_bytes(got.peak_memory_bytes)} per rank ({_relative(pred.peak_memory_bytes, got.peak_memory_bytes)} "
            f"predicted); median of {got.steps} steps, trial {got.trial} of study {got.study}")
    lines += [
        f"  memory per rank (budget {format_bytes(plan.memory_budget_bytes)}) and time per micro-batch:",
    ]
    held = plan.rank_layers()
    # an interleaved rank holds several runs of layers (its chunks), not the span between them
    spans = [f"{st.first_layer:>3}-{st.last_layer:<4}" if plan.virtual_stages == 1 else
             layers_text(held[st.stage]).removeprefix("layers ").removeprefix("layer ").replace(", ", ",")
             for st in plan.stages]
    width = max(8, *map(len, spans))
    lines.append(f"    stage  {'layers':<{width}} {'params':>9} {'grads':>9} {'optimizer':>10} {'activations':>12} "
                 f"{'transient':>10} {'peak':>10} {'forward':>10} {'backward':>10}")
    for st, span in zip(plan.stages, spans, strict=True):
        lines.append(
            f"    {st.stage:>5}  {span:<{width}} {format_bytes(st.params_bytes):>9} "
            f"{format_bytes(st.grads_bytes):>9} {format_bytes(st.optimizer_bytes):>10} "
            f"{format_bytes(st.activation_bytes):>12} {format_bytes(st.transient_bytes):>10} "
            f"{format_bytes(st.peak_bytes):>10} {format_seconds(st.forward_seconds):>10} "
            f"{format_seconds(st.backward_seconds):>10}"
        )
    return "\n".join(lines)


def _unoverlapped_text(plan: Plan) -> str:
    """What of Megatron-core's data-parallel traffic the plan leaves exposed (``--overlap-grad-reduce``
    or ``--overlap-param-gather`` off), or ''."""
    exposed = ["gradient reduction"] if not plan.overlap_grad_reduce and plan.dp * plan.cp > 1 else []
    if not plan.overlap_param_gather and plan.zero_stage == 1 and plan.dp * plan.cp > 1:
        exposed.append("parameter gather")
    return f", its {' and '.join(exposed)} not overlapped" if exposed else ""


def _moments_text(plan: Plan) -> str:
    """The precision-aware optimizer's moments, when the plan keeps them in a lower dtype."""
    moments = plan.precision_aware_optimizer
    return f", Adam moments in {moments} (precision-aware optimizer)" if moments else ""


def _host_and_hpz_text(plan: Plan) -> str:
    """The plan's offload (what lives in host memory, and how much) and its ZeRO++ hpZ partition."""
    parts = []
    if plan.offload != "none":
        what = "optimizer state and parameter partitions" if plan.offload == "optimizer+params" else "optimizer state"
        parts.append(f"offload {plan.offload}: {what} in host memory, "
                     f"{format_bytes(plan.prediction.offloaded_bytes)} per rank, updated by the CPU")
    if plan.hpz > 1:
        parts.append(f"ZeRO++ hpZ: a secondary parameter partition over {plan.hpz} ranks of a node, "
                     f"backward gathers inside the node")
    return "  host        " + "; ".join(parts)


def _dist_opt_instances_text(plan: Plan) -> str:
    """Megatron-core's partial distributed optimizer: its instances and what stays inside one."""
    size = plan.dp * plan.cp // plan.dist_opt_instances
    return (f"  sharding    distributed optimizer in {plan.dist_opt_instances} instances of {size} ranks: "
            f"optimizer state sharded over {size} ranks, gradients reduce-scattered and parameters "
            f"gathered inside an instance, all-reduced across instances")


def _interleaving_text(plan: Plan) -> str:
    """The interleaved schedule and the bubble it saves against plain 1F1B."""
    if plan.virtual_stages == 1:
        return ""
    text = f"; interleaved 1F1B, {plan.virtual_stages} chunks per rank"
    plain = plan.prediction.plain_bubble_seconds
    if plain is not None:
        change = plain - plan.prediction.bubble_seconds
        effect = f"saves {format_seconds(change)}" if change >= 0 else f"costs {format_seconds(-change)} more"
        text += (f": bubble {format_seconds(plan.prediction.bubble_seconds)} instead of "
                 f"{format_seconds(plain)} with plain 1F1B ({effect})")
    return text


def _ranking_text(plan: Plan) -> str:
    """How the plan won: its memory headroom, and the faster near-tie it was preferred to."""
    r = plan.ranking
    assert r is not None
    if r.headroom_bytes >= r.safe_headroom_bytes:
        text = f"memory headroom {format_bytes(r.headroom_bytes)} (safe: {format_bytes(r.safe_headroom_bytes)})"
    else:
        text = (f"memory headroom {format_bytes(r.headroom_bytes)}, less than the "
                f"{format_bytes(r.safe_headroom_bytes)} counted safe: no plan within {r.tolerance:.0%} of the "
                f"fastest keeps that much, and a peak "
                f"{r.headroom_bytes / max(1, plan.prediction.peak_memory_bytes):.1%} above the prediction fills "
                f"the budget")
    if r.fastest_step_seconds < plan.prediction.step_seconds:
        text += (f"; preferred to a plan {plan.prediction.step_seconds / r.fastest_step_seconds - 1:.1%} "
                 f"faster with only {format_bytes(r.fastest_headroom_bytes)} headroom (plans within "
                 f"{r.tolerance:.0%} count as tied)")
    elif r.tied_plans > 1:
        text += f"; the fastest of {r.tied_plans} plans within {r.tolerance:.0%} of each other"
    return text


def _relative(predicted: float, measured: float) -> str:
    """How far off a prediction was, as the prediction's signed error: ``+12%`` is 12% too high."""
    return f"{(predicted - measured) / measured:+.0%}" if measured else "n/a"


def _mtp_layers(plan: Plan) -> int:
    """The multi-token-prediction layers the plan trains: Megatron-core's, beside its head."""
    return plan.model.mtp_layers if plan.engine == "megatron" else 0


def _capacity_text(plan: Plan) -> str:
    """A plan's token dropping: the experts' capacity factor, and whether they are filled to it."""
    if plan.expert_capacity_factor is None:
        return ""
    filled = ", each filled to it" if plan.expert_pad_to_capacity else ", the rest dropped"
    return f", capacity {plan.expert_capacity_factor:g}x an expert's mean tokens{filled}"


def mfu_basis(plan: Plan) -> str:
    """What an FP8 plan's MFU is a fraction of: the training dtype's peak, as for 16-bit plans (the
    FP8 GEMMs' own peak is twice it on Hopper), so that FP8 and 16-bit plans compare."""
    return f" of the {plan.dtype} peak" if plan.fp8 else ""


def _mtp_text(plan: Plan) -> str:
    """The multi-token-prediction layers the head's stage runs beside it, where the plan trains them."""
    layers = _mtp_layers(plan)
    if not layers:
        return ""
    return f" with {counted(layers, 'multi-token-prediction layer')} and {'their' if layers > 1 else 'its'} loss"


def _mtp_parameters_text(plan: Plan) -> str:
    """The parameters of the multi-token-prediction layers the plan trains beside the model."""
    layers = _mtp_layers(plan)
    if not layers:
        return ""
    head = layer_groups(plan.model, plan.seq_len, 2)[2]
    assert head.mtp_block is not None
    return f" and {format_count(layers * head.mtp_block.params)} in its multi-token prediction"


def _run_lengths(values: Sequence[int]) -> str:
    """``[1, 2, 2, 2, 1]`` as ``"1, 2 x3, 1"``."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return ", ".join(f"{v} x{n}" if n > 1 else f"{v}" for v, n in runs)


def describe_alternatives(plans: Sequence[Plan]) -> str:
    """The runner-up plans, one line each, relative to the best."""
    best = plans[0].prediction.step_seconds
    lines = ["next plans:"]
    for rank, plan in enumerate(plans[1:], 2):
        pred = plan.prediction
        lines.append(
            f"  #{rank} {plan.dims.describe()}{f' vpp={plan.virtual_stages}' if plan.virtual_stages > 1 else ''}"
            f"{f' offload={plan.offload}' if plan.offload != 'none' else ''}"
            f"{f' hpz={plan.hpz}' if plan.hpz > 1 else ''}"
            f"{f' dist_opt_instances={plan.dist_opt_instances}' if plan.dist_opt_instances > 1 else ''} "
            f"{plan.engine} zero={plan.zero_stage} "
            f"mb={plan.micro_batch} accum={plan.grad_accum} ckpt={len(plan.checkpointed_layers())}/"
            f"{plan.model.num_layers}"
            f"{''.join(' sel=' + '+'.join(m) for m in plan.selective_layers())}  step {format_seconds(pred.step_seconds)} "
            f"({pred.step_seconds / best - 1:+.1%})  peak {format_bytes(pred.peak_memory_bytes)}"
        )
    return "\n".join(lines)


def layer_span(first: int, last: int) -> str:
    """``layer 3`` or ``layers 3-5``."""
    return f"layer {first}" if first == last else f"layers {first}-{last}"


def layers_text(layers: Iterable[int]) -> str:
    """``[1, 2, 3, 6]`` as ``"layers 1-3, 6"``."""
    spans: list[list[int]] = []
    for layer in sorted(layers):
        if spans and spans[-1][1] == layer - 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return ("layer " if len(spans) == 1 and spans[0][0] == spans[0][1] else "layers ") + text


def runs_text(runs: Iterable[LayerChoice]) -> str:
    """The layers of the runs ``runs``, as :func:`layers_text` spells them."""
    return layers_text(layer for run in runs for layer in range(run.first, run.last + 1))
