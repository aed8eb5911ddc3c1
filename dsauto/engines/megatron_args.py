"""Reads a Megatron-LM launch's arguments (a ``megatron_args.txt``, or the flags of a training
script) into what dsauto plans from: the model, the batch and every choice the launch fixes, so that
``dsauto plan --megatron-args FILE`` prices that launch (and searches what it leaves open).

Flags are Megatron-LM's (megatron/training/arguments.py), with its defaults where a flag is absent:
a launch without ``--sequence-parallel`` runs without it, one without recompute flags recomputes
nothing, one without ``--use-distributed-optimizer`` keeps the optimizer whole (ZeRO 0), one without
a layout flag splits the layers evenly over the pipeline, and one without ``--hidden-dropout 0``
applies dropout. A setting dsauto would price otherwise than the launch runs it (uniform recompute
groups of several layers, activation offloading, a partial optimizer offload, ...) is refused in one
sentence; a flag that changes nothing dsauto prices (learning rate, data, logging, checkpoints) is
accepted; any other flag is named in a warning, and so is what dsauto prices its own way (the
gradient buckets, overlap flags the launch leaves out).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsauto.engines.architecture import add_bias_linear
from dsauto.engines.megatron import (
    ATTENTION_BACKEND,
    FSDP_STRATEGY,
    LAUNCH_ENVIRONMENT,
    LAUNCH_VOCABULARY,
    PLANNED_FOR,
    te_softmax_fuses,
)
from dsauto.engines.shell import ends_command, expand_shell_variables, is_assignment, split_words
from dsauto.errors import DsautoError
from dsauto.plan import ACCOUNTED_STAGES, MOMENT_BYTES, accounted_chunks, even_chunks, rank_totals
from dsauto.spec.model import VOCAB_PAD_MULTIPLE, ModelSpec, in_own_words
from dsauto.units import format_bytes

VALUED = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank", "--data-parallel-sharding-strategy", "--recompute-granularity",
    "--recompute-method", "--recompute-num-layers", "--recompute-modules", "--micro-batch-size",
    "--global-batch-size", "--seq-length", "--fp8-format", "--fp8-recipe", "--attention-backend", "--cp-comm-type",
    "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--optimizer-offload-fraction", "--num-distributed-optimizer-instances",
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
    "--kv-channels", "--max-position-embeddings", "--position-embedding-type", "--rotary-base", "--rotary-percent",
    "--normalization", "--norm-epsilon", "--vocab-size", "--make-vocab-size-divisible-by", "--hidden-dropout",
    "--attention-dropout", "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size", "--moe-layer-freq", "--moe-router-score-function",
    "--ddp-bucket-size", "--pipeline-model-parallel-layout", "--transformer-impl", "--window-size",
    "--window-attn-skip-freq", "--glu-linear-offset", "--activation-func-clamp-value", "--softmax-type",
    "--moe-router-topk-scaling-factor", "--moe-router-num-groups", "--moe-router-group-topk",
    "--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype", "--mtp-num-layers",
    "--moe-expert-capacity-factor", "--moe-router-load-balancing-type", "--rampup-batch-size",
    "--step-batch-size-schedule", "--moe-aux-loss-coeff",
}
"""Flags read here that take a value (:data:`MULTI_VALUED` several)."""

MULTI_VALUED = {"--recompute-modules", "--moe-router-load-balancing-type", "--rampup-batch-size",
                "--step-batch-size-schedule", "--moe-aux-loss-coeff"}
"""Flags of :data:`VALUED` that take several words: Megatron-LM's lists (``nargs='+'``), and a schedule
whose quoted words an unquoted array splits."""

ROUTER_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none", "sinkhorn", "quantile_balancing")
"""Megatron-LM's ``--moe-router-load-balancing-type`` choices (megatron/training/arguments.py): the first
four add a loss or nothing, the last two rebalance the router's scores, none of them work dsauto prices;
Megatron-core drops tokens only under the first four (TransformerConfig.__post_init__)."""

SWITCHES = {
    "--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp", "--use-torch-fsdp2",
    "--recompute-activations", "--bf16", "--fp16", "--fp8-param-gather", "--tp-comm-overlap",
    "--grad-reduce-in-bf16", "--overlap-moe-expert-parallel-comm", "--moe-router-force-load-balancing",
    "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    "--overlap-grad-reduce", "--overlap-param-gather", "--group-query-attention",
    "--swiglu", "--quick-geglu", "--squared-relu", "--disable-bias-linear", "--add-qkv-bias", "--untie-embeddings-and-output-weights",
    "--qk-layernorm", "--apply-layernorm-1p", "--no-bias-gelu-fusion", "--moe-shared-expert-gate",
    "--moe-router-enable-expert-bias", "--moe-grouped-gemm", "--use-rotary-position-embeddings",
    "--moe-router-pre-softmax", "--moe-layer-recompute", "--moe-enable-deepep",
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
    "--moe-pad-expert-input-to-capacity", "--bert-no-binary-head",
    "--attention-softmax-in-fp32", "--apply-query-key-layer-scaling", "--no-masked-softmax-fusion",
}
"""Flags read here that take no value."""

UNPRICED = (
    "--lr", "--min-lr", "--lr-", "--weight-decay", "--clip-grad", "--adam-", "--init-method-std", "--seed",
    "--train-iters", "--train-samples", "--eval-", "--log-", "--tensorboard-", "--wandb-", "--save", "--load",
    "--data-", "--split", "--tokenizer-", "--tiktoken-", "--no-mmap-bin-files", "--vocab-file", "--merge-file", "--mock-data", "--distributed-backend",
    "--distributed-timeout-minutes", "--no-load-", "--exit-", "--timing-log-level", "--ckpt-format",
    "--use-checkpoint-args", "--finetune", "--override-opt_param-scheduler", "--use-mcore-models",
    "--moe-z-loss-coeff",  # the router's loss term, a few values a token
    "--decoupled-lr", "--decoupled-min-lr", "--calculate-per-token-loss", "--fp8-amax-history-len",
    "--fp8-amax-compute-algo", "--profile", "--empty-unused-memory-level",  # numerics, tracing, the allocator's cache
    "--no-gradient-accumulation-fusion", "--manual-gc", "--async-save", "--mtp-loss-scaling-factor", "--no-rope-fusion",
    "--dist-ckpt-", "--no-create-attention-mask-in-dataloader", "--num-workers",
    "--no-async-tensor-model-parallel-allreduce",
    "--overlap-p2p-communication", "--cross-entropy-loss-fusion",
    "--use-rope-scaling", "--rope-scaling-factor",  # the rotary positions' numerics, the same work
    "--cross-entropy-fusion-impl", "--check-for-nan-in-loss-and-grad", "--no-check-for-nan-in-loss-and-grad",
    "--rerun-mode",
)
"""Prefixes of flags that change nothing dsauto prices (optimizer hyperparameters, data, logging,
checkpoints, fusions that keep the same tensors)."""

REFUSED = {
    "--recompute-method uniform": "uniform recomputation of more than one layer a group",
    "--no-bias-swiglu-fusion": "an unfused SwiGLU (it keeps 2 x FFN more values a token in every layer)",
    "--cpu-offloading": "activation offloading",
    "--position-embedding-type none": "a model without position embeddings",
    "--multi-latent-attention": "latent attention's widths from flags",
}
"""What a launch may say that dsauto does not price from flags, with the phrase its error uses."""


@dataclass
class MegatronLaunch:
    """A Megatron-LM launch as dsauto reads it."""

    model: ModelSpec | None
    """The model the flags describe, or None when they give no ``--num-layers``."""
    train: dict[str, Any] = field(default_factory=dict)
    """``dsauto.api.make_problem`` keywords of the batch and dtype (global_batch, seq_len, dtype,
    flash_attention)."""
    pins: dict[str, Any] = field(default_factory=dict)
    """``make_problem`` keywords of the choices the launch fixes."""
    unknown: list[str] = field(default_factory=list)
    """Flags neither read nor known to change nothing dsauto prices."""
    notes: list[str] = field(default_factory=list)
    """What dsauto prices otherwise than the launch runs, one sentence each."""
    environment: dict[str, str] = field(default_factory=dict)
    """The launch environment the file sets that dsauto reads (:data:`ENVIRONMENT`)."""
    spelled: dict[str, str] = field(default_factory=dict)
    """The flag the launch set for each choice it fixes by name (``tp``: --tensor-model-parallel-size
    ...), so that a message about it names what the file says."""
    ddp_bucket_size: int | None = None
    """``--ddp-bucket-size`` where the launch sets it: dsauto prices the buckets of its own plan, and
    says so where they differ (the command line compares it with the plan's)."""
    world: dict[str, int] = field(default_factory=dict)
    """``nodes`` and ``gpus_per_node`` as the launcher before the script starts them, where it says
    (:func:`launcher_world`), else as dsauto's own file states the cluster it was planned for
    (:func:`planned_world`)."""
    world_planned: bool = False
    """Whether :attr:`world` is the one dsauto's own file was planned for, not a launcher's."""
    hardware: str | None = None
    """The hardware dsauto's own file was planned on, as its first line names it; None for another file."""


ENVIRONMENT = ("NVTE_MASKED_SOFTMAX_FUSION",)
"""Variables of the launch environment that change what dsauto prices, read where a file sets them
(``export NAME=value``, ``NAME=value`` before the launcher, or the ``# Launch environment:`` line of
dsauto's own megatron_args.txt): Transformer Engine's masked-softmax fusion, 0 to turn it off."""


def read_megatron_args(path: Path | str, model: ModelSpec | None = None,
                       sizes: dict[str, int | None] | None = None) -> MegatronLaunch:
    """The launch in the file at ``path``: Megatron-LM flags separated by spaces or lines, ``\\``
    line continuations, ``#`` comments; other words before the first flag (a launcher and its
    script) are skipped. ``model``: the model named otherwise (``--model``), which the flags'
    model, if they describe one, must match (:func:`parse_megatron_args`). ``sizes``: the
    command line's ``nodes`` and ``gpus_per_node``, None where not given: where the launcher takes
    one from a variable the job may set (``${SLURM_NNODES:-1}``), that variable is set so, as the
    job would set it, and what the file computes from it follows (:func:`_job_for_sizes`)."""
    path, defaults, unevaluated = Path(path), {}, {}
    try:
        text = path.read_text()
    except OSError as error:
        raise DsautoError(f"cannot read the Megatron-LM arguments {path}: {error.strerror}; give a readable "
                          f"file.") from None
    try:
        job = _job_for_sizes(text, sizes or {})
        expanded = expand_shell_variables(text, defaults, unevaluated, job)
        words = split_words(expanded)
    except ValueError as error:
        raise DsautoError(f"{path} does not split into arguments ({error}); quote it as a shell would.") from None
    launch = parse_megatron_args(words, str(path), model, launch_environment(expanded), launch_vocabulary(text))
    if defaults:
        named = {(f"${name}" if name.isdigit() else name): value for name, value in defaults.items()}  # $1: an argument
        taken = ", ".join(f"{name}={shlex.quote(value)}" for name, value in named.items())
        its, them = ("their defaults", "them") if len(defaults) > 1 else ("its default", "it")
        launch.notes.append(f"{path} leaves {', '.join(named)} to the job and dsauto takes {its} ({taken}), as "
                            f"bash does where the job does not set {them}; write the values the job runs into the "
                            f"file if they differ.")
    if job:
        setting = ", ".join(f"{name}={value}" for name, value in job.items())
        launch.notes.append(f"{path}'s launcher takes its size from what the job sets, and dsauto sets {setting} for "
                            f"the command line's --nodes and --gpus-per-node, as the job would.")
    if unevaluated:
        tests = "; ".join(f"{name} under `{test}`" for name, test in unevaluated.items())
        launch.notes.append(f"{path} sets {', '.join(unevaluated)} where dsauto cannot tell from the file whether "
                            f"bash runs it ({tests}), and reads the file as if it did not; write the values the job "
                            f"runs into the file if it does.")
    if not launch.world and not _launcher_words(words) and (planned := planned_world(text)):
        launch.world, launch.world_planned = planned, True
        launch.hardware = planned_hardware(text)
    return launch


def _job_for_sizes(text: str, sizes: dict[str, int | None]) -> dict[str, str]:
    """The variables the job would set for the launcher to start the command line's ``sizes``
    (``nodes``, ``gpus_per_node``), where the launcher takes another size from a ``${NAME:-default}``
    the job may set: for each such size, the first defaulted variable that, set to the size, makes
    the launcher start it; none where the file fixes the size itself."""
    job: dict[str, str] = {}
    for key, given in sizes.items():
        if given is None:
            continue
        defaults: dict[str, str] = {}
        words = split_words(expand_shell_variables(text, defaults, job=job))
        if launcher_world(_launcher_words(words)).get(key, given) == given:
            continue
        for name in defaults:
            trial = {**job, name: str(given)}
            words = split_words(expand_shell_variables(text, job=trial))
            if launcher_world(_launcher_words(words)).get(key) == given:
                job = trial
                break
    return job


def planned_world(text: str) -> dict[str, int]:
    """``nodes`` and ``gpus_per_node`` of the cluster dsauto's own megatron_args.txt was planned for,
    as its first line states it (:data:`PLANNED_FOR`; a shebang or a note may stand above it), or
    nothing for another file: the flags' data-parallel degree is the world size over the
    model-parallel ones, so pricing them on another world would price another launch."""
    found = _planned_line(text)
    return {"nodes": int(found.group(1)), "gpus_per_node": int(found.group(2))} if found else {}


def planned_hardware(text: str) -> str | None:
    """The hardware dsauto's own megatron_args.txt was planned on, as its first line names it
    (:func:`planned_world`), or None for another file."""
    found = _planned_line(text)
    return found.group(3) if found else None


def _planned_line(text: str) -> re.Match[str] | None:
    """The first line of dsauto's own megatron_args.txt (:data:`PLANNED_FOR`) among the comments
    before the first flag, its nodes, ranks a node and hardware as groups; None for another file."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            break
        if found := re.fullmatch(rf"#\s*{re.escape(PLANNED_FOR)} .* on (\d+) x (\d+) (.+)\.", line):
            return found
    return None


def launch_environment(text: str) -> dict[str, str]:
    """The :data:`ENVIRONMENT` variables a launch file sets, the last setting of each: ``export
    NAME=value``, ``NAME=value`` before a command, quoted or not, or dsauto's own ``# Launch
    environment: NAME=value, ...`` line; other comments are skipped (a commented-out export sets
    nothing)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#") and not line.lstrip("# ").startswith(LAUNCH_ENVIRONMENT):
            continue
        for name, _, value in re.findall(r"\b([A-Z_][A-Z0-9_]*)=(['\"]?)([^\s'\",;]*)\2", line):
            if name in ENVIRONMENT:
                found[name] = value
    return found


def launch_vocabulary(text: str) -> int | None:
    """The tokenizer's vocabulary that dsauto's own megatron_args.txt states in a comment
    (:data:`LAUNCH_VOCABULARY`), or None."""
    found = re.search(rf"^\s*#\s*{re.escape(LAUNCH_VOCABULARY)}\s*(\d+)\b", text, re.MULTILINE)
    return int(found.group(1)) if found else None


def parse_megatron_args(words: Iterable[str], where: str = "the arguments", model: ModelSpec | None = None,
                        environment: dict[str, str] | None = None, vocabulary: int | None = None) -> MegatronLaunch:
    """The launch of a list of Megatron-LM arguments (see :func:`read_megatron_args`). With
    ``model``, the launch plans that model, after checking that the flags describe it (its
    vocabulary stands in for a missing ``--vocab-size``: Megatron-LM reads it from the tokenizer; so
    does ``vocabulary``, the one dsauto's own file states, without a model)."""
    words, flag_notes = list(words), []
    flags = _flag_values(words, where, flag_notes)
    undescribed = [spelling for spelling in DESCRIBED_BY_MODEL if _sets(flags, spelling)]
    for spelling, what in REFUSED.items():
        if _sets(flags, spelling) and not (model is not None and spelling in DESCRIBED_BY_MODEL):
            if spelling == "--recompute-method uniform" and flags.get("--recompute-num-layers", "1") == "1":
                continue
            if spelling in DESCRIBED_BY_MODEL:
                raise DsautoError(f"{where} sets {spelling}, and dsauto does not read {what}; name the model with "
                                  f"--model (for dsauto's own file, the --model it was planned with).")
            raise DsautoError(f"{where} sets {spelling}, and dsauto does not price {what}; remove it, or plan "
                              f"without --megatron-args.")
    architecture, notes = _architecture(words, flags, where)
    notes = flag_notes + notes
    if model is not None and model.architecture != architecture:
        raise DsautoError(f"{where} trains {'an encoder (pretrain_bert.py)' if architecture == 'encoder' else 'a decoder'}"
                          f", and --model {model.name} is {'an encoder' if model.architecture == 'encoder' else 'a decoder'}"
                          f"; plan the model the launch trains.")
    described = None
    if model is None or not undescribed:
        described = _model(flags, where, model.vocab_size if model is not None else vocabulary, architecture)
    else:
        _check_undescribed_model(flags, model, where)
    if model is not None and described is not None:
        _check_model(described, model, where, flags, _int(flags, "--seq-length", where, 0))
    if model is not None and described is not None:
        model = _launch_settings(described, model, flags, where, notes)
    if architecture == "encoder" and "--bert-no-binary-head" not in flags:
        notes.append(f"{where} trains BERT's next-sentence head (no --bert-no-binary-head), which dsauto leaves out "
                     f"of the plan (a pooler of hidden x hidden and a two-way classifier, little of the step); its "
                     f"flags add --bert-no-binary-head.")
    mtp = _int(flags, "--mtp-num-layers", where, 0, minimum=0) or 0
    if model is not None and model.mtp_layers != mtp:
        # the launch trains the multi-token-prediction layers it builds, whatever the model's config has
        notes.append(f"{where} sets {'--mtp-num-layers ' + str(mtp) if '--mtp-num-layers' in flags else 'no --mtp-num-layers'}, and --model "
                     f"{model.name} has {model.mtp_layers} multi-token-prediction layer(s): the plan trains "
                     f"{mtp}, as the launch does.")
        model = _with_mtp_layers(model, mtp, where)
    launch = MegatronLaunch(model=model or described, environment=dict(environment or {}), notes=notes,
                            world=launcher_world(_launcher_words(words)))
    if model is not None and undescribed:
        launch.notes.append(f"{where} sets {', '.join(undescribed)}, which dsauto reads from no flag, so the model is "
                            f"--model {model.name} as named, its shape not checked against the flags.")
    if unsized := launcher_unsized(_launcher_words(words)):
        launch.notes.append(f"{where}'s launcher sets {', '.join(unsized)}, which fixes no size (an elastic range, a "
                            f"shell variable or 'gpu'), so the command line's --nodes and --gpus-per-node size the "
                            f"plan (1 node and the hardware's devices where not given).")
    launch.spelled = {key: flag for key, flag in SPELLED.items() if flag in flags}
    if "--sequence-parallel" not in flags:  # dsauto's --no-sequence-parallel: the flag left out
        launch.spelled["sequence_parallel"] = "no --sequence-parallel"

    _batch(flags, launch, where)
    _parallelism(flags, launch, where)
    _softmax(flags, launch, where)
    _recompute(flags, launch, where)
    known = VALUED | SWITCHES | set(REFUSED_NAMES)
    if model is not None and undescribed:  # the named model holds what they say
        known |= {name for name in flags if name.startswith(MODEL_DESCRIPTION_PREFIXES)}
    launch.unknown = sorted(launch.unknown + [name for name in flags
                                              if name not in known and not name.startswith(UNPRICED)])
    return launch


LAUNCH_SETTINGS = {"norm_epsilon": ("--norm-epsilon", "the norms' epsilon"),
                   "norm_plus_one": ("--apply-layernorm-1p", "the norms' weights as offsets from 1"),
                   "rotary_base": ("--rotary-base", "the rotary base"),
                   "gelu_tanh": ("--no-bias-gelu-fusion", "GeLU's tanh approximation fused with its bias")}
"""Model fields a launch's flags set whatever ``--model`` says (the numerics of its norms and
positions, the GeLU's form), which the plan takes from the launch (:func:`_launch_settings`): the
flag that sets each and what it is."""


def _launch_settings(described: ModelSpec, model: ModelSpec, flags: dict[str, str], where: str,
                     notes: list[str]) -> ModelSpec:
    """``model`` (named with ``--model``) with the :data:`LAUNCH_SETTINGS` the launch's flags
    ``described`` otherwise, each said in ``notes``: the plan and the flags it writes train what the
    launch trains. The rotary base only where both have rotary positions."""
    changed = {}
    for name, (flag, what) in LAUNCH_SETTINGS.items():
        got, want = getattr(described, name), getattr(model, name)
        if got == want or (name == "rotary_base" and model.position_embedding != "rope"):
            continue
        said = "sets" if flag in flags else f"sets no {flag}, so"
        notes.append(f"{where} {said} {what} {_setting(got)}, and --model {model.name} has {_setting(want)}: the "
                     f"plan trains the launch's.")
        changed[name] = got
    return dataclasses.replace(model, **changed) if changed else model


def _setting(value: Any) -> str:
    """A launch setting as a note writes it: on / off, or the number."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


MEGATRON_SCRIPTS = {"pretrain_gpt.py": "decoder", "pretrain_bert.py": "encoder"}
"""Megatron-LM's training scripts whose models dsauto prices, and the architecture each builds."""


def _architecture(words: list[str], flags: dict[str, str], where: str) -> tuple[str, list[str]]:
    """The architecture the launch's training script builds (:data:`MEGATRON_SCRIPTS`; a bare list of
    flags, as dsauto's own file: an encoder where they set pretrain_bert.py's --bert-no-binary-head,
    else a decoder) and the notes on it: a script of another name is priced as pretrain_gpt.py's
    decoder, said in a note; Megatron-LM's other pretrain_ scripts (T5, Mamba, vision, ...) are
    refused."""
    index = _script_index(words)
    if index is None:
        return ("encoder" if "--bert-no-binary-head" in flags else "decoder"), []
    script = Path(words[index]).name
    if script in MEGATRON_SCRIPTS:
        return MEGATRON_SCRIPTS[script], []
    if script.startswith("pretrain_"):
        raise DsautoError(f"{where} runs {script}; dsauto prices the models of Megatron-LM's "
                          f"{' and '.join(MEGATRON_SCRIPTS)}.")
    return "decoder", [f"{where} runs {script}, not Megatron-LM's {' or '.join(MEGATRON_SCRIPTS)}, and dsauto "
                       f"prices its model as pretrain_gpt.py builds one from these flags (a causal decoder)."]


def _with_mtp_layers(model: ModelSpec, mtp: int, where: str) -> ModelSpec:
    """``model`` training the ``mtp`` multi-token-prediction layers a launch's ``--mtp-num-layers`` builds."""
    try:
        return dataclasses.replace(model, mtp_layers=mtp)
    except ValueError as error:
        raise DsautoError(f"{where} sets --mtp-num-layers {mtp}, which --model {model.name} cannot train: "
                          f"{in_own_words(str(error), MODEL_FLAGS)}; correct the flag.") from None


MAX_LAYOUT_CHARACTERS = 1_000_000
"""The most characters an expanded layout string may have (a real one has a few hundred)."""


def expand_layout(text: str, where: str) -> str:
    """``text``, a Megatron-core layout string, with its repeats unrolled and its commas dropped, as
    Megatron-core reads it: each ``(group)*N`` once, then each ``x*N``; refused where it holds other
    characters than E, t, m, L and |, or unrolls past :data:`MAX_LAYOUT_CHARACTERS` (checked before
    each repeat is made and after each pass)."""
    too_long = DsautoError(f"{where} sets --pipeline-model-parallel-layout {text}, which repeats past "
                           f"{MAX_LAYOUT_CHARACTERS:,} characters; give the layout the launch runs.")

    def unroll(found: re.Match[str]) -> str:
        if len(found.group(1)) * int(found.group(2)) > MAX_LAYOUT_CHARACTERS:
            raise too_long
        return found.group(1) * int(found.group(2))

    expanded = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):  # one pass each: a nested group stays, refused below
        expanded = re.sub(pattern, unroll, expanded)
        if len(expanded) > MAX_LAYOUT_CHARACTERS:
            raise too_long
    if set(expanded) - set("EtmL|"):
        raise DsautoError(f"{where} sets --pipeline-model-parallel-layout {text}, which dsauto does not read: it "
                          f"knows E, t, m, L, |, x*N and (...)*N; give --stage-layers instead.")
    return expanded


REFUSED_NAMES = {spelling.split(" ")[0] for spelling in REFUSED}

DESCRIBED_BY_MODEL = ("--multi-latent-attention", "--position-embedding-type yarn")
"""Flags of a model dsauto cannot build from flags alone (latent attention's widths, YaRN's scaling),
which a model named with ``--model`` describes instead: its launch, dsauto's own megatron_args.txt
among them, then reads with that model."""


MODEL_DESCRIPTION_PREFIXES = ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                              "--v-head-dim", "--rotary-scaling-factor", "--mscale", "--yarn-", "--window-",
                              "--rope-type")
"""Flags of latent attention's widths and of YaRN's scaling (:data:`DESCRIBED_BY_MODEL`), known where
the model named with ``--model`` describes them."""


def _check_undescribed_model(flags: dict[str, str], model: ModelSpec, where: str) -> None:
    """Refuses a launch of latent attention or YaRN (:data:`DESCRIBED_BY_MODEL`) whose named model has
    neither, or whose shape flags say another model than the named one."""
    for spelling, has, what in (("--multi-latent-attention", model.latent_attention, "latent attention"),
                                ("--position-embedding-type yarn", model.rope_scaling == "yarn", "YaRN rope scaling")):
        if _sets(flags, spelling) and not has:
            raise DsautoError(f"{where} sets {spelling}, and --model {model.name} has no {what}; plan the model the "
                              f"launch trains.")
    for flag, name in (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
                       ("--num-attention-heads", "num_attention_heads"), ("--vocab-size", "vocab_size")):
        if flag in flags and _int(flags, flag, where) != getattr(model, name):
            raise DsautoError(f"{where} describes a model with {name} {flags[flag]}, and --model {model.name} has "
                              f"{getattr(model, name)}; plan the model the launch trains.")
    if "--num-layers" in flags:  # the flags describe the layers: their MLP, biases and softmax too
        _check_layers(flags, model, where)


def _check_layers(flags: dict[str, str], model: ModelSpec, where: str) -> None:
    """Refuses flags whose layers are not ``model``'s in what the shapes do not say: the MLP's
    activation (gpt-oss's clamped gate included), the linear layers' biases (Megatron's
    ``add_bias_linear``, which gpt-oss's pattern is too) and the learned sinks of its softmax."""
    mlp, clamp = _mlp(flags, where)
    if (mlp, clamp) != (model.mlp, model.glu_clamp):
        said, named = (f"{kind} MLP{f' clamped at {c:g}' if c else ''}" for kind, c in ((mlp, clamp),
                                                                                       (model.mlp, model.glu_clamp)))
        raise DsautoError(f"{where} describes a {said}, and --model {model.name} has a {named}; plan the model the "
                          f"launch trains.")
    biased = "--disable-bias-linear" not in flags
    if biased != add_bias_linear(model):
        has = ("them on only some" if any(model.biases) else "none") if biased else "them"
        raise DsautoError(f"{where} describes a model {'with' if biased else 'without'} biases on its linear "
                          f"layers, and --model {model.name} has {has}; plan the model the launch trains.")
    sinks = flags.get("--softmax-type", "vanilla") == "learnable"
    if sinks != model.attention_sinks:
        has = "has no" if sinks else "has"
        raise DsautoError(f"{where} {'sets' if sinks else 'does not set'} --softmax-type learnable, and --model "
                          f"{model.name} {has} learned attention sinks; plan the model the launch trains.")


def _sets(flags: dict[str, str], spelling: str) -> bool:
    """Whether ``flags`` set ``spelling``: a flag, or a flag and its value (``--name value``)."""
    name, _, value = spelling.partition(" ")
    return name in flags and (not value or flags[name] == value)


SPELLED = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
           "cp": "--context-parallel-size", "ep": "--expert-model-parallel-size",
           "etp": "--expert-tensor-parallel-size", "vpp": "--num-virtual-stages-per-pipeline-rank",
           "micro_batch": "--micro-batch-size", "global_batch": "--global-batch-size", "seq_len": "--seq-length"}
"""The flag of each choice a launch names outright (MegatronLaunch.spelled), by pin or train key."""


LAUNCHER_WORLD = {"--nnodes": "nodes", "--num_nodes": "nodes", "--num-nodes": "nodes",
                  "--nproc_per_node": "gpus_per_node", "--nproc-per-node": "gpus_per_node",
                  "--num_gpus": "gpus_per_node", "--num-gpus": "gpus_per_node"}
"""The launcher options that size the run: torchrun's (``--nnodes``, ``--nproc-per-node``) and the
deepspeed launcher's (``--num_nodes``, ``--num_gpus``)."""


def _script_index(words: list[str]) -> int | None:
    """Where the training script stands, or None: the first word ending in ``.py`` that a flag
    follows, else the first ending so; an assignment (``SCRIPT=pretrain_gpt.py``) is none."""
    scripts = [i for i, word in enumerate(words) if word.endswith(".py") and not is_assignment(word)]
    return next((i for i in scripts if i + 1 < len(words) and words[i + 1].startswith("--")),
                scripts[0] if scripts else None)


def _launcher_words(words: list[str]) -> list[str]:
    """The words before the training script: the launcher's."""
    script = _script_index(words)
    return words[:script] if script is not None else []


def launcher_world(words: Sequence[str]) -> dict[str, int]:
    """``nodes`` and ``gpus_per_node`` as the launcher ``words`` set them (:data:`LAUNCHER_WORLD`);
    a shell variable (``$NNODES``), an elastic range (``--nnodes 1:4``) or ``--nproc-per-node gpu``
    fixes nothing (:func:`launcher_unsized`): the command line's --nodes and --gpus-per-node size the
    plan then."""
    return {LAUNCHER_WORLD[name]: int(value.partition(":")[0]) for name, value in _launcher_sizes(words)
            if _fixed_size(value)}


def launcher_unsized(words: Sequence[str]) -> list[str]:
    """The launcher's size options that fix no size, as written (``--nnodes 2:4``)."""
    return [f"{name} {value}" for name, value in _launcher_sizes(words) if not _fixed_size(value)]


def _launcher_sizes(words: Sequence[str]) -> list[tuple[str, str]]:
    """The launcher's size options (:data:`LAUNCHER_WORLD`) and their values, as written."""
    sizes = []
    for i, word in enumerate(words):
        name, equals, value = word.partition("=")
        if name in LAUNCHER_WORLD:
            sizes.append((name, value if equals else words[i + 1] if i + 1 < len(words) else ""))
    return sizes


def _fixed_size(value: str) -> bool:
    """Whether a launcher size says one whole number (``2``, or the range ``2:2``)."""
    low, _, high = value.partition(":")
    return low.isdigit() and int(low) >= 1 and (not high or high == low)


def _flag_values(words: list[str], where: str, notes: list[str] | None = None) -> dict[str, str]:
    """{flag: its value ('' for a switch; several words joined by spaces)}. The words up to the
    training script (the first ending in ``.py``), or to the first flag without one, are the
    launcher's and are skipped. A flag read here takes the values it takes; any other takes every
    word up to the next flag (Megatron-LM's lists, such as ``--data-path``). A flag given twice keeps
    its last value, as argparse does; one read here with two values is said in ``notes``, and so
    are the job's words the launch passes on (``$EXTRA_ARGS``)."""
    notes = [] if notes is None else notes
    script = _script_index(words)
    i = script + 1 if script is not None else next((i for i, word in enumerate(words) if word.startswith("--")),
                                                   len(words))
    flags: dict[str, str] = {}
    passed = []  # the job's own words, which the file passes on unread
    while i < len(words) and not ends_command(words[i]):
        word = words[i]
        if _JOB_WORDS.fullmatch(word):
            passed.append(word)
            i += 1
            continue
        if not word.startswith("--"):
            raise DsautoError(f"{where} has the word {word!r} where a flag should start; remove it or give it a flag.")
        name, equals, value = word.partition("=")
        i += 1
        if not equals and name not in SWITCHES:
            values = []
            while i < len(words) and not words[i].startswith("--") and not ends_command(words[i]):
                if _JOB_WORDS.fullmatch(words[i]) and (name not in VALUED or values):  # not a flag's own value
                    passed.append(words[i])
                else:
                    values.append(words[i])
                i += 1
                if name in VALUED and name not in MULTI_VALUED:
                    break
            value = " ".join(values)
        if name in VALUED and not value:
            raise DsautoError(f"{where} gives {name} no value; give it one.")
        if name in flags and flags[name] != value and name in VALUED | SWITCHES:
            notes.append(f"{where} sets {name} twice ({flags[name]!r}, then {value!r}); Megatron-LM takes the "
                         f"last, and so does dsauto.")
        flags[name] = value  # argparse keeps the last
    if passed:
        notes.append(f"{where} passes on {', '.join(passed)} from the job, which dsauto does not see; the plan is "
                     f"priced without the flags they add.")
    return flags


_JOB_WORDS = re.compile(r"\$(?:\{?[A-Za-z_]\w*\}?|[@*]|\{[@*]\}|\{@:\d+\})")
"""A word that is a bare reference to what the job sets (``$EXTRA_ARGS``, ``$@``), which a launch
passes on to the training script."""


def _int(flags: dict[str, str], name: str, where: str, default: int | None = None, minimum: int = 1) -> int | None:
    """``name``'s whole-number value (at least ``minimum``), or ``default`` when the flag is absent."""
    if name not in flags:
        return default
    try:
        value = int(flags[name])
    except ValueError:
        raise DsautoError(f"{where} gives {name} {flags[name]!r}, not a whole number; give one.") from None
    if value < minimum:
        raise DsautoError(f"{where} gives {name} {value}; give a number of at least {minimum}.")
    return value


def _choice(flags: dict[str, str], name: str, where: str, default: str, choices: Iterable[str]) -> str:
    """``name``'s value (``default`` when absent), refused unless it is one of ``choices``."""
    value, allowed = flags.get(name, default), list(choices)
    if value not in allowed:
        priced = allowed[0] if len(allowed) == 1 else f"{', '.join(allowed[:-1])} and {allowed[-1]}"
        hint = " (name the model with --model where the flag describes it)" if name in MODEL_CHOICE_FLAGS else ""
        raise DsautoError(f"{where} sets {name} {value}; dsauto prices {priced}{hint}.")
    return value


MODEL_CHOICE_FLAGS = {"--position-embedding-type", "--normalization", "--moe-router-score-function"}
"""The choices of :func:`_choice` that describe the model, which a model named with ``--model`` may
say what dsauto reads from no flag."""


def _number(text: str) -> float | None:
    """``text`` as a number, or None where it is none."""
    try:
        return float(text)
    except ValueError:
        return None


def _float(flags: dict[str, str], name: str, where: str, default: float) -> float:
    if name not in flags:
        return default
    try:
        return float(flags[name])
    except ValueError:
        raise DsautoError(f"{where} gives {name} {flags[name]!r}, not a number; give one.") from None


def _window(flags: dict[str, str], where: str) -> int:
    """The sliding window of ``--window-size`` (Megatron's ``left,right`` keys beside the query's own
    token, parentheses allowed as its tuple_type takes them) in Hugging Face's count, the query
    included; 0 without one (no flag, or ``-1,0``: plain causal attention)."""
    if "--window-size" not in flags:
        return 0
    left, _, right = flags["--window-size"].strip("() ").partition(",")
    left, right = left.strip(), right.strip()
    if right == "0" and left == "-1":
        return 0
    if not (left.isdigit() and right == "0"):
        raise DsautoError(f"{where} gives --window-size {flags['--window-size']}; dsauto plans causal windows "
                          f"'N,0' (N keys to the left) or none ('-1,0').")
    return int(left) + 1


def _mlp(flags: dict[str, str], where: str) -> tuple[str, float]:
    """The MLP's activation the flags build (ModelSpec.mlp) and gpt-oss's clamp (ModelSpec.glu_clamp).
    --quick-geglu gates with x * sigmoid(1.702 x), GeGLU's shapes and cost; with --glu-linear-offset
    (the linear half + 1) and --activation-func-clamp-value it is gpt-oss's clamped gate, as Megatron-LM
    launches gpt-oss. Megatron-core's TransformerConfig takes an offset only with quick_gelu under its
    fused activation, and dsauto prices no other clamp (a clamped SwiGLU's is numerics, not cost, but
    dsauto names what it does not read)."""
    if "--glu-linear-offset" in flags and "--quick-geglu" not in flags:
        raise DsautoError(f"{where} sets --glu-linear-offset without --quick-geglu, which Megatron-core's "
                          f"TransformerConfig takes only with quick_gelu (gpt-oss's gate); add --quick-geglu or "
                          f"drop it.")
    if "--activation-func-clamp-value" in flags and "--glu-linear-offset" not in flags:
        raise DsautoError(f"{where} sets --activation-func-clamp-value without --quick-geglu --glu-linear-offset 1 "
                          f"(gpt-oss's clamped gate, the one clamp dsauto reads); drop it to plan the same cost "
                          f"unclamped.")
    if "--swiglu" in flags:
        return "swiglu", 0.0
    if "--quick-geglu" in flags:
        if "--glu-linear-offset" in flags:
            return "swiglu", _float(flags, "--activation-func-clamp-value", where, 0.0)
        return "geglu", 0.0
    return ("relu2" if "--squared-relu" in flags else "gelu"), 0.0


def _model(flags: dict[str, str], where: str, vocabulary: int | None, architecture: str = "decoder"
           ) -> ModelSpec | None:
    """The model of the flags, with Megatron-LM's defaults (GPT: GeLU, LayerNorm, learned positions,
    tied embeddings, biases, dropout 0.1; BERT, ``architecture`` encoder, the same pre-norm layers
    and a token-type embedding of 2 rows beside its next-sentence head, none without it:
    pretrain_bert.py's num_tokentypes); None without ``--num-layers``."""
    if "--num-layers" not in flags:
        return None
    missing = [name for name in ("--hidden-size", "--num-attention-heads", "--seq-length") if name not in flags]
    if missing:
        raise DsautoError(f"{where} gives --num-layers but not {', '.join(missing)}; give the whole model, or "
                          f"name it with --model.")
    if "--vocab-size" not in flags and vocabulary is None:
        raise DsautoError(f"{where} describes the model but not its vocabulary (it comes from the tokenizer); "
                          f"add --vocab-size N, or name the model with --model.")
    hidden, heads = _int(flags, "--hidden-size", where), _int(flags, "--num-attention-heads", where)
    assert hidden is not None and heads is not None
    # --use-rotary-position-embeddings, Megatron-LM's older spelling, still sets rope (validate_args).
    rotary = "--use-rotary-position-embeddings" in flags
    positions = {"learned_absolute": "learned", "rope": "rope"}
    position = _choice(flags, "--position-embedding-type", where, "rope" if rotary else "learned_absolute", positions)
    normalization = _choice(flags, "--normalization", where, "LayerNorm", ("LayerNorm", "RMSNorm"))
    biases = "--disable-bias-linear" not in flags
    mlp, clamp = _mlp(flags, where)
    dropout = (_float(flags, "--hidden-dropout", where, 0.1) > 0, _float(flags, "--attention-dropout", where, 0.1) > 0)
    if dropout[0] != dropout[1]:
        raise DsautoError(f"{where} applies dropout to {'the hidden states' if dropout[0] else 'attention'} only; "
                          f"dsauto prices dropout in both or neither: set --hidden-dropout and --attention-dropout "
                          f"alike.")
    seq = _int(flags, "--seq-length", where)
    positions_given = _int(flags, "--max-position-embeddings", where, seq)
    if seq is not None and positions_given is not None and positions_given < seq:
        raise DsautoError(f"{where} gives --max-position-embeddings {positions_given} below --seq-length {seq}, which "
                          f"Megatron-LM's validate_args refuses; give --max-position-embeddings {seq} or more.")
    # validate_args: without --ffn-hidden-size, 4 x hidden, or for SwiGLU 2/3 of it rounded down to a
    # multiple of 64.
    ffn_default = int(4 * hidden * 2 / 3 / 64) * 64 if mlp == "swiglu" else 4 * hidden
    fields: dict[str, Any] = dict(
        name="megatron-args", architecture=architecture, num_layers=_int(flags, "--num-layers", where),
        hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=_int(flags, "--ffn-hidden-size", where, ffn_default),
        vocab_size=_int(flags, "--vocab-size", where, vocabulary),
        max_position_embeddings=positions_given,
        num_kv_heads=_int(flags, "--num-query-groups", where, 1) if "--group-query-attention" in flags else heads,
        attention_head_dim=_int(flags, "--kv-channels", where, 0),
        mlp=mlp, norm="rmsnorm" if normalization == "RMSNorm" else "layernorm",
        norm_epsilon=_float(flags, "--norm-epsilon", where, 1e-5), norm_plus_one="--apply-layernorm-1p" in flags,
        position_embedding=positions[position], tied_embeddings="--untie-embeddings-and-output-weights" not in flags,
        linear_bias=biases, qkv_bias="--add-qkv-bias" in flags, qk_norm="--qk-layernorm" in flags,
        glu_clamp=clamp, mtp_layers=_int(flags, "--mtp-num-layers", where, 0, minimum=0),
        # a learned logit per head in each softmax (gpt-oss's sinks); off-by-one's fixed one is not priced
        attention_sinks=_choice(flags, "--softmax-type", where, "vanilla", ("vanilla", "learnable")) == "learnable",
        dropout=dropout[0],
        # Megatron fuses bias and GeLU (the tanh approximation) when the layers have biases.
        gelu_tanh=mlp == "gelu" and biases and "--no-bias-gelu-fusion" not in flags,
    )
    if architecture == "encoder":
        fields.update(type_vocab_size=0 if "--bert-no-binary-head" in flags else 2)
    if position == "rope":
        fields.update(rotary_base=_float(flags, "--rotary-base", where, 10000.0),
                      rotary_percent=_float(flags, "--rotary-percent", where, 1.0))
    if window := _window(flags, where):
        fields.update(sliding_window=window, global_attention_every=_int(flags, "--window-attn-skip-freq", where, 0))
    if "--num-experts" in flags:
        freq = flags.get("--moe-layer-freq", "1")
        if not freq.isdigit():
            raise DsautoError(f"{where} sets --moe-layer-freq {freq}; dsauto reads an interval (every N-th layer), "
                              f"not a pattern: name the model with --model.")
        router = _choice(flags, "--moe-router-score-function", where, "softmax", ("softmax", "sigmoid"))
        fields.update(num_experts=_int(flags, "--num-experts", where),
                      moe_top_k=_int(flags, "--moe-router-topk", where, 2),
                      moe_ffn_hidden_size=_int(flags, "--moe-ffn-hidden-size", where, fields["ffn_hidden_size"]),
                      shared_expert_ffn_hidden_size=_int(flags, "--moe-shared-expert-intermediate-size", where, 0),
                      shared_expert_gate="--moe-shared-expert-gate" in flags, moe_layer_freq=int(freq),
                      moe_router=router, moe_router_balancing_bias="--moe-router-enable-expert-bias" in flags,
                      moe_router_pre_softmax="--moe-router-pre-softmax" in flags,
                      moe_router_topk_scaling=_float(flags, "--moe-router-topk-scaling-factor", where, 0.0),
                      moe_router_groups=_int(flags, "--moe-router-num-groups", where, 0),
                      moe_router_group_topk=_int(flags, "--moe-router-group-topk", where, 0),
                      # add_bias_linear biases the router and every expert too (moe/router.py, TopKRouter)
                      moe_router_bias=biases, moe_expert_bias=biases)
    try:
        return ModelSpec(**fields)
    except (TypeError, ValueError, DsautoError) as error:
        text = in_own_words(str(error), MODEL_FLAGS).rstrip(".")
        remedy = "" if "; give " in text else "; correct the flag"
        raise DsautoError(f"{where} does not describe a model dsauto can plan: {text}{remedy}.") from None


MODEL_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "num_kv_heads": "--num-query-groups", "attention_head_dim": "--kv-channels", "ffn_hidden_size": "--ffn-hidden-size",
    "vocab_size": "--vocab-size", "max_position_embeddings": "--max-position-embeddings",
    "num_experts": "--num-experts", "moe_top_k": "--moe-router-topk", "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "glu_clamp": "--activation-func-clamp-value", "mtp_layers": "--mtp-num-layers",
}
"""The Megatron-LM flag of each ModelSpec field a launch gives, for errors in the launch's words."""


def _batch(flags: dict[str, str], launch: MegatronLaunch, where: str) -> None:
    train, pins = launch.train, launch.pins
    if "--step-batch-size-schedule" in flags:
        # Megatron-LM refuses it beside --global-batch-size (validate_args)
        raise DsautoError(f"{where} sets --step-batch-size-schedule, whose batch changes as training goes, "
                          f"{'beside --global-batch-size, which Megatron-LM refuses; ' if '--global-batch-size' in flags else 'and '}"
                          f"dsauto prices a step of one batch: give that batch's --global-batch-size instead.")
    if "--rampup-batch-size" in flags:
        launch.notes.append(f"{where} ramps its batch up (--rampup-batch-size), and dsauto prices the steps of the "
                            f"batch it reaches, --global-batch-size.")
    if "--global-batch-size" not in flags:
        # Megatron-LM's default is one micro-batch per data-parallel rank, a number of the plan.
        raise DsautoError(f"{where} does not set --global-batch-size; give it, so that the plan trains the "
                          f"launch's batch.")
    train["global_batch"] = _int(flags, "--global-batch-size", where)
    if "--seq-length" in flags:
        train["seq_len"] = _int(flags, "--seq-length", where)
    if "--micro-batch-size" in flags:
        pins["micro_batch"] = _int(flags, "--micro-batch-size", where)
    if "--bf16" in flags and "--fp16" in flags:
        raise DsautoError(f"{where} sets both --bf16 and --fp16; keep one.")
    train["dtype"] = "bf16" if "--bf16" in flags else "fp16" if "--fp16" in flags else "fp32"
    kernels = {**{name: kernel for kernel, name in ATTENTION_BACKEND.items()}, "auto": None, "local": None,
               "unfused": None}
    backend = _choice(flags, "--attention-backend", where, "auto", kernels)
    impl = _choice(flags, "--transformer-impl", where, "transformer_engine", ("transformer_engine", "local"))
    if backend in ("local", "unfused") or impl == "local":
        train["flash_attention"] = False  # Megatron-core's own attention keeps the s x s scores
    elif kernels[backend]:
        pins["attention_kernel"] = kernels[backend]
    if "--fp8-format" in flags:
        if _choice(flags, "--fp8-format", where, "hybrid", ("hybrid", "e4m3")) == "e4m3":
            launch.notes.append(f"{where} trains FP8 in E4M3 alone (--fp8-format e4m3), and dsauto prices it as "
                                f"hybrid (E5M2 gradients), the same GEMMs and casts; its flags write --fp8-format "
                                f"hybrid.")
        pins["fp8"] = True
        pins["fp8_recipe"] = _choice(flags, "--fp8-recipe", where, "delayed", ("delayed", "tensorwise"))
        pins["fp8_param_gather"] = "--fp8-param-gather" in flags
    else:
        pins["fp8"] = False


def _parallelism(flags: dict[str, str], launch: MegatronLaunch, where: str) -> None:
    pins = launch.pins
    for key in ("tp", "pp", "cp"):
        pins[key] = _int(flags, SPELLED[key], where, 1)
    experts = "--num-experts" in flags or (launch.model is not None and launch.model.moe)
    if experts:
        # Megatron-LM's defaults: ep 1, and etp = tp (validate_args sets expert_tensor_parallel_size).
        pins["ep"] = _int(flags, "--expert-model-parallel-size", where, 1)
        pins["etp"] = _int(flags, "--expert-tensor-parallel-size", where, pins["tp"])
    elif any(name in flags for name in ("--expert-model-parallel-size", "--expert-tensor-parallel-size")):
        raise DsautoError(f"{where} sets expert parallelism for a model without experts; name the mixture of experts "
                          f"with --model, or give --num-experts.")
    pins["sequence_parallel"] = "--sequence-parallel" in flags
    pins["engine"] = "megatron"
    if "--use-torch-fsdp2" in flags:
        raise DsautoError(f"{where} sets --use-torch-fsdp2; dsauto prices Megatron-FSDP, whose sharding is the "
                          f"same: use --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params.")
    if "--use-megatron-fsdp" in flags:
        # Megatron-LM's default strategy changed between versions (no_shard, then optim_grads_params).
        stages = {"no_shard": 0, "optim": 1, **{name: stage for stage, name in FSDP_STRATEGY.items()}}
        strategy = flags.get("--data-parallel-sharding-strategy")
        if strategy not in stages:
            raise DsautoError(f"{where} sets --use-megatron-fsdp with --data-parallel-sharding-strategy "
                              f"{strategy or 'not given (its default depends on the version)'}; give one of "
                              f"{', '.join(stages)}.")
        pins["zero_stage"] = stages[strategy]
    else:
        pins["zero_stage"] = 1 if "--use-distributed-optimizer" in flags else 0
    if pins["zero_stage"] == 1:
        pins["dist_opt_instances"] = _int(flags, "--num-distributed-optimizer-instances", where, 1)
    if "--optimizer-cpu-offload" in flags:
        if _float(flags, "--optimizer-offload-fraction", where, 1.0) != 1.0:
            raise DsautoError(f"{where} offloads part of the optimizer (--optimizer-offload-fraction "
                              f"{flags['--optimizer-offload-fraction']}); dsauto prices all of it or none.")
        pins["offload"] = "optimizer"
    else:
        pins["offload"] = "none"
    pins["tp_comm_overlap"] = "--tp-comm-overlap" in flags
    pins["grad_reduce_in_fp32"] = "--grad-reduce-in-bf16" not in flags
    _optimizer_precision(flags, launch, where)
    if pins["cp"] > 1:
        # Megatron-LM's default, the ring; one exchange for every layer
        pins["cp_comm_type"] = _choice(flags, "--cp-comm-type", where, "p2p", ("p2p", "all_gather", "a2a"))
    pins["expert_a2a_overlap"] = "--overlap-moe-expert-parallel-comm" in flags
    if "--moe-router-force-load-balancing" in flags:
        pins["expert_load_balanced"] = True
    # Megatron-core reads a negative capacity factor as none, and refuses padding without one
    # (TransformerConfig.__post_init__); a dense model's launch ignores both.
    factor = _float(flags, "--moe-expert-capacity-factor", where, -1.0)
    padded = "--moe-pad-expert-input-to-capacity" in flags
    if experts and factor == 0:
        raise DsautoError(f"{where} gives --moe-expert-capacity-factor 0, which drops every token; give a factor "
                          f"above 0, or leave it out for dropless routing.")
    if experts and padded and factor < 0:
        raise DsautoError(f"{where} sets --moe-pad-expert-input-to-capacity without a positive "
                          f"--moe-expert-capacity-factor, which Megatron-core refuses; add a factor, or drop the flag.")
    balancing = flags.get("--moe-router-load-balancing-type", "aux_loss").split()
    if odd := [kind for kind in balancing if kind not in ROUTER_BALANCING]:  # Megatron-LM's argparse choices
        raise DsautoError(f"{where} sets --moe-router-load-balancing-type {' '.join(odd)}, which is none of "
                          f"Megatron-LM's {', '.join(ROUTER_BALANCING)}; give one of them.")
    coefficients = flags.get("--moe-aux-loss-coeff", "0").split()
    if experts and len(balancing) > 1 and len(coefficients) != len(balancing):
        raise DsautoError(f"{where} gives {len(balancing)} --moe-router-load-balancing-type values and "
                          f"{len(coefficients)} --moe-aux-loss-coeff, which Megatron-core refuses (one coefficient "
                          f"a type); give as many of each.")
    if experts and "sinkhorn" in balancing and any(_number(value) != 0 for value in coefficients):
        raise DsautoError(f"{where} balances the router with sinkhorn and a nonzero --moe-aux-loss-coeff "
                          f"{' '.join(coefficients)}, which Megatron-core's router refuses; set the coefficient to 0 "
                          f"or balance with aux_loss.")
    if experts and factor > 0 and (rebalanced := [kind for kind in balancing if kind in ROUTER_BALANCING[4:]]):
        raise DsautoError(f"{where} sets --moe-expert-capacity-factor with --moe-router-load-balancing-type "
                          f"{rebalanced[0]}, which Megatron-core refuses (it drops tokens only under "
                          f"{', '.join(ROUTER_BALANCING[:4])}); drop one of them.")
    if experts:
        pins["expert_capacity_factor"] = factor if factor > 0 else None
        pins["expert_pad_to_capacity"] = padded
    dispatcher = flags.get("--moe-token-dispatcher-type", "allgather" if experts else "alltoall")
    if "--moe-enable-deepep" in flags and (dispatcher != "flex" or flags.get("--moe-flex-dispatcher-backend",
                                                                             "deepep") != "deepep"):
        # Megatron-core 0.12-0.16's older spelling of the flex dispatcher's deepep backend
        # (transformer_config.py refuses it beside another dispatcher or backend)
        given = (f"--moe-token-dispatcher-type {dispatcher}" if dispatcher != "flex" else
                 f"--moe-flex-dispatcher-backend {flags['--moe-flex-dispatcher-backend']}")
        raise DsautoError(f"{where} sets --moe-enable-deepep with {given}; Megatron-core runs DeepEP only with the "
                          f"flex dispatcher's deepep backend: set --moe-token-dispatcher-type flex without another "
                          f"backend, or drop --moe-enable-deepep.")
    if dispatcher == "flex" and flags.get("--moe-flex-dispatcher-backend", "deepep") == "deepep":
        pins["expert_dispatcher"] = "deepep"
    elif dispatcher != "alltoall":
        used = (f"the flex dispatcher's {flags['--moe-flex-dispatcher-backend']} backend "
                f"(--moe-flex-dispatcher-backend)" if dispatcher == "flex" else dispatcher)
        raise DsautoError(f"{where} dispatches the experts' tokens with {used}; dsauto prices alltoall "
                          f"(--moe-token-dispatcher-type alltoall) and DeepEP (flex with the deepep backend).")
    _virtual_stages(flags, launch, where)
    _layout(flags, launch, where)
    if experts and "--moe-grouped-gemm" not in flags:
        launch.notes.append(f"{where} does not set --moe-grouped-gemm, and dsauto prices the experts' GEMMs "
                            f"grouped; add it to run as priced.")
    launch.ddp_bucket_size = _int(flags, "--ddp-bucket-size", where)
    divisor = _int(flags, "--make-vocab-size-divisible-by", where, VOCAB_PAD_MULTIPLE)
    if divisor != VOCAB_PAD_MULTIPLE:
        launch.notes.append(f"{where} pads the vocabulary to a multiple of {divisor} x tp, and dsauto prices it "
                            f"padded to a multiple of {VOCAB_PAD_MULTIPLE} x tp.")
    if "--cross-entropy-loss-fusion" in flags and flags.get("--cross-entropy-fusion-impl") == "te":
        launch.notes.append(_te_cross_entropy_note(launch, where))
    if "--optimizer-cpu-offload" not in flags and "--overlap-cpu-optimizer-d2h-h2d" in flags:
        launch.unknown.append("--overlap-cpu-optimizer-d2h-h2d")  # read only beside the offload it serves
    _data_parallel_overlap(flags, launch, where)


def _data_parallel_overlap(flags: dict[str, str], launch: MegatronLaunch, where: str) -> None:
    """Pins the launch's ``--overlap-grad-reduce`` and ``--overlap-param-gather``, off unless given as
    in Megatron-LM, refusing what its validate_args refuses (megatron/training/arguments.py: the
    gather overlapped needs the distributed optimizer or Megatron-FSDP, and the reduction overlapped);
    under Megatron-FSDP, priced with both, says what a launch without them runs otherwise."""
    zero, grads, params = launch.pins["zero_stage"], "--overlap-grad-reduce" in flags, "--overlap-param-gather" in flags
    if params and "--use-distributed-optimizer" not in flags and "--use-megatron-fsdp" not in flags:
        raise DsautoError(f"{where} sets --overlap-param-gather without --use-distributed-optimizer or "
                          f"--use-megatron-fsdp, which Megatron-LM refuses; add one, or drop the flag.")
    if params and not grads:
        raise DsautoError(f"{where} sets --overlap-param-gather without --overlap-grad-reduce, which Megatron-LM "
                          f"refuses; add --overlap-grad-reduce, or drop --overlap-param-gather.")
    if zero <= 1:
        launch.pins["overlap_grad_reduce"] = grads
        if zero == 1:
            launch.pins["overlap_param_gather"] = params
        return
    missing = [name for name, given in (("--overlap-grad-reduce", grads), ("--overlap-param-gather", params))
               if not given]
    if missing:
        launch.notes.append(f"{where} does not set {' or '.join(missing)}, and dsauto prices Megatron-FSDP's "
                            f"communication overlapped as its plans run it; add them to run as priced.")


def _te_cross_entropy_note(launch: MegatronLaunch, where: str) -> str:
    """The note on a launch whose loss is Transformer Engine's fused cross entropy, which keeps the
    logits in their 16 bits and computes their gradient into them (transformer_engine/pytorch/
    cross_entropy.py, ``CrossEntropyFunction.forward`` saves ``_input``), where dsauto prices
    Megatron-core's native loss with its fp32 softmax beside them (:func:`dsauto.cost.terms.
    megatron_loss_bytes_per_token`, which the native fusion keeps too: megatron/core/fusions/
    fused_cross_entropy.py): 4 bytes a vocabulary entry and token more, on the last pipeline stage."""
    pins, train, model = launch.pins, launch.train, launch.model
    size = ""
    if model is not None and "micro_batch" in pins and "seq_len" in train:
        vocab = model.padded_vocab_size(pins["tp"]) // pins["tp"]
        tokens = pins["micro_batch"] * train["seq_len"] // pins["cp"]
        size = f" ({format_bytes(4 * vocab * tokens)} at its micro-batch)"
    return (f"{where} computes the loss with Transformer Engine's fused cross entropy (--cross-entropy-fusion-impl "
            f"te), which keeps no fp32 softmax beside the logits, and dsauto prices Megatron-core's native loss, "
            f"4 bytes a vocabulary entry and token more{size}, so the last pipeline stage's peak is priced up to "
            f"that much above what it runs.")


FUSED_SOFTMAX_MAX_KEYS = 4096
"""The longest key sequence Megatron-core's fused masked-softmax kernel takes
(megatron/core/fusions/fused_softmax.py, ``FusedScaleMaskSoftmax.is_kernel_available``, 0.16)."""


def _softmax(flags: dict[str, str], launch: MegatronLaunch, where: str) -> None:
    """The softmax pin of a 16-bit launch with unfused attention: 16 bits where the launch keeps no fp32
    copy of the scores and dsauto's plans can run it so (Transformer Engine's fused masked softmax,
    :func:`dsauto.engines.megatron.te_softmax_fuses`); else fp32 (dsauto's default), with a note where
    the launch keeps 16 bits all the same (its memory is then priced high)."""
    train, pins = launch.train, launch.pins
    if train.get("flash_attention") is not False or train["dtype"] == "fp32":
        return
    seq_len = train.get("seq_len")
    if seq_len is None:
        launch.notes.append(f"{where} runs unfused attention without --seq-length, so dsauto prices its softmax with "
                            f"the fp32 copy of the scores (its default); add --seq-length to price what it runs.")
        return
    heads = launch.model.num_attention_heads // pins["tp"] if launch.model is not None else None
    batches = None if heads is None or "micro_batch" not in pins else pins["micro_batch"] * heads
    local = flags.get("--transformer-impl") == "local" or flags.get("--attention-backend") == "local"
    batches_or_fitting = 4 if batches is None else batches  # left to the command line: taken to fit
    keeps_16_bits = not _softmax_in_fp32(flags, seq_len, local, launch.environment.get(
        "NVTE_MASKED_SOFTMAX_FUSION", "1"), batches_or_fitting)
    priced_16_bits = keeps_16_bits and te_softmax_fuses(seq_len, 1, batches_or_fitting)
    pins["attention_softmax_in_fp32"] = not priced_16_bits
    if keeps_16_bits and not priced_16_bits:
        launch.notes.append(f"{where} keeps its unfused softmax in 16 bits, which dsauto's plans run through "
                            f"Transformer Engine's fused kernel, and that kernel does not take {seq_len} keys in "
                            f"{batches} attention batches; dsauto prices the fp32 copy of the scores, so the memory "
                            f"is priced high.")


def _softmax_in_fp32(flags: dict[str, str], seq_len: int, local: bool, te_fusion: str,
                     attention_batches: int) -> bool:
    """Whether a 16-bit launch's unfused attention keeps an fp32 copy of its softmax.

    Transformer Engine's layers (Megatron-LM's default ``--transformer-impl``) run their own unfused
    attention, whose softmax is fp32 unless their fused masked softmax takes the keys
    and the attention batches (micro-batch x heads per rank), with ``te_fusion``, the launch's
    ``NVTE_MASKED_SOFTMAX_FUSION``, not 0 (:func:`dsauto.engines.megatron.te_softmax_fuses`);
    Megatron's flags do not reach it.
    Megatron-core's own attention (``--transformer-impl local``, or ``--attention-backend local``)
    keeps the fp32 copy only when the softmax runs in fp32 (``--attention-softmax-in-fp32``, which
    ``--apply-query-key-layer-scaling`` implies: validate_args) through torch rather than its fused
    kernel, on by default (``--no-masked-softmax-fusion`` turns it off) where the shapes fit it
    (megatron/core/fusions/fused_softmax.py, ``is_kernel_available``: 16 < s <= 4096, s and the
    attention batches multiples of 4)."""
    if not local:
        return not te_softmax_fuses(seq_len, 1, attention_batches, te_fusion)
    fp32 = "--attention-softmax-in-fp32" in flags or "--apply-query-key-layer-scaling" in flags
    fused = ("--no-masked-softmax-fusion" not in flags and attention_batches % 4 == 0
             and 16 < seq_len <= FUSED_SOFTMAX_MAX_KEYS and seq_len % 4 == 0)
    return fp32 and not fused


def _optimizer_precision(flags: dict[str, str], launch: MegatronLaunch, where: str) -> None:
    """The precision-aware optimizer's pins (Megatron-LM's ``--use-precision-aware-optimizer`` and its
    dtypes; megatron/core/optimizer/optimizer_config.py). Without it Megatron-core asserts every dtype
    fp32; with the optimizer offloaded it is the offload's companion, its states priced in fp32; else
    the plan keeps both moments in one dtype, the fp32 main weights as remainders, and
    ``--main-grads-dtype bf16`` is a bf16 gradient buffer (validate_args then leaves
    accumulate_allreduce_grads_in_fp32 off)."""
    if flags.get("--main-params-dtype", "fp32") != "fp32":
        raise DsautoError(f"{where} keeps the main weights in {flags['--main-params-dtype']} "
                          f"(--main-params-dtype); dsauto prices them in fp32 (as remainders beside bf16 weights), so "
                          f"leave the flag out.")
    dtypes = {name: _choice(flags, name, where, "fp32", choices) for name, choices in (
        ("--main-grads-dtype", ("fp32", "bf16")), ("--exp-avg-dtype", MOMENT_BYTES),
        ("--exp-avg-sq-dtype", MOMENT_BYTES))}
    changed = [f"{name} {value}" for name, value in dtypes.items() if value != "fp32"]
    if "--use-precision-aware-optimizer" not in flags:
        if changed:
            raise DsautoError(f"{where} sets {', '.join(changed)} without --use-precision-aware-optimizer, which "
                              f"Megatron-core refuses; add it or leave them out.")
        return
    if "--optimizer-cpu-offload" in flags:
        if changed:
            raise DsautoError(f"{where} sets {', '.join(changed)} with the optimizer offloaded; dsauto prices the "
                              f"host's optimizer in fp32, so leave them out or keep the optimizer on the device.")
        return
    if launch.pins["zero_stage"] != 1:
        raise DsautoError(f"{where} sets --use-precision-aware-optimizer without the distributed optimizer "
                          f"(--use-distributed-optimizer, no Megatron-FSDP), which Megatron-core refuses or runs "
                          f"otherwise; dsauto prices it with the distributed optimizer alone.")
    if launch.train["dtype"] != "bf16":
        raise DsautoError(f"{where} sets --use-precision-aware-optimizer in {launch.train['dtype']}; dsauto prices it "
                          f"under --bf16 only.")
    if dtypes["--exp-avg-dtype"] != dtypes["--exp-avg-sq-dtype"]:
        raise DsautoError(f"{where} keeps Adam's moments in {dtypes['--exp-avg-dtype']} and "
                          f"{dtypes['--exp-avg-sq-dtype']}; dsauto prices both in one dtype, so give "
                          f"--exp-avg-dtype and --exp-avg-sq-dtype the same value.")
    launch.pins["precision_aware_optimizer"] = dtypes["--exp-avg-dtype"]
    if dtypes["--main-grads-dtype"] == "bf16":
        launch.pins["grad_reduce_in_fp32"] = False


def _virtual_stages(flags: dict[str, str], launch: MegatronLaunch, where: str) -> None:
    pins = launch.pins
    if "--pipeline-model-parallel-layout" in flags:
        return  # the layout's chunks say it (_layout refuses the virtual-stage flags beside it)
    if "--num-virtual-stages-per-pipeline-rank" in flags:
        pins["vpp"] = _int(flags, "--num-virtual-stages-per-pipeline-rank", where)
    elif "--num-layers-per-virtual-pipeline-stage" in flags:
        per_chunk = _int(flags, "--num-layers-per-virtual-pipeline-stage", where)
        if launch.model is None:
            raise DsautoError(f"{where} sets --num-layers-per-virtual-pipeline-stage without --num-layers; give "
                              f"--num-virtual-stages-per-pipeline-rank instead.")
        # Megatron-LM counts the embedding and the loss with the layers where the launch accounts for them
        # (megatron/training/arguments.py, validate_args)
        layers = launch.model.num_layers + sum(flag in flags for flag in ACCOUNT_FLAGS)
        chunks = layers // per_chunk if per_chunk else 0
        if not per_chunk or chunks * per_chunk != layers or chunks % pins["pp"]:
            raise DsautoError(f"{where} puts {per_chunk} layers in each virtual stage, which does not split "
                              f"{layers} layers over pp {pins['pp']}; give a count that does.")
        pins["vpp"] = chunks // pins["pp"]
    else:
        pins["vpp"] = 1


ACCOUNT_FLAGS = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")


def _layout(flags: dict[str, str], launch: MegatronLaunch, where: str) -> None:
    pins = launch.pins
    if accounted := [flag for flag in ACCOUNT_FLAGS if flag in flags]:
        _accounted_layout(flags, accounted, launch, where)
        return
    if "--pipeline-model-parallel-layout" in flags:
        # Megatron-LM's validate_args and TransformerConfig refuse a layout beside the other layout flags
        if others := [f for f in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                                  "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank")
                      if f in flags]:
            raise DsautoError(f"{where} sets --pipeline-model-parallel-layout with {' and '.join(others)}, which "
                              f"Megatron-LM refuses beside a layout; keep the layout alone.")
        _layout_string(flags["--pipeline-model-parallel-layout"], launch, where)
        return
    first = _int(flags, "--decoder-first-pipeline-num-layers", where)
    last = _int(flags, "--decoder-last-pipeline-num-layers", where)
    if first is None and last is None:
        if pins["pp"] > 1:
            layers = launch.model.num_layers if launch.model is not None else None
            if layers is not None and layers % pins["pp"]:
                raise DsautoError(f"{where} sets --pipeline-model-parallel-size {pins['pp']} and no layout flag, so "
                                  f"Megatron-core splits the {layers} transformer layers evenly, which {pins['pp']} "
                                  f"stages cannot; add --decoder-first-pipeline-num-layers and "
                                  f"--decoder-last-pipeline-num-layers, or --pipeline-model-parallel-layout.")
            pins["stage_layers"] = "even"  # Megatron-core's split without a layout flag
        return
    if launch.model is None:
        raise DsautoError(f"{where} sets the first or last stage's layers without --num-layers; give the model's "
                          f"flags too.")
    pp, layers = pins["pp"], launch.model.num_layers
    middle = pp - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    if middle < 0 or rest < 0 or (middle and rest % middle) or (not middle and rest):
        given = " and ".join(f"the {end} pipeline stage {count}" for end, count in (("first", first), ("last", last))
                             if count is not None)
        raise DsautoError(f"{where} gives {given} of {layers} layers, which leaves no even split of the rest over "
                          f"pp {pp}; give counts that do.")
    stages = (([first] if first is not None else []) + ([rest // middle] * middle if middle else [])
              + ([last] if last is not None else []))
    pins["stage_layers"] = tuple(stages)
    launch.spelled["stage_layers"] = ("--decoder-first-pipeline-num-layers" if first is not None
                                      else "--decoder-last-pipeline-num-layers")


def _accounted_layout(flags: dict[str, str], accounted: list[str], launch: MegatronLaunch, where: str) -> None:
    """Megatron-core's even split counting the embedding, the loss or both as a layer
    (:func:`dsauto.plan.accounted_chunks`), which TransformerConfig refuses beside a layout or the first
    and last stages' counts."""
    pins = launch.pins
    if others := [f for f in ("--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
                              "--decoder-last-pipeline-num-layers") if f in flags]:
        raise DsautoError(f"{where} sets {' and '.join(accounted)} with {' and '.join(others)}, which Megatron-core "
                          f"refuses beside it; keep one way of laying out the pipeline.")
    if launch.model is None:
        raise DsautoError(f"{where} sets {' and '.join(accounted)} without --num-layers; give the model's flags too.")
    embedding, loss = (flag in accounted for flag in ACCOUNT_FLAGS)
    pp, virtual, layers = pins["pp"], pins.get("vpp") or 1, launch.model.num_layers
    chunks = accounted_chunks(layers, pp, virtual, embedding, loss)
    if chunks is None:
        raise DsautoError(f"{where} sets {' and '.join(accounted)}, which splits {layers} transformer layers + "
                          f"{embedding + loss} evenly over pp {pp} x {virtual} virtual stages, and "
                          f"{layers + embedding + loss} do not divide (Megatron-core refuses it); change the degrees.")
    # dsauto's own name of the split, which dsauto.api.make_problem resolves as this did
    pins["stage_layers"] = next(name for name, counted in ACCOUNTED_STAGES.items() if counted == (embedding, loss))


def _layout_string(text: str, launch: MegatronLaunch, where: str) -> None:
    """A layout string as Megatron-core reads it (megatron/core/transformer/
    pipeline_parallel_layer_layout.py): model chunks split by "|", in Megatron's chunk order, of ``E``
    (the embedding), ``t`` (a transformer layer), ``m`` (a multi-token-prediction layer) and ``L`` (the
    loss); ``x*N`` repeats a character and ``(...)*N`` a group, commas are cosmetic. dsauto prices the
    embedding first, the loss last, and the launch's ``--mtp-num-layers`` prediction layers just
    before the loss, in its chunk."""
    pins, pp = launch.pins, launch.pins["pp"]
    expanded = expand_layout(text, where)
    chunks_text = expanded.split("|")
    wanted = launch.model.mtp_layers if launch.model is not None else 0
    placed = expanded.count("m")
    if placed != wanted:
        raise DsautoError(f"{where} sets --pipeline-model-parallel-layout {text}, which places {placed} "
                          f"multi-token-prediction layer(s), and "
                          f"{f'--mtp-num-layers gives {wanted}' if wanted else 'it sets no --mtp-num-layers'}; "
                          f"make them agree (Megatron asserts it).")
    last = chunks_text[-1]
    if (expanded.count("E") != 1 or not chunks_text[0].startswith("E") or expanded.count("L") != 1
            or not last.endswith("L") or not last.removesuffix("L").endswith("m" * placed)):
        raise DsautoError(f"{where} sets --pipeline-model-parallel-layout {text}; dsauto prices the embedding (E) "
                          f"first, the loss (L) at the end of the last chunk and the multi-token-prediction layers "
                          f"(m) just before it, so give that layout or --stage-layers.")
    chunks = [chunk.count("t") for chunk in chunks_text]
    if len(chunks) % pp:
        raise DsautoError(f"{where} lays out {len(chunks)} model chunks, not a multiple of pp {pp}; give one chunk "
                          f"per pipeline rank and virtual stage.")
    if launch.model is not None and sum(chunks) != launch.model.num_layers:
        raise DsautoError(f"{where} sets --pipeline-model-parallel-layout {text}, which places {sum(chunks)} "
                          f"transformer layers, and the model has {launch.model.num_layers}; make them agree.")
    virtual = len(chunks) // pp
    stages = tuple(rank_totals(chunks, pp, virtual))
    if min(stages) < 1:
        raise DsautoError(f"{where} sets --pipeline-model-parallel-layout {text}, which leaves pipeline rank "
                          f"{stages.index(min(stages))} without a transformer layer; dsauto plans every rank with one.")
    launch.spelled["stage_layers"] = "--pipeline-model-parallel-layout"
    # a rank's layers split otherwise than evenly over its chunks are pinned chunk by chunk
    pins["vpp"], pins["stage_layers"] = virtual, stages if even_chunks(stages, virtual, chunks) else tuple(chunks)


def _recompute(flags: dict[str, str], launch: MegatronLaunch, where: str) -> None:
    pins = launch.pins
    granularity = flags.get("--recompute-granularity")
    if "--recompute-activations" in flags:
        granularity = granularity or "selective"
    if "--moe-layer-recompute" in flags:
        # Megatron-core's TransformerConfig turns the deprecated flag into selective recomputation
        # with 'moe' added to the modules, and refuses it beside full recomputation.
        if granularity == "full":
            raise DsautoError(f"{where} sets --moe-layer-recompute with --recompute-granularity full, which "
                              f"Megatron-core refuses; keep one.")
        granularity = "selective"
        modules = flags.get("--recompute-modules", "core_attn").split()
        # 'moe' recomputes nothing in a dense model's layers
        experts = launch.model.moe if launch.model is not None else "--num-experts" in flags
        flags = {**flags, "--recompute-modules": " ".join(modules + ["moe"] * (experts and "moe" not in modules))}
    if granularity != "selective":
        pins["recompute_modules"] = "none"  # no selective recomputation beside what the flags say
    if granularity is None:
        pins["checkpoint"] = False
        return
    if granularity == "selective":
        pins["recompute_modules"] = ",".join(flags.get("--recompute-modules", "core_attn").split())
        return
    if granularity != "full":
        raise DsautoError(f"{where} sets --recompute-granularity {granularity}; Megatron-LM's are full and "
                          f"selective.")
    method = flags.get("--recompute-method")
    number = _int(flags, "--recompute-num-layers", where, 1)
    if method == "uniform":
        pins["checkpoint"] = True  # groups of one layer (REFUSED names more)
    elif method == "block":
        pins["recompute_num_layers"] = number
    else:
        raise DsautoError(f"{where} sets --recompute-granularity full without --recompute-method; give "
                          f"--recompute-method uniform or block, as Megatron-LM requires.")


def _check_model(described: ModelSpec, model: ModelSpec, where: str, flags: dict[str, str],
                 seq_len: int | None = None) -> None:
    """Refuses flags that describe a model other than ``model`` (the one named with ``--model``):
    the shapes, the vocabulary, the MLP, the norm, the positions, the biases, dropout, the head's
    tying and the experts. Megatron-LM's defaults count as said: a launch without
    ``--disable-bias-linear`` trains with biases, one without ``--hidden-dropout 0`` with dropout."""
    compared = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_heads", "head_dim",
                "norm", "position_embedding", "tied_embeddings", "dropout", "vocab_size", "num_experts", "moe_top_k",
                "moe_router_pre_softmax", "moe_router_topk_scaling", "moe_router_groups", "moe_router_group_topk")
    _check_layers(flags, model, where)
    # a window the flags give is the model's; one they leave out must slide over none of the launch's
    # sequences (dsauto's own file then states none: ModelSpec.window_slides)
    compared += ("sliding_window", "global_attention_every") if described.sliding_window else ()
    if not described.sliding_window and seq_len and model.window_slides(seq_len):
        raise DsautoError(f"{where} sets no --window-size, so its {seq_len}-token sequences attend in full, and "
                          f"--model {model.name} slides a {model.sliding_window}-token window over them; add "
                          f"--window-size {model.sliding_window - 1},0, or plan the model the launch trains.")
    for name in compared:
        got, want = getattr(described, name), getattr(model, name)
        if got != want:
            raise DsautoError(f"{where} describes a model with {name} {got}, and --model {model.name} has {want}; "
                              f"plan the model the launch trains.")

