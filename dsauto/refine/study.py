"""``dsauto tune --trials N``: an Optuna study that measures real steps of the search's best plans.

The study lives in persistent storage (SQLite in the output folder by default, or any Optuna RDB
URL), named after the problem (model, cluster, workload, pins, trial settings), so that

- a rerun after an interruption continues the same study: finished trials are kept and never run
  again; the trial that was cut off is marked ``interrupted`` and its candidate is free again;
- several machines pointed at one storage share the study: each runs trials on its own ranks, the
  sampler never proposes a candidate another machine is measuring, and ``--trials`` is the total
  over all of them (heartbeats fail the trials of a machine that died).

The first run stores the space (the base plans and the candidates' knobs) in the study, so that
every later run, on any machine, refines exactly the same space even though calibration changes the
search's own ranking. When the budget is spent, the measured steps calibrate the cost model (saved
with the profile) and the fastest feasible measured plan is the result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import optuna
from optuna.trial import TrialState

from dsauto.cost.calibration import Calibration
from dsauto.errors import DsautoError, DsautoWarning
from dsauto.plan import Measurement, Plan
from dsauto.profile.launch import process_alive
from dsauto.profile.store import MeasuredStep
from dsauto.refine.calibrate import CONTENDED_WEIGHT, fit_calibration
from dsauto.refine.nodes import (
    NodeSettings,
    check_nodes,
    driving,
    explain_hang,
    follow,
    publish,
    trial_rendezvous,
)
from dsauto.refine.runner import TrialOutcome, TrialSettings, run_trial
from dsauto.refine.sampler import (
    CONTENDED,
    OTHER_LOAD,
    PEAK,
    STATUS,
    STEP,
    CostModelSampler,
    key_of,
    knob_rules,
    suggest,
    timed_out_at,
    trial_observation,
)
from dsauto.refine.space import Candidate, Knobs, base_plans, candidates, plan_label
from dsauto.search.planner import Planner
from dsauto.search.space import Constraints
from dsauto.serde import content_dict
from dsauto.units import format_bytes, format_seconds

STUDY_FILE = "dsauto-study.db"
"""Default storage: an SQLite file in the output folder."""
FINISHED = ("complete", "infeasible", "failed")
"""Trial statuses that count towards the budget (``interrupted`` and ``outside`` do not)."""
HEARTBEAT_SECONDS = 30
"""A running trial's machine writes a heartbeat this often (RDB storages) ..."""
GRACE_SECONDS = 120
"""... and after this long without one, any machine may fail the trial as stale."""

Say = Callable[[str], None]


@dataclass(frozen=True)
class TuneSettings:
    """What ``dsauto tune --trials`` spends and where it keeps the study."""

    trials: int
    """Finished trials the study should have in total (over every run and machine)."""
    top_plans: int = 4
    """Strategies of the search the space starts from (micro-batch neighbours of the best are added)."""
    storage: str | None = None
    """Optuna storage URL; None: SQLite in the output folder."""
    study_name: str | None = None
    """None: named after the problem, so reruns resume it."""
    trial: TrialSettings = field(default_factory=TrialSettings)
    """How each trial runs."""
    nodes: NodeSettings = field(default_factory=NodeSettings)
    """This machine's place when the plans span nodes (:mod:`dsauto.refine.nodes`)."""


@dataclass(frozen=True)
class TrialRecord:
    """One trial of the study, for the table and the plot."""

    number: int
    label: str
    """The candidate (base plan and knobs)."""
    status: str
    """``complete``, ``infeasible``, ``failed``, ``interrupted``, ``running`` or ``outside``."""
    reason: str
    predicted_seconds: float | None
    predicted_peak_bytes: int | None
    measured_seconds: float | None
    measured_peak_bytes: int | None
    wall_seconds: float | None
    host: str


@dataclass(frozen=True)
class TuneResult:
    """The outcome of a refined tune."""

    plan: Plan
    """The fastest feasible measured plan, with its prediction and measurement."""
    records: tuple[TrialRecord, ...]
    calibration: Calibration
    """Correction factors fitted to every measured step of the study."""
    study_name: str
    storage: str
    new_trials: int
    """Trials this run measured (the rest were in the study already)."""
    space: tuple[Candidate, ...]
    """Every candidate of the study."""
    winner: Candidate
    """The candidate ``plan`` is."""
    steps: tuple[MeasuredStep, ...] = ()
    """Every step the study measured (this run and earlier ones), to keep with the profile."""


CHOICE_WAIT_SECONDS = 30.0
"""How long a trial waits for the earlier running trials of other machines to record their
candidates before it checks for a clash (a dead machine's trial is given up on after it)."""


def _await_earlier_choices(study: optuna.Study, number: int) -> None:
    """Waits until every running trial numbered below ``number`` has recorded its candidate.

    Two machines that pick the same candidate at once settle it by trial number: the later one steps
    aside. That needs the later one to see the earlier one's choice, which another machine writes
    just after it creates its trial; checking before it is written let both measure the candidate
    on a loaded machine. Waiting for it (at most :data:`CHOICE_WAIT_SECONDS`) closes that gap."""
    deadline = time.monotonic() + CHOICE_WAIT_SECONDS
    while time.monotonic() < deadline:
        pending = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                   if t.number < number and "plan" not in t.params]
        if not pending:
            return
        time.sleep(0.2)


def study_name_for(planner: Planner, settings: TuneSettings) -> str:
    """A name that is the same for the same problem and trial settings, and differs otherwise."""
    trial = settings.trial
    key = json.dumps([content_dict(planner.model), content_dict(planner.cluster), content_dict(planner.train),
                      content_dict(planner.pins), settings.top_plans, trial.steps, trial.warmup_steps,
                      trial.memory_steps, trial.script, list(trial.script_args)], sort_keys=True, default=str)
    return f"dsauto-{planner.model.name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def open_storage(url: str, attempts: int = 5) -> optuna.storages.BaseStorage:
    """An Optuna storage for ``url`` with heartbeats (RDB URLs), or a clear error. Machines that
    start together may race to create the schema of a new database; the loser retries. SQLite in
    memory is refused: the study would be gone when dsauto exits, its steps kept with the profile
    but never resumable or shared."""
    if url.rstrip("/") in ("sqlite:", "sqlite:/", "sqlite://") or url.endswith(":memory:"):
        raise DsautoError(f"--storage {url} is a database in memory, gone when dsauto exits, so its study could be "
                          f"neither resumed nor shared; give a file (sqlite:///study.db) or a server URL.")
    for attempt in range(attempts):
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna's terms
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_SECONDS,
                                                  grace_period=GRACE_SECONDS)
        except Exception as exc:  # noqa: BLE001 - SQLAlchemy reports bad URLs and races in many ways
            # SQLite: "UNIQUE constraint failed"; PostgreSQL: "duplicate key value violates unique
            # constraint ... already exists" (two machines creating the tables' types at once).
            text = str(exc).lower()
            racing = "unique constraint" in text or "already exists" in text
            if racing and attempt + 1 < attempts:
                time.sleep(0.5 * (attempt + 1))
                continue
            if isinstance(exc, ImportError):  # Optuna's, caused by the driver's import
                raise DsautoError(f"Cannot open the study storage {url}: its database driver is not installed "
                                  f"({exc.__cause__ or exc}); for postgresql:// URLs install dsauto[postgres] "
                                  f"(psycopg).") from None
            raise DsautoError(f"Cannot open the study storage {url}: {str(exc).splitlines()[0]}; pass an "
                              f"Optuna RDB URL such as sqlite:///study.db or postgresql://host/db to --storage.") from None
    raise AssertionError("unreachable")
    return True


def _free_interrupted(study: optuna.Study, storage: optuna.storages.BaseStorage, say: Say) -> None:
    """Trials left running by a tune on this machine that is gone: fail them as interrupted."""
    host = socket.gethostname()
    study_id = storage.get_study_id_from_name(study.study_name)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get("host") == host and not process_alive(int(t.user_attrs.get("pid", -1))):
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
            try:
                storage.set_trial_user_attr(trial_id, STATUS, "interrupted")
                storage.set_trial_state_values(trial_id, TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # another run on this machine, or a heartbeat check, ended it first
            say(f"trial {t.number} was cut off by an earlier run; its candidate will be measured again")


def _say_timed_out(study: optuna.Study, timeout: float, say: Say) -> None:
    """Names the trials that failed only by a shorter timeout than this run's (``--trial-timeout``),
    whose candidates this run measures again (:meth:`CostModelSampler.taken`)."""
    for t in study.get_trials(deepcopy=False):
        limit = timed_out_at(t.user_attrs.get(STATUS), t.user_attrs.get("reason"))
        if limit is not None and limit < timeout:
            say(f"trial {t.number} ran out of its {limit:g} s; with --trial-timeout {timeout:g} its candidate will "
                f"be measured again")


def _space(study: optuna.Study, planner: Planner, settings: TuneSettings, say: Say) -> list[Candidate]:
    """The study's space: stored by its first run, else searched now and stored."""
    problem = study_name_for(planner, settings)  # this command's problem, however the study is named
    stored = study.user_attrs.get("base_plans")
    if stored is not None:
        plans = [Plan.from_dict(p, f"the base plans of study {study.study_name}") for p in stored]
        made_for = study.user_attrs.get("problem")
        if made_for is not None and made_for != problem:
            engines = sorted({p.engine for p in plans})
            raise DsautoError(f"Study {study.study_name} measures another problem than this command's (its plans are "
                              f"{' and '.join(engines)} plans of {plans[0].model.name} on {plans[0].world_size} "
                              f"devices, global batch {plans[0].global_batch}, or other pins or trial settings); "
                              f"give another --study-name, or leave it out to use this problem's own study.")
        keys = set(study.user_attrs.get("candidates", []))
        space = [c for c in candidates(planner, plans, memory_slack=float("inf")) if key_of(c.knobs) in keys]
        say(f"resuming study {study.study_name}: {len(space)} candidates around {len(plans)} plans")
        return space
    plans = base_plans(planner, settings.top_plans)
    space = candidates(planner, plans)
    study.set_user_attr("base_plans", [p.to_dict() for p in plans])
    study.set_user_attr("problem", problem)
    study.set_user_attr("candidates", [key_of(c.knobs) for c in space])
    say(f"space: {len(space)} candidates around {len(plans)} plans "
        f"({', '.join(plan_label(p) for p in plans)})")
    return space


def _finished(study: optuna.Study) -> int:
    return sum(t.user_attrs.get(STATUS) in FINISHED for t in study.get_trials(deepcopy=False))


def _record(t: optuna.trial.FrozenTrial) -> TrialRecord:
    a = t.user_attrs
    status = a.get(STATUS, "running" if t.state == TrialState.RUNNING else "interrupted")
    return TrialRecord(
        number=t.number, label=Knobs.from_params(t.params).describe() if "plan" in t.params else "?",
        status=status, reason=a.get("reason", ""), predicted_seconds=a.get("predicted_seconds"),
        predicted_peak_bytes=a.get("predicted_peak_bytes"), measured_seconds=a.get(STEP),
        measured_peak_bytes=a.get(PEAK), wall_seconds=a.get("wall_seconds"), host=a.get("host", ""))


def check_trials(planner: Planner, settings: TuneSettings) -> None:
    """Raises DsautoError when the study cannot run as asked (checked before any profiling)."""
    if settings.trials < 1:
        raise DsautoError(f"--trials must be at least 1, got {settings.trials}.")
    check_nodes(planner.cluster.nodes, settings.trial.launcher, settings.nodes, settings.storage)
    pins = planner.pins
    if pins.fp8:
        from dsauto.profile.resources import ranks_on_cpu

        if ranks_on_cpu():
            raise DsautoError("FP8 plans train through Transformer Engine on GPUs with FP8 tensor cores, and these "
                              "trials run on CPU processes; run the trials on H100 or H200 GPUs, or drop --trials "
                              "to keep the predicted plan.")
        if settings.trial.script is None:
            raise DsautoError("FP8 plans train through Transformer Engine's layers, and the built-in trial harness "
                              "builds Megatron-core's local layers, which have no FP8; measure with your own "
                              "Transformer Engine script (--script train.py), or drop --trials.")
    if pins.engine == "deepspeed" and (pins.tp or 1) > 1:
        raise DsautoError(f"DeepSpeed plans have no tensor parallelism, but --tp {pins.tp} was pinned with "
                          f"--engine deepspeed; use --engine megatron (trials then measure through "
                          f"Megatron-core), or unpin it.")


def _model_parallel_pinned(pins: Constraints) -> bool:
    return (pins.tp or 1) > 1 or (pins.pp or 1) > 1


def trial_pins(pins: Constraints) -> Constraints:
    """The pins of the plans trials measure. Megatron-core plans (tp and pp searched, measured by
    :mod:`dsauto.profile.megatron_steps` or a Megatron-core script) with ``--engine megatron``, or
    when the engine is left open and ``--tp`` / ``--pp`` pin model parallelism; otherwise DeepSpeed
    plans, measured through the dsauto hook: data-parallel (tp = pp = 1), or under DeepSpeed's
    pipeline engine where ``--engine deepspeed --pp N`` pins it."""
    if pins.engine == "megatron" or (pins.engine is None and _model_parallel_pinned(pins)):
        return replace(pins, engine="megatron")
    return replace(pins, tp=1, pp=pins.pp if pins.engine == "deepspeed" and pins.pp else 1, engine="deepspeed")


def _measured_planner(planner: Planner) -> Planner:
    """The planner of what trials measure (:func:`trial_pins`)."""
    return Planner(planner.model, planner.cluster, planner.train, trial_pins(planner.pins), planner.profile,
                   planner.calibration)


def trials_study_name(planner: Planner, settings: TuneSettings) -> str:
    """The study's name: ``--study-name``, else derived from the problem the trials measure (the
    same on every node and every rerun)."""
    return settings.study_name or study_name_for(_measured_planner(planner), settings)


@contextlib.contextmanager
def leading_nodes(planner: Planner, settings: TuneSettings) -> Iterator[None]:
    """Node 0 of a tune whose trials span nodes through torchrun: its presence in the study while
    the block runs, from before profiling (:func:`dsauto.refine.nodes.driving`); nothing otherwise."""
    if planner.cluster.nodes == 1 or settings.nodes.hostfile is not None or settings.storage is None:
        yield
        return
    storage = open_storage(settings.storage)
    name = trials_study_name(planner, settings)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True)
    with driving(storage, name, planner.cluster.nodes):
        yield


def follow_nodes(planner: Planner, out_dir: Path | str, settings: TuneSettings, say: Say = print) -> None:
    """A node other than node 0: join each trial node 0 runs, until it finishes the study
    (:func:`dsauto.refine.nodes.follow`)."""
    check_trials(planner, settings)
    follow(open_storage(settings.storage), trials_study_name(planner, settings), settings.trial,
           settings.nodes, out_dir, say)


def refine(planner: Planner, out_dir: Path | str, settings: TuneSettings, say: Say = print) -> TuneResult:
    """Run the study until it has ``settings.trials`` finished trials (or no promising candidate is
    left) and return the fastest feasible measured plan. ``say`` gets one line per event."""
    check_trials(planner, settings)
    cluster = planner.cluster
    if planner.pins.engine is None and _model_parallel_pinned(planner.pins):
        say(f"--tp {planner.pins.tp or 1} --pp {planner.pins.pp or 1} need Megatron-core's model parallelism, "
            f"so the trials measure Megatron-core plans, as with --engine megatron (unpin them to measure "
            f"DeepSpeed plans)")
    planner = _measured_planner(planner)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    url = settings.storage or f"sqlite:///{(out / STUDY_FILE).resolve()}"
    storage = open_storage(url)
    name = trials_study_name(planner, settings)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # progress is ours, one line per trial
    study = optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True)
    _free_interrupted(study, storage, say)
    space = _space(study, planner, settings, say)
    _say_timed_out(study, settings.trial.timeout_seconds, say)
    if not space:
        raise DsautoError(f"No plan of the search fits the {format_bytes(cluster.memory_budget_bytes)} "
                          f"budget closely enough to measure; raise --memory-limit.")
    sampler = CostModelSampler(space, planner, retry_timeouts_below=settings.trial.timeout_seconds)
    study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    by_key = {key_of(c.knobs): c for c in space}
    rules = knob_rules(space)
    host, pid = socket.gethostname(), os.getpid()

    def objective(trial: optuna.Trial) -> float:
        trial.set_user_attr("host", host)
        trial.set_user_attr("pid", pid)
        try:
            knobs = suggest(trial, rules)
            candidate = by_key.get(key_of(knobs))
            if candidate is None:  # another sampler may propose combinations outside the space
                trial.set_user_attr(STATUS, "outside")
                raise optuna.TrialPruned()
            _await_earlier_choices(study, trial.number)
            if key_of(knobs) in sampler.taken(study, exclude=trial.number, before=trial.number):
                # Another machine picked the same candidate at the same moment; the earlier trial
                # measures it, this one steps aside (not counted) and the loop proposes again.
                trial.set_user_attr(STATUS, "outside")
                raise optuna.TrialPruned()
            pred = candidate.plan.prediction
            trial.set_user_attr("predicted_seconds", pred.step_seconds)
            trial.set_user_attr("predicted_peak_bytes", pred.peak_memory_bytes)
            done = _finished(study) + 1
            say(f"trial {trial.number} ({done}/{settings.trials}) {knobs.describe()}: predicted "
                f"{format_seconds(pred.step_seconds)}, {format_bytes(pred.peak_memory_bytes)}; measuring "
                f"{settings.trial.memory_steps}+{settings.trial.warmup_steps}+{settings.trial.steps} steps "
                f"on {cluster.world_size} ranks")
            rendezvous = trial_rendezvous(cluster.nodes, cluster.devices_per_node, settings.trial.launcher,
                                          settings.nodes)
            if rendezvous is not None and rendezvous.hostfile is None:
                publish(trial, rendezvous, candidate.plan)  # the other nodes start their agents there
            outcome = run_trial(candidate.plan, cluster.devices_per_node, settings.trial,
                                out / "trials" / f"trial-{trial.number}", cluster.memory_budget_bytes,
                                rendezvous=rendezvous, say=lambda line: say("  " + line))
            outcome = explain_hang(outcome, rendezvous)
        except BaseException as exc:
            if not isinstance(exc, optuna.TrialPruned):
                trial.set_user_attr(STATUS, "interrupted")
            raise
        _store(trial, outcome)
        say("  " + _outcome_line(outcome, pred.step_seconds, pred.peak_memory_bytes))
        if outcome.status == "complete":
            return outcome.measurement.step_seconds
        if outcome.status == "infeasible":
            raise optuna.TrialPruned()
        raise TrialFailed(outcome.reason)

    while _finished(study) < settings.trials:
        if sampler.propose(study) is None:
            say(f"no candidate left that is likely to fit and beat the best measured step "
                f"({_finished(study)} of {settings.trials} trials used)")
            break
        study.optimize(objective, n_trials=1, catch=(TrialFailed,))

    trials = study.get_trials(deepcopy=False)
    new_trials = sum(t.user_attrs.get("host") == host and t.user_attrs.get("pid") == pid
                     and t.user_attrs.get(STATUS) in FINISHED for t in trials)
    records = tuple(_record(t) for t in trials if t.user_attrs.get(STATUS) != "outside")
    observed = sampler.observations(study)
    calibration = fit_calibration(planner, observed) if observed else (planner.calibration or Calibration())
    feasible = [t for t in trials if t.user_attrs.get(STATUS) == "complete" and t.state == TrialState.COMPLETE]
    if not feasible:
        counts = {s: sum(r.status == s for r in records) for s in ("infeasible", "failed")}
        hung = sum(timed_out_at(r.status, r.reason) is not None for r in records)
        remedies = (["raise --memory-limit"] if counts["infeasible"] else []) + (
            [f"raise --trial-timeout (now {settings.trial.timeout_seconds:g} s)"] if hung else []) + (
            ["fix the failures"] if counts["failed"] > hung else [])
        raise DsautoError(f"None of the {len(records)} trials measured a plan within the "
                          f"{format_bytes(cluster.memory_budget_bytes)} budget ({counts['infeasible']} over it, "
                          f"{counts['failed']} failed{f', {hung} of them timed out' if hung else ''}; logs in "
                          f"{out / 'trials'}); {' or '.join(remedies) + ' and rerun' if remedies else 'rerun'}.")
    best = min(feasible, key=lambda t: t.value)
    if unfair := contended_comparison(feasible, best):
        warnings.warn(unfair, DsautoWarning, stacklevel=2)
    winner = by_key[key_of(Knobs.from_params(best.params))]
    tokens = winner.plan.global_batch * winner.plan.seq_len
    measured = Measurement(step_seconds=best.value, tokens_per_second=tokens / best.value,
                           peak_memory_bytes=int(best.user_attrs[PEAK]), steps=settings.trial.steps,
                           trial=best.number, study=name)
    steps = tuple(_measured_step(t, by_key) for t in trials if trial_observation(t, by_key) is not None)
    return TuneResult(plan=replace(winner.plan, measured=measured), records=records, calibration=calibration,
                      study_name=name, storage=url, new_trials=new_trials, space=tuple(space), winner=winner,
                      steps=steps)


def contended_comparison(feasible: Sequence[optuna.trial.FrozenTrial], best: optuna.trial.FrozenTrial) -> str | None:
    """The sentence saying that the trials the winner ``best`` was chosen among were not measured
    alike, or None: a losing trial measured while other processes kept the CPU busy ran slower than
    it runs, so it may have lost unfairly (a contended winner beat the others all the same)."""
    contended = [t.number for t in feasible if t.user_attrs.get(CONTENDED) and t.number != best.number]
    if not contended:
        return None
    which = f"trial{'s' if len(contended) > 1 else ''} {', '.join(map(str, contended))}"
    return (f"trial {best.number} measured the fastest step of {len(feasible)}, but {which} ran while other "
            f"processes kept the CPU busy and may run faster than measured; rerun the study on an idle machine "
            f"to compare them fairly.")


def _measured_step(trial: optuna.trial.FrozenTrial, by_key: dict[str, Candidate]) -> MeasuredStep:
    a = trial.user_attrs
    candidate = by_key[key_of(Knobs.from_params(trial.params))]
    return MeasuredStep(plan=candidate.plan.to_dict(), step_seconds=float(a[STEP]), peak_bytes=int(a[PEAK]),
                        other_load=float(a.get(OTHER_LOAD, 0.0)), loadavg=float(a.get("loadavg", 0.0)),
                        cores=int(a.get("cores", 0)), contended=bool(a.get(CONTENDED, False)))


class TrialFailed(Exception):
    """A trial that crashed, ran out of memory or hung (the reason is in the trial's attributes)."""


def _store(trial: optuna.Trial, outcome: TrialOutcome) -> None:
    trial.set_user_attr(STATUS, outcome.status)
    trial.set_user_attr("reason", outcome.reason)
    trial.set_user_attr("wall_seconds", outcome.wall_seconds)
    trial.set_user_attr("log", outcome.log)
    trial.set_user_attr(OTHER_LOAD, outcome.other_load)
    trial.set_user_attr("loadavg", outcome.loadavg)
    trial.set_user_attr("cores", os.cpu_count() or 1)
    trial.set_user_attr(CONTENDED, outcome.contended)
    if outcome.measurement is not None:
        trial.set_user_attr(STEP, outcome.measurement.step_seconds)
        trial.set_user_attr(PEAK, outcome.measurement.peak_bytes)


def _off(predicted: float, measured: float) -> str:
    """How far a prediction is from what was measured, in words: "12% low", "3% high", "exact"."""
    error = (predicted - measured) / measured
    return "exact" if round(error, 2) == 0 else f"{abs(error):.0%} {'low' if error < 0 else 'high'}"


def _outcome_line(outcome: TrialOutcome, predicted_seconds: float, predicted_peak: int) -> str:
    wall = f"{outcome.wall_seconds:.0f} s"
    if outcome.measurement is None:
        return f"{outcome.status}: {outcome.reason} ({wall}; log {outcome.log})"
    m = outcome.measurement
    text = (f"{outcome.status}: step {format_seconds(m.step_seconds)} (predicted {format_seconds(predicted_seconds)}, "
            f"{_off(predicted_seconds, m.step_seconds)}), peak {format_bytes(m.peak_bytes)} (predicted "
            f"{format_bytes(predicted_peak)}, {_off(predicted_peak, m.peak_bytes)}), {wall}")
    if outcome.contended:
        text += (f"; measured under contention (other processes kept {outcome.other_load:.1f} cores busy), so "
                 f"it counts {CONTENDED_WEIGHT:g} of a step in the calibration")
    return text + (f"; {outcome.reason}" if outcome.reason else "")

