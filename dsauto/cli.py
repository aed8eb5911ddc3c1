"""dsauto's command line: ``dsauto profile | tune | plan | explain | validate``.

Every error a user can cause prints one sentence to stderr and exits with code 2; the search itself
never writes partial artifacts (they are written to a temporary folder and moved into place).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import signal
import sys
import threading
import time
import warnings
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsauto.errors import DsautoError

if TYPE_CHECKING:
    from dsauto.api import Problem

EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 1


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one sentence with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        command = self.prog.split()[1:]  # "dsauto plan": the subcommand's own help
        raise DsautoError(f"{message[0].upper()}{message[1:]}; see '{' '.join(['dsauto', *command])} --help'.")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # named with the subcommand they were given to, whose help lists what it takes
            command = getattr(parsed, "command", None)
            raise DsautoError(f"Unrecognized arguments: {' '.join(extras)}; see "
                              f"'dsauto{' ' + command if command else ''} --help'.")
        return parsed


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _whole(low: int, high: int) -> Callable[[str], int]:
    """An option type: a whole number from ``low`` to ``high``."""
    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}, got {value}")
        return value

    return read


MAX_TRIAL_SECONDS = 7 * 24 * 3600.0
"""Longest --trial-timeout (a week): beyond it a hung trial would never be noticed."""


def _seconds(text: str) -> float:
    """An option type: a finite, positive number of seconds (a week at most)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_TRIAL_SECONDS):
        raise argparse.ArgumentTypeError(f"expected seconds above 0 and at most {MAX_TRIAL_SECONDS:.0f} (a week), "
                                         f"got {text}")
    return value


_MODEL_HELP = "preset name, a dsauto model YAML, or a Hugging Face config.json"


def _model_help() -> str:
    from dsauto.spec.presets import list_model_presets

    return f"{_MODEL_HELP} (presets: {', '.join(list_model_presets())})"


def _hardware_help() -> str:
    from dsauto.spec.presets import list_hardware_presets

    return f"hardware preset name ({', '.join(list_hardware_presets())}) or a cluster YAML"


def _option_type(hint: Any) -> tuple[Callable[[str], Any], tuple[Any, ...] | None]:
    """How an option reads a field of type ``hint``: its argparse ``type`` and ``choices``."""
    if typing.get_origin(hint) is typing.Literal:
        return str, typing.get_args(hint)
    values = [a for a in typing.get_args(hint) if a is not type(None)]  # X | None is X, optional
    if len(values) == 1:
        return _option_type(values[0])
    if hint is int:
        return _positive_int, None  # degrees, sizes and counts: whole numbers from 1
    if hint in (float, str):
        return hint, None
    raise TypeError(f"no command-line spelling for a field of type {hint!r}; give its option "
                    f"'choices' or a 'const' in the field's metadata")


def add_field_options(p: argparse.ArgumentParser, cls: type) -> None:
    """One option for each field of the dataclass ``cls`` whose metadata names a ``flag`` (the keys
    are described on :class:`dsauto.search.space.Constraints`), with the field's name as its dest.

    An option not given reads None, which :func:`field_values` leaves out, so the field's default
    or the one :func:`dsauto.api.make_problem` computes applies; ``--help`` says which.
    """
    from dsauto.api import DEFAULT_TEXT

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "flag" not in meta:
            continue
        text = meta["help"] + (f" (default: {DEFAULT_TEXT[f.name]})" if f.name in DEFAULT_TEXT else "")
        choices = meta.get("choices")
        if "const" in meta:
            p.add_argument(meta["flag"], dest=f.name, action="store_const", const=meta["const"], default=None,
                           help=text)
        elif isinstance(choices, Mapping):  # names on the command line, for values of the field
            default = next(name for name, value in choices.items() if value == f.default)
            p.add_argument(meta["flag"], dest=f.name, choices=tuple(choices), default=default, help=text)
        else:
            kind, literal = _option_type(hints[f.name])
            p.add_argument(meta["flag"], dest=f.name, type=int if choices and kind is _positive_int else kind,
                           choices=choices or literal, default=None, help=text)


def field_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values the options of :func:`add_field_options` were given, by field name; an option
    not given is left out."""
    values = {}
    for f in dataclasses.fields(cls):
        if "flag" not in f.metadata:
            continue
        value = getattr(args, f.name)
        choices = f.metadata.get("choices")
        if isinstance(choices, Mapping):
            value = choices[value]
        if value is not None:
            values[f.name] = value
    return values


def _add_search_args(p: argparse.ArgumentParser) -> None:
    from dsauto.api import DEFAULT_HARDWARE, DEFAULT_MODEL
    from dsauto.search.space import Constraints
    from dsauto.spec.training import TrainSpec

    p.add_argument("--model", default=None, help=f"{_model_help()} (default: {DEFAULT_MODEL})")
    p.add_argument("--hardware", default=None,
                   help=f"{_hardware_help()} (default: {DEFAULT_HARDWARE}, or the one dsauto's "
                        f"own --megatron-args file was planned on)")
    p.add_argument("--nodes", type=_positive_int, default=None, help="number of nodes (default: 1)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=None,
                   help="devices per node (default: the hardware's)")
    add_field_options(p, TrainSpec)
    add_field_options(p, Constraints)
    p.add_argument("--memory-limit", default=None,
                   help="per-device memory budget such as 60GiB (default: device memory minus reserve)")
    p.add_argument("--megatron-args", type=Path, default=None, metavar="FILE",
                   help="a Megatron-LM launch's arguments (megatron_args.txt, or a script's flags): plan with "
                        "everything it fixes pinned, and its model unless --model names one")
    p.add_argument("--top", type=_whole(0, 100), default=0, metavar="K", help="also list the next K plans")
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="a profile file or folder from `dsauto profile`: price layers from measurements")


TRIAL_DEFAULTS: dict[str, Any] = {
    "--top-plans": 4, "--script": None, "--script-args": "", "--launcher": None, "--storage": None,
    "--study-name": None, "--trial-steps": 5, "--trial-warmup": 2, "--trial-timeout": 600.0, "--profile-dir": "profiles"}
"""The options of trials and their defaults (refused when set without --trials: _check_node_args)."""


def _add_trial_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("refining with measured steps (--trials)")
    g.add_argument("--trials", type=_whole(0, 10_000), default=0, metavar="N",
                   help="measure real training steps of up to N candidate plans (an Optuna study) and "
                        "write the fastest measured one; 0 writes the best predicted plan (default)")
    g.add_argument("--top-plans", type=_whole(1, 32), default=TRIAL_DEFAULTS["--top-plans"], metavar="K",
                   help="strategies of the search the trials start from (default: 4)")
    g.add_argument("--script", default=None, metavar="train.py",
                   help="measure with your own training script instead of the built-in harness: a DeepSpeed "
                        "script that calls dsauto.deepspeed.initialize, or with --engine megatron a "
                        "Megatron-core script that calls dsauto.megatron.load_plan")
    g.add_argument("--script-args", default="", metavar='"..."', help="arguments of --script, one string")
    g.add_argument("--launcher", choices=("torchrun", "deepspeed"), default=None,
                   help="launcher of each trial (default: deepspeed with a DeepSpeed --script, else torchrun)")
    g.add_argument("--storage", default=None, metavar="URL",
                   help="Optuna storage of the study, e.g. postgresql://host/db to share it between "
                        "machines (default: sqlite in --out)")
    g.add_argument("--study-name", default=None, help="study name (default: derived from the problem, so a "
                                                      "rerun resumes it)")
    g.add_argument("--trial-steps", type=_whole(1, 10_000), default=TRIAL_DEFAULTS["--trial-steps"],
                   help="timed steps per trial (default: 5)")
    g.add_argument("--trial-warmup", type=_whole(0, 10_000), default=TRIAL_DEFAULTS["--trial-warmup"],
                   help="untimed steps per trial (default: 2)")
    g.add_argument("--trial-timeout", type=_seconds, default=TRIAL_DEFAULTS["--trial-timeout"], metavar="SECONDS",
                   help="a trial with no result after this long is killed as hung (default: 600)")
    g.add_argument("--profile-dir", default=TRIAL_DEFAULTS["--profile-dir"], metavar="DIR",
                   help="with --trials and no --profile: the profile store, profiled first if needed "
                        "(default: profiles)")


def _add_node_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trials of plans over several nodes (--trials with --nodes > 1)")
    g.add_argument("--node-rank", type=_whole(0, 2**20), default=0, metavar="K",
                   help="this node's place, 0 to --nodes - 1: node 0 drives the study, the others start their "
                        "torchrun agent for each of its trials; under Slurm, $SLURM_NODEID (default: 0)")
    g.add_argument("--master-addr", default=None, metavar="HOST",
                   help="node 0's address, reachable from every node (torchrun's --master-addr)")
    g.add_argument("--master-port", type=_whole(1, 65535), default=None, metavar="PORT",
                   help="port of each trial's rendezvous on node 0 (default: a free one per trial)")
    g.add_argument("--hostfile", default=None, metavar="FILE",
                   help="with --launcher deepspeed: DeepSpeed's hostfile; node 0 alone runs dsauto tune and "
                        "its launcher starts the other nodes over passwordless ssh")
    g.add_argument("--driver-timeout", type=_seconds, default=120.0, metavar="SECONDS",
                   help="a node other than 0 stops when node 0 has not been heard from for this long "
                        "(default: 120)")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) <= 0 or max(values) > 4096:
        raise argparse.ArgumentTypeError(f"expected whole numbers from 1 to 4096, got {text!r}")
    return values


def _add_profile_args(p: argparse.ArgumentParser) -> None:
    from dsauto.api import DEFAULT_MODEL, DEFAULT_TEXT
    from dsauto.plan import Engine
    from dsauto.spec.training import Dtype

    p.add_argument("--model", default=DEFAULT_MODEL, help=f"{_model_help()} (default: {DEFAULT_MODEL})")
    p.add_argument("--hardware", default=None,
                   help="hardware preset or cluster YAML, for its default dtype (default: cpu, or h100-80gb on CUDA)")
    p.add_argument("--dtype", choices=typing.get_args(Dtype), default=None,
                   help="dtype to measure in (default: the hardware's)")
    p.add_argument("--seq-len", type=_positive_int, default=None,
                   help=f"tokens per sequence (default: {DEFAULT_TEXT['seq_len']})")
    p.add_argument("--micro-batches", type=_int_list, default=(1, 2, 4, 8), metavar="1,2,4,8",
                   help="micro-batch sizes to time (others are interpolated)")
    p.add_argument("--tp", type=_int_list, default=None, metavar="1,2,4,8",
                   help="tensor-parallel shard shapes to time (default: every degree up to 8 the model allows)")
    p.add_argument("--factory", default=None, metavar="package.module:function",
                   help="build the model with your own function (called with the model spec) instead of "
                        "dsauto's reference implementation")
    p.add_argument("--engine", choices=typing.get_args(Engine), default="deepspeed",
                   help="whose transformer layers to time: deepspeed, the reference layers DeepSpeed trains; "
                        "megatron, Megatron-core's own (default: deepspeed)")
    p.add_argument("--warmup", type=_whole(1, 1000), default=2, help="untimed runs before timing (default: 2)")
    p.add_argument("--repeats", type=_whole(1, 1000), default=5, help="timed runs; the median is kept (default: 5)")
    p.add_argument("--force", action="store_true", help="measure again even if a matching profile is stored")
    p.add_argument("--out", default="profiles", help="folder of the profile store (default: profiles)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dsauto", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    profile = sub.add_parser("profile", help="measure the model's layers (and collectives on several ranks) into a profile store")
    _add_profile_args(profile)
    tune = sub.add_parser("tune", help="search the best plan and write ds_config.json, megatron_args.txt, plan.yaml, plan.png")
    _add_search_args(tune)
    tune.add_argument("--out", default="out", help="folder for the artifacts (default: out)")
    _add_trial_args(tune)
    _add_node_args(tune)
    plan = sub.add_parser("plan", help="search and print plans without writing anything")
    _add_search_args(plan)
    explain = sub.add_parser("explain", help="print a plan from plan.yaml or ds_config.json")
    explain.add_argument("path")
    validate = sub.add_parser("validate", help="check a ds_config.json with DeepSpeed's own parser (and against "
                                               "its own dsauto block)")
    validate.add_argument("path")
    validate.add_argument("--world-size", type=_whole(1, 2**20), default=None, metavar="N",
                          help="data-parallel ranks to check the batch keys against (default: the dsauto "
                               "block's, else what the three batch keys imply, else 1)")
    return parser


def problem_from_args(args: argparse.Namespace) -> Problem:
    """The problem ``dsauto tune`` / ``dsauto plan`` solve: :func:`dsauto.api.make_problem` of the
    options, so the command line and Python share every default."""
    from dsauto.api import DEFAULT_HARDWARE, DEFAULT_MODEL, make_problem
    from dsauto.search.space import Constraints
    from dsauto.spec.presets import list_presets
    from dsauto.spec.training import TrainSpec

    pins, train = field_values(args, Constraints), field_values(args, TrainSpec)
    model: Any = args.model or DEFAULT_MODEL
    nodes, gpus_per_node, hardware = args.nodes, args.gpus_per_node, args.hardware
    if args.megatron_args is not None:
        if pins.get("hf_trainer"):
            raise DsautoError("--for hf plans for Hugging Face's Trainer, which runs DeepSpeed, and --megatron-args "
                              "reads a Megatron-LM launch; drop one of them.")
        model, launch_train, launch_pins, world, spelled, planned, planned_on = _launch_from_args(args)
        if hardware is None and planned_on is not None:
            if planned_on not in list_presets("hardware"):
                raise DsautoError(f"{args.megatron_args} was planned on {planned_on}, which is not a hardware preset; "
                                  f"give --hardware with the cluster YAML it was planned on.")
            hardware = planned_on
        args.launch_spelled = {key: flag for key, flag in spelled.items() if key not in train and key not in pins}
        train, pins = _merged(train, launch_train, "--megatron-args"), _merged(pins, launch_pins, "--megatron-args")
        if planned:
            nodes, gpus_per_node = _planned_world(nodes, gpus_per_node, world, args.megatron_args)
        else:
            nodes = _launched(nodes, world.get("nodes"), "nodes", "--nodes", args.megatron_args)
            gpus_per_node = _launched(gpus_per_node, world.get("gpus_per_node"), "ranks a node", "--gpus-per-node",
                                      args.megatron_args)
    return make_problem(model, hardware or DEFAULT_HARDWARE, nodes=nodes, gpus_per_node=gpus_per_node,
                        memory_limit=args.memory_limit, **train, **pins)


def _launch_from_args(args: argparse.Namespace
                      ) -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, int], dict[str, str], bool, str | None]:
    """The model, batch, pins, launcher's world (nodes, gpus_per_node), flag spellings of
    ``--megatron-args``, whether the world is the one dsauto's own file was planned for and the
    hardware that file names, warning
    of what it sets that dsauto does not read or prices otherwise."""
    from dsauto.engines.megatron_args import read_megatron_args
    from dsauto.errors import DsautoWarning
    from dsauto.spec.loaders import as_model

    named = as_model(args.model) if args.model else None
    launch = read_megatron_args(args.megatron_args, named, {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node})
    if launch.model is None:
        raise DsautoError(f"{args.megatron_args} does not describe the model (no --num-layers); name it with "
                          f"--model.")
    if launch.unknown:
        warnings.warn(f"{args.megatron_args} sets {', '.join(launch.unknown)}, which dsauto does not read; the plan "
                      f"is priced without {'them' if len(launch.unknown) > 1 else 'it'}.", DsautoWarning, stacklevel=2)
    for note in launch.notes:
        warnings.warn(note, DsautoWarning, stacklevel=2)
    args.launch_bucket = launch.ddp_bucket_size
    return (launch.model, launch.train, launch.pins, launch.world, launch.spelled, launch.world_planned,
            launch.hardware)


def in_launch_spelling(message: str, spelled: Mapping[str, str]) -> str:
    """``message`` with the options of the choices that only the ``--megatron-args`` file fixed
    spelled as the file spells them (``spelled``: flag by pin or train key,
    MegatronLaunch.spelled): the user changes them there."""
    from dsauto.search.space import Constraints
    from dsauto.spec.training import TrainSpec

    options = {f.name: f.metadata["flag"] for cls in (Constraints, TrainSpec) for f in dataclasses.fields(cls)
               if "flag" in f.metadata}
    for key, flag in spelled.items():
        if key in options:
            message = re.sub(re.escape(options[key]) + r"(?![\w-])", flag, message)
    return message


def _launched(given: int | None, launched: int | None, what: str, option: str, path: Any) -> int | None:
    """The size the command line gives, else the one the launch script's launcher starts; refused
    where they differ."""
    if given is not None and launched is not None and given != launched:
        raise DsautoError(f"{path}'s launcher starts {launched} {what} and the command line gives {option} {given}; "
                          f"drop one of them.")
    return given if given is not None else launched


def _planned_world(nodes: int | None, gpus_per_node: int | None, planned: dict[str, int],
                   path: Any) -> tuple[int, int]:
    """The nodes and ranks a node of dsauto's own megatron_args.txt: the command line's where it
    gives them and they make the world the file was planned for (its data-parallel degree is that
    world's), the file's where it gives none; refused where they make another world."""
    shape = (nodes or planned["nodes"], gpus_per_node or planned["gpus_per_node"])
    if shape[0] * shape[1] != planned["nodes"] * planned["gpus_per_node"]:
        raise DsautoError(f"{path} was planned for {planned['nodes']} x {planned['gpus_per_node']} ranks, whose "
                          f"world size its data-parallel degree follows, and the command line makes {shape[0]} x "
                          f"{shape[1]}; give --nodes and --gpus-per-node making {planned['nodes'] * planned['gpus_per_node']} "
                          f"ranks, or leave them out.")
    return shape


def _merged(given: dict[str, Any], launch: dict[str, Any], source: str) -> dict[str, Any]:
    """The options given on the command line over the launch's, refusing one that contradicts it."""
    def normal(key: str, value: Any) -> Any:  # the spellings of one value that the pins accept
        if key == "stage_layers" and isinstance(value, str) and value != "even":
            return tuple(int(part) for part in value.split(",") if part.strip().isdigit())
        if key == "recompute_modules" and isinstance(value, str):
            return frozenset(part.strip() for part in value.split(","))
        return value

    for key, value in given.items():
        if key in launch and normal(key, launch[key]) != normal(key, value):
            raise DsautoError(f"{source} fixes {key} = {launch[key]!r} and the command line gives {value!r}; drop "
                              f"one of them.")
    return {**launch, **given}


def _search(args: argparse.Namespace):
    from dsauto.api import find_plans
    from dsauto.report import SearchProgress

    problem = problem_from_args(args)
    profile = None
    if args.profile is not None:  # read before the clock starts: the store imports torch
        from dsauto.profile.store import OTHER_ENGINES_PROFILE, find_profile

        with warnings.catch_warnings():  # another engine's profile: find_plans says so, of the plan found
            warnings.filterwarnings("ignore", OTHER_ENGINES_PROFILE)
            profile = find_profile(args.profile, problem.model, problem.train.dtype, problem.train.seq_len,
                                   problem.pins.engine, problem.cluster)
    started = time.perf_counter()
    with SearchProgress() as progress:
        plans = find_plans(problem, top_k=1 + args.top, profile=profile, progress=progress.update)
    _warn_of_the_launchs_buckets(args, plans[0])
    if problem.pins.offload is None:
        _warn_of_offload(plans[0], problem.cluster.memory_budget_bytes)
    return plans, time.perf_counter() - started


def _warn_of_offload(plan: Any, budget: float) -> None:
    """A plan that offloads where the user did not ask for it says so in a warning, not only in its
    description: a configuration pinned from a run that kept everything on the device is planned
    otherwise only because it does not fit the budget there, or runs slower."""
    from dsauto.errors import DsautoWarning
    from dsauto.units import format_bytes, format_seconds

    if plan.offload == "none":
        return
    what = "optimizer state and parameters" if plan.offload == "optimizer+params" else "optimizer state"
    p = plan.prediction
    warnings.warn(f"the plan keeps its {what} in host memory ({format_bytes(p.offloaded_bytes)} a rank, updated by "
                  f"the CPU in {format_seconds(p.optimizer_seconds)} of its {format_seconds(p.step_seconds)} step): no plan "
                  f"that keeps it on the device fits the {format_bytes(budget)} budget and runs faster; pin --offload "
                  f"none to plan without offload, or --offload {plan.offload} to choose it.", DsautoWarning,
                  stacklevel=2)


def _warn_of_the_launchs_buckets(args: argparse.Namespace, plan: Any) -> None:
    """Where a --megatron-args launch sets --ddp-bucket-size other than the plan's buckets, says
    that dsauto prices its own (dsauto's own megatron_args.txt reads back without a word)."""
    from dsauto.engines.megatron import ddp_bucket_size
    from dsauto.errors import DsautoWarning

    launched = getattr(args, "launch_bucket", None)
    if launched is not None and plan.engine == "megatron" and (own := ddp_bucket_size(plan)) != launched:
        warnings.warn(f"{args.megatron_args} sets --ddp-bucket-size {launched}, and dsauto prices the gradient "
                      f"buckets of its own plan, {own} parameters (megatron_args.txt writes it).", DsautoWarning,
                      stacklevel=2)


def _config_options(args: argparse.Namespace) -> dict[str, Any]:
    """How ds_config.json is written: in Hugging Face's convention for a plan ``--for hf``."""
    return {"target": "hf" if args.hf_trainer == "hf" else "deepspeed"}


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _check_memory_limit(args: argparse.Namespace) -> None:
    """Reads ``--memory-limit`` now (it needs a unit) and prints it back in bytes, so that ``80G``
    is never a surprise."""
    if args.memory_limit is not None:
        from dsauto.units import format_bytes, parse_bytes

        limit = parse_bytes(args.memory_limit, "memory limit")
        _say(f"memory limit {args.memory_limit.strip()} = {limit} bytes ({format_bytes(limit)}) per device")


@contextlib.contextmanager
def _output_folder(out: Path) -> Iterator[None]:
    """Holds the lock of the output folder ``out`` (one tune writes into a folder at a time) and, when
    this run created the folder and leaves nothing in it, removes it again."""
    from dsauto.emit.artifacts import folder_lock

    existed = out.exists()
    try:
        with folder_lock(out, "the output folder of a tune"):
            yield
    finally:
        if not existed and out.is_dir() and not any(out.iterdir()):
            out.rmdir()


def _tune_settings(args: argparse.Namespace):
    """The study's settings from the options, each checked: the script exists, its arguments split."""
    import shlex

    from dsauto.refine.nodes import NodeSettings
    from dsauto.refine.runner import TrialSettings
    from dsauto.refine.study import TuneSettings, trial_pins
    from dsauto.search.space import Constraints

    # A Megatron-core script runs under torchrun: DeepSpeed's launcher adds --local_rank to its arguments.
    megatron = trial_pins(Constraints(**field_values(args, Constraints))).engine == "megatron"
    try:
        script_args = tuple(shlex.split(args.script_args))
    except ValueError as exc:
        raise DsautoError(f"Cannot split --script-args {args.script_args!r} into arguments ({exc}); balance "
                          f"its quotes.") from None
    return TuneSettings(
        trials=args.trials, top_plans=args.top_plans, storage=args.storage, study_name=args.study_name,
        trial=TrialSettings(steps=args.trial_steps, warmup_steps=args.trial_warmup,
                            timeout_seconds=args.trial_timeout, script=args.script, script_args=script_args,
                            launcher=args.launcher or ("deepspeed" if args.script and not megatron else "torchrun")),
        nodes=NodeSettings(node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                           hostfile=args.hostfile, driver_timeout_seconds=args.driver_timeout))


def _check_trial_plans(problem: Problem, on_cpu: bool) -> None:
    """Searches the trials' plans analytically before anything is profiled, so that a problem no
    search solves says so now; on CPU ranks, also refuses trials that could not fit in this machine's
    memory with any plan (each rank's share of the available memory as the budget)."""
    from dsauto.profile.resources import LAUNCHER_BYTES, PROCESS_BYTES, USABLE_FRACTION, available_memory_bytes
    from dsauto.refine.study import trial_pins
    from dsauto.search.planner import Planner
    from dsauto.units import format_bytes

    cluster, ranks = problem.cluster, problem.cluster.devices_per_node  # the ranks of this machine
    pins = trial_pins(problem.pins)  # what trials measure
    Planner(problem.model, cluster, problem.train, pins).search()
    available = available_memory_bytes()
    per_rank = int((USABLE_FRACTION * available - LAUNCHER_BYTES) / ranks - PROCESS_BYTES)
    if not on_cpu or per_rank >= cluster.memory_budget_bytes:
        return  # every plan of the budget fits
    try:
        if per_rank <= 0:
            raise DsautoError("no memory per rank")
        Planner(problem.model, cluster, problem.train, pins).with_budget(per_rank).search(near_miss=False)
    except DsautoError:
        raise DsautoError(
            f"Trials run {ranks} rank{'s' if ranks > 1 else ''} of {problem.model.name} on this machine's CPU, "
            f"and no plan fits in the {format_bytes(max(per_rank, 0))} of host memory each would have "
            f"({format_bytes(available)} available, less {format_bytes(PROCESS_BYTES)} per process); measure "
            f"on a machine with GPUs, use fewer --gpus-per-node or a smaller model, or plan without --trials."
        ) from None


def _cmd_refine(args: argparse.Namespace) -> int:
    """``dsauto tune --trials N``: profile if needed, search, measure candidates, write the winner.

    Every option, file and limit is checked before anything is profiled or launched."""
    from dsauto.api import DEFAULT_MODEL
    from dsauto.describe import describe_plan
    from dsauto.emit.artifacts import check_writable_folder, write_artifacts
    from dsauto.profile.launch import clean_stale_launches
    from dsauto.profile.resources import check_fits, profiling_rank_bytes, ranks_on_cpu
    from dsauto.profile.run import launch_profile
    from dsauto.profile.layers import REFERENCE_ENGINE
    from dsauto.profile.store import OTHER_ENGINES_PROFILE, NoMatchingProfile, find_profile
    from dsauto.refine.artifacts import write_trials
    from dsauto.refine.history import record_study
    from dsauto.refine.study import check_trials, leading_nodes, open_storage, refine
    from dsauto.report import describe_trials
    from dsauto.search.planner import Planner

    settings = _tune_settings(args)
    problem = problem_from_args(args)
    if args.model is None and args.megatron_args is not None:
        raise DsautoError("--trials profiles the model by name, and --megatron-args describes it by flags; name it "
                          "with --model too.")
    model, cluster, train, pins = problem.model, problem.cluster, problem.train, problem.pins
    check_writable_folder(args.out, "--out")
    out = Path(args.out)
    check_trials(Planner(model, cluster, train, pins), settings)
    if settings.nodes.node_rank > 0:
        return _follow_node(args, problem, settings)
    source = Path(args.profile or args.profile_dir)
    profile = None
    if args.profile is not None:
        profile = find_profile(source, model, train.dtype, train.seq_len, pins.engine,  # given: it must be there
                               cluster)
    else:
        check_writable_folder(args.profile_dir, "--profile-dir")
    if settings.storage is not None:
        open_storage(settings.storage)  # a storage that cannot be opened says so now, not after profiling
    on_cpu = ranks_on_cpu()
    _check_trial_plans(problem, on_cpu)
    with _output_folder(out), leading_nodes(Planner(model, cluster, train, pins), settings):
        for line in clean_stale_launches():
            _say(line)
        if profile is None:
            try:
                with warnings.catch_warnings():  # another engine's profile: profiled now, not used
                    warnings.filterwarnings("ignore", OTHER_ENGINES_PROFILE)
                    profile = find_profile(source, model, train.dtype, train.seq_len, pins.engine,
                                           cluster)
                if pins.engine is not None and profile.engine != pins.engine:
                    raise NoMatchingProfile(f"{source} has no profile of {pins.engine}'s layers")
            except DsautoError:
                ranks = cluster.devices_per_node
                tps = (pins.tp,) if pins.tp else tuple(t for t in (1, 2, 4, 8) if t <= ranks
                                                         and model.tp_problem(t) is None)
                if on_cpu:
                    check_fits(f"Profiling {model.name}", ranks,
                               profiling_rank_bytes(model, train.dtype, train.seq_len, (1, 2, 4, 8), tps),
                               "profile on a machine with a GPU, or pass a profile measured elsewhere with "
                               "--profile, or use fewer --gpus-per-node or a shorter --seq-len")
                _say(f"profiling {model.name} on {ranks} ranks into {source} first (once; later tunes reuse it)")
                launch_profile(args.model or DEFAULT_MODEL, train.dtype, train.seq_len, tps, ranks, source, _say,
                               engine=pins.engine or REFERENCE_ENGINE)
                profile = find_profile(source, model, train.dtype, train.seq_len, pins.engine, cluster)
        if profile.calibration is not None:
            _say(f"the profile's calibration applies: {profile.calibration.describe()}")
        planner = Planner(model, cluster, train, pins, profile)
        result = refine(planner, out, settings, _say)
        _warn_of_the_launchs_buckets(args, result.plan)
        print(describe_plan(result.plan))
        print(describe_trials(result.records, winner=result.plan.measured.trial))
        print(f"study {result.study_name} in {result.storage}: {len(result.records)} trials "
              f"({result.new_trials} run now) over {len(result.space)} candidates")
        profile, stored = record_study(source, profile, planner, result)
        steps = [step for record in profile.history for step in record.steps]
        contended = sum(step.contended for step in steps)
        from dsauto.units import counted

        print(f"calibration: {profile.calibration.describe()}; fitted to the {counted(len(steps), 'step')} of "
              f"{counted(len(profile.history), 'study', 'studies')} kept with the profile {stored}"
              + (f" ({contended} measured under CPU contention count less)" if contended else ""))
        written = write_artifacts(result.plan, out, **_config_options(args))
        written += write_trials(result.records, result.plan, out)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _follow_node(args: argparse.Namespace, problem: Problem, settings: Any) -> int:
    """``dsauto tune --trials N --node-rank K`` with K > 0: join node 0's trials until it finishes
    the study (:mod:`dsauto.refine.nodes`). Nothing is profiled or written here but the trials' logs,
    in ``--out``/node-K (so that every node may be given the same --out on a shared filesystem)."""
    from dsauto.profile.launch import clean_stale_launches
    from dsauto.profile.resources import ranks_on_cpu
    from dsauto.refine.study import follow_nodes
    from dsauto.search.planner import Planner

    _check_trial_plans(problem, ranks_on_cpu())
    out = Path(args.out) / f"node-{settings.nodes.node_rank}"
    with _output_folder(out):
        for line in clean_stale_launches():
            _say(line)
        follow_nodes(Planner(problem.model, problem.cluster, problem.train, problem.pins), out, settings, _say)
    return 0


def _check_node_args(args: argparse.Namespace) -> None:
    """The options of trials (where they run, how they are measured and kept) mean nothing without
    --trials: say so, rather than take them silently."""
    given = [flag for flag, value in (("--node-rank", args.node_rank), ("--master-addr", args.master_addr),
                                      ("--master-port", args.master_port), ("--hostfile", args.hostfile)) if value]
    if given and not args.trials:
        verb = "places" if len(given) == 1 else "place"
        raise DsautoError(f"{', '.join(given)} {verb} the ranks of trials on several nodes, but no --trials were "
                          f"asked for; pass --trials N, or drop {', '.join(given)}.")
    given = [flag for flag, default in TRIAL_DEFAULTS.items()
             if getattr(args, flag.lstrip("-").replace("-", "_"), default) != default]
    if given and not args.trials:
        raise DsautoError(f"{', '.join(given)} {'sets' if len(given) == 1 else 'set'} how trials are measured, but no "
                          f"--trials were asked for; pass --trials N, or drop {', '.join(given)}.")


def _cmd_tune(args: argparse.Namespace, write: bool) -> int:
    _check_memory_limit(args)
    if write:
        _check_node_args(args)
    if write and args.trials:
        return _cmd_refine(args)
    if not write:
        _print_plans(*_search(args))
        return 0
    from dsauto.emit.artifacts import check_writable_folder, write_artifacts
    from dsauto.emit.parser_process import start_parser, stop_parser

    check_writable_folder(args.out, "--out")  # before the search, not after it
    start_parser()  # DeepSpeed's import, for the config's validation, runs beside the search
    try:
        with _output_folder(Path(args.out)):  # another tune writing there is refused before the search
            plans, seconds = _search(args)
            _print_plans(plans, seconds)
            written = write_artifacts(plans[0], Path(args.out), **_config_options(args))
    finally:
        stop_parser()  # one that never got its config (the search failed, an interrupt)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _print_plans(plans: list, seconds: float) -> None:
    from dsauto.describe import describe_alternatives, describe_plan

    print(describe_plan(plans[0]))
    if len(plans) > 1:
        print(describe_alternatives(plans))
    print(f"searched in {seconds:.2f} s")


def _cmd_profile(args: argparse.Namespace) -> int:
    from dsauto.api import default_seq_len
    from dsauto.profile.run import current_device, run_profile
    from dsauto.spec.loaders import load_hardware, load_model

    model = load_model(args.model)
    device = current_device()
    hardware = args.hardware or ("h100-80gb" if device.type == "cuda" else "cpu")
    dtype = args.dtype or load_hardware(hardware).dtype
    seq_len = default_seq_len(model, args.seq_len)
    tps = args.tp or tuple(t for t in (1, 2, 4, 8) if model.tp_problem(t) is None)
    for t in tps:
        if (problem := model.tp_problem(t)) is not None:
            raise DsautoError(f"Cannot profile TP {t}: {problem}; pick --tp from "
                              f"{', '.join(str(d) for d in (1, 2, 4, 8) if model.tp_problem(d) is None)}.")

    from dsauto.emit.artifacts import check_writable_folder

    check_writable_folder(args.out, "--out")
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if not distributed and device.type == "cpu":  # launched ranks were checked by their launcher
        from dsauto.profile.resources import check_fits, profiling_rank_bytes

        check_fits(f"Profiling {model.name}", 1,
                   profiling_rank_bytes(model, dtype, seq_len, args.micro_batches, tps),
                   "profile on a machine with a GPU, or with smaller --micro-batches or a shorter --seq-len")
    if distributed:
        import torch.distributed as dist

        from dsauto.profile.run import bind_cpu_rank

        bind_cpu_rank()

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        rank = int(os.environ.get("RANK", "0"))

        def progress(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        if rank == 0:
            progress(f"profiling {model.name} on {device} in {dtype}, sequences of {seq_len} tokens, "
                     f"micro-batches {', '.join(map(str, args.micro_batches))}, TP shards "
                     f"{', '.join(map(str, tps))}")
        profile, path, reused = run_profile(model, dtype, seq_len, args.micro_batches, tps, args.out,
                                            force=args.force, factory=args.factory, warmup=args.warmup,
                                            repeats=args.repeats, progress=progress, engine=args.engine)
        if rank == 0:
            if reused:
                print(f"reused {path} (measured earlier with the same model, device, dtype and "
                      f"versions; --force measures again)")
            else:
                print(f"wrote {path}: {len(profile.layers)} layer measurements, "
                      f"{len(profile.collectives)} collective fits")
    finally:
        if distributed:
            dist.destroy_process_group()
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from dsauto.describe import describe_plan
    from dsauto.errors import DsautoWarning
    from dsauto.plan_io import edited_since_written, plan_id, read_plan

    path = Path(args.path)
    _check_file_kind(path, "explain", (".yaml", ".yml", ".json"),
                     "dsauto explain reads a plan.yaml or a ds_config.json with its dsauto block")
    plan = read_plan(path)
    _check_engine_runs(path, plan)
    if (written := edited_since_written(path, plan)) is not None:
        warnings.warn(f"{path} was edited after dsauto wrote it (it carries plan id {written}, its content is plan "
                      f"{plan_id(plan)}): the predicted time and memory below are those of the plan before the "
                      f"edit; plan it again with dsauto, pinning the edited choices.", DsautoWarning, stacklevel=2)
    if path.suffix == ".json":  # a plan inside a DeepSpeed config: its keys must say the same
        _check_config_keys(path, plan)
    print(describe_plan(plan))
    return 0


def _check_config_keys(path: Path, plan: Any) -> None:
    """Refuses a ``ds_config.json`` whose DeepSpeed keys contradict its own dsauto block, and warns of
    the settings its prediction does not price."""
    from dsauto.engines.deepspeed import config_contradictions, warn_unpriced_settings
    from dsauto.plan_io import PLAN_KEY
    from dsauto.serde import read_data

    config = read_data(path, str(path))
    problems = config_contradictions(config, plan)
    if problems:
        raise DsautoError(f"{path} contradicts its own {PLAN_KEY!r} block: {'; '.join(problems)}; write it "
                          f"again with dsauto, or restore the values it wrote.")
    warn_unpriced_settings(config, plan, f"{path}: its")


def _cmd_validate(args: argparse.Namespace) -> int:
    """``dsauto validate``: DeepSpeed's parser on the config, as on its data-parallel ranks; a config
    with a dsauto block is also checked against it (and against the other files of its set)."""
    from dsauto.emit.ds_config import validate_ds_config
    from dsauto.plan_io import PLAN_KEY, check_artifact_set, plan_from_data
    from dsauto.serde import read_data

    path = Path(args.path)
    _check_file_kind(path, "validate", (".json",), "dsauto validate checks a ds_config.json")
    check_artifact_set(path)
    config = read_data(path, str(path))
    if not isinstance(config, dict):
        raise DsautoError(f"{path} must hold a JSON object, got {type(config).__name__}.")
    if PLAN_KEY in config:
        plan = plan_from_data(config[PLAN_KEY], f"the {PLAN_KEY} block of {path}")
        if plan.engine != "deepspeed":
            raise DsautoError(f"{path} carries a {plan.engine} plan, which runs from megatron_args.txt, not from this "
                              f"config (dsauto.deepspeed.initialize refuses it); validate the ds_config.json of a "
                              f"plan made with --engine deepspeed, or explain this one.")
        _check_config_keys(path, plan)
        _check_engine_runs(path, plan)
        if args.world_size is not None and args.world_size != plan.dp:
            raise DsautoError(f"--world-size {args.world_size} is not the data-parallel size {plan.dp} of the plan "
                              f"in {path}; leave --world-size out, or re-plan for it.")
        dp, why = plan.dp, "its plan's"
    elif args.world_size is not None:
        dp, why = args.world_size, "--world-size"
    else:
        dp, why = _batch_world_size(config, path)
    validate_ds_config(config, dp=dp)
    print(f"{path}: DeepSpeed accepts this config (data-parallel size {dp}, {why})")
    return 0


def _check_file_kind(path: Path, command: str, suffixes: tuple[str, ...], what: str) -> None:
    """Refuses a file of another kind than ``command`` reads (by its name), saying which command reads it."""
    if path.suffix.lower() in suffixes:
        return
    other = {".txt": "megatron_args.txt is a Megatron-LM launch: price it with dsauto plan --megatron-args",
             ".yaml": "plan.yaml is read by dsauto explain", ".yml": "plan.yaml is read by dsauto explain",
             ".png": "plan.png is a picture of the plan"}.get(path.suffix.lower(), "")
    raise DsautoError(f"{what}, and {path} is {'not one' if not other else 'not one; ' + other}.")


def _check_engine_runs(path: Path, plan: Any) -> None:
    """Refuses a plan whose degrees its engine cannot run (a hand-edited tp=2 DeepSpeed plan)."""
    from dsauto.engines.rules import (
        context_parallel_refusal,
        deepspeed_bf16_pipeline_refusal,
        expert_parallel_refusal,
        offload_refusal,
        refusal,
        virtual_stage_refusal,
    )

    reason = (refusal(plan.engine, plan.dims, plan.zero_stage)  # the bf16 pipeline is said apart, below
              or virtual_stage_refusal(plan.engine, plan.pp, plan.virtual_stages, plan.grad_accum)
              or context_parallel_refusal(plan.engine, plan.cp, plan.seq_len, plan.flash_attention,
                                          heads=plan.model.num_attention_heads, kv_heads=plan.model.kv_heads,
                                          pp=plan.pp, learned_positions=plan.model.learned_positions)
              or offload_refusal(plan.engine, plan.dims, plan.zero_stage, plan.offload,
                                 fp8_param_gather_recipe=plan.fp8_recipe if plan.fp8_param_gather else None)
              or expert_parallel_refusal(plan.engine, plan.dims, plan.zero_stage, plan.sequence_parallel,
                                         plan.model.num_experts, plan.model.expert_ffn_hidden_size))
    if bf16 := deepspeed_bf16_pipeline_refusal(plan.engine, plan.dims, plan.zero_stage, plan.dtype):
        raise DsautoError(f"{path}: its ZeRO stage 0 is not what DeepSpeed runs: {bf16}, so its memory and time are "
                          f"not this plan's; re-plan with dsauto, which plans it as ZeRO stage 1.")
    if reason:
        raise DsautoError(f"{path}: its {plan.engine} plan cannot run: {reason}; re-plan with dsauto.")


def _batch_world_size(config: dict[str, Any], path: Path) -> tuple[int, str]:
    """The data-parallel size a plain config's batch keys imply: train_batch_size / (micro-batch x
    accumulation) when all three are whole numbers, else 1 (DeepSpeed derives the missing key)."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    values = [config.get(k) for k in keys]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return 1, "as on one rank; give --world-size N for more"
    train, micro, accum = values
    if train % (micro * accum):
        raise DsautoError(f"{path}: train_batch_size {train} is not a multiple of train_micro_batch_size_per_gpu "
                          f"{micro} x gradient_accumulation_steps {accum}, so no number of ranks satisfies "
                          f"DeepSpeed's batch equation; fix one of the three.")
    return train // (micro * accum), "from its batch keys"


def _format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    line: str | None = None) -> str:
    """A warning as one line for people, not a source location; one of another package (torch's,
    Transformer Engine's, while ``dsauto profile`` builds a model) says whose it is."""
    from dsauto.errors import DsautoWarning

    if issubclass(category, DsautoWarning):
        return f"dsauto: warning: {message}\n"
    parts = Path(filename).parts
    package = next((parts[i + 1] for i in range(len(parts) - 1) if parts[i] in ("site-packages", "dist-packages")),
                   Path(filename).stem)
    return f"warning from {package}: {category.__name__}: {' '.join(str(message).split())}\n"


def _negative_values_attached(argv: list[str]) -> list[str]:
    """``argv`` with a value that starts with a minus and a digit attached to the option before it
    (``--memory-limit -5GiB`` as ``--memory-limit=-5GiB``): argparse takes such a word for an option
    and says the option lacks its value, where the value's own check says what is wrong with it."""
    out: list[str] = []
    for word in argv:
        if out and re.match(r"-\d", word) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    # The CLI uses DeepSpeed only to parse configs; its CPU accelerator spares the auto-detection
    # (and its warning on machines without a GPU). Training processes choose their own.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.formatwarning = _format_warning
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    stdout = sys.stdout
    sys.stdout = _ReaderMayLeave(stdout)  # `dsauto plan | head`: the rest of the run goes on quietly
    args = None
    try:
        args = build_parser().parse_args(_negative_values_attached(sys.argv[1:] if argv is None else list(argv)))
        if args.command == "profile":
            return _cmd_profile(args)
        if args.command in ("tune", "plan"):
            return _cmd_tune(args, write=args.command == "tune")
        if args.command == "explain":
            return _cmd_explain(args)
        return _cmd_validate(args)
    except DsautoError as exc:
        print(f"dsauto: error: {in_launch_spelling(str(exc), getattr(args, 'launch_spelled', {}))}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("dsauto: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # the machine's doing: a full disk, a file gone or unreadable meanwhile
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"dsauto: error: {exc.strerror or exc}{where}; check the file system and run again.", file=sys.stderr)
        return EXIT_USER_ERROR
    except Exception as exc:  # noqa: BLE001 - a bug in dsauto: one line, the traceback on request
        if os.environ.get("DSAUTO_DEBUG"):
            raise
        text = " ".join(str(exc).split())[:300]
        print(f"dsauto: internal error: {type(exc).__name__}: {text}; please report it with the command "
              f"(DSAUTO_DEBUG=1 shows the traceback).", file=sys.stderr)
        return EXIT_INTERNAL_ERROR
    finally:
        sys.stdout.flush()
        sys.stdout = stdout


class _ReaderMayLeave:
    """``sys.stdout`` that stops writing, without an error, once the reader of its pipe has gone
    (``dsauto tune ... | head`` still writes its artifacts, and prints no BrokenPipeError)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._leave()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._leave()

    def _leave(self) -> None:
        self._gone = True
        # What is still buffered goes nowhere, so the interpreter's own flush at exit cannot fail.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _terminate(signum: int, frame) -> None:
    # A terminated tune stops like an interrupted one: the running trial's processes are killed and
    # the trial is marked interrupted, so a rerun measures it again.
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
