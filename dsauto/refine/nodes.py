"""Trials of a plan that spans nodes: node 0 drives the study, the other nodes follow it.

With torchrun, every node runs the same ``dsauto tune --trials N --nodes N_NODES --master-addr A
--node-rank K --storage URL`` (under Slurm: one task per node, ``--node-rank $SLURM_NODEID``):

- **Node 0** (the driver) runs the Optuna study as on one machine. Before each trial it publishes
  the trial's :class:`~dsauto.refine.launchers.Rendezvous` (node 0's address, a free port) and the
  trial's plan in the trial's user attributes, then starts its torchrun agent, whose rank 0 writes
  the measurement (the slowest rank's time, the largest rank's memory, over every node). While it
  runs, it writes a heartbeat in the study's ``driver`` attribute, from before profiling to the end.
- **Every other node** (a follower) opens the study, and for each trial node 0 publishes, starts
  its own torchrun agent with its node rank at that rendezvous. It records nothing in the study:
  the trial and its result are node 0's. It ends its agent when node 0 ends the trial (done, failed
  or timed out), after the trial's timeout, and when node 0 is gone; it ends itself when node 0
  has finished the study, and with one clear sentence when node 0 has not been heard from for
  ``--driver-timeout`` seconds (or, on the same host, when node 0's process is gone).

With DeepSpeed's launcher and a hostfile, node 0 alone runs ``dsauto tune``: the launcher starts
the other nodes' ranks over ssh (:mod:`dsauto.refine.launchers`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from dsauto.emit.ds_config import ds_config
from dsauto.errors import DsautoError
from dsauto.plan import Plan
from dsauto.profile.launch import free_port, launch, process_alive, remove_shared_memory, stop
from dsauto.refine.launchers import Launcher, Rendezvous
from dsauto.refine.runner import TrialOutcome, TrialSettings, launch_env, trial_command
from dsauto.serde import from_dict, to_dict, write_json

DRIVER = "driver"
"""Study attribute where node 0 writes who it is, its state and its heartbeat."""
RENDEZVOUS = "rendezvous"
"""Trial attribute where node 0 publishes where the trial's ranks meet ..."""
TRIAL_PLAN = "trial_plan"
"""... and the plan they train."""
BEAT_SECONDS = 5.0
"""Node 0 writes its heartbeat this often."""
POLL_SECONDS = 1.0
"""A follower reads the study this often."""
LINGER_SECONDS = 30.0
"""After node 0 has ended a trial, a follower's agent gets this long to end on its own."""

Say = Callable[[str], None]


@dataclass(frozen=True)
class NodeSettings:
    """Where this machine stands in a tune whose plans span nodes (``--nodes`` above 1)."""

    node_rank: int = 0
    """This node's place (``--node-rank``); 0 drives the study, the others follow it."""
    master_addr: str | None = None
    """Node 0's address, reachable from every node (``--master-addr``)."""
    master_port: int | None = None
    """Port of each trial's rendezvous on node 0 (``--master-port``); None: a free one per trial."""
    hostfile: str | None = None
    """DeepSpeed's hostfile (``--hostfile``): its launcher then starts every node from node 0."""
    driver_timeout_seconds: float = 120.0
    """A follower gives up when node 0 has not been heard from for this long (``--driver-timeout``)."""


def check_nodes(nodes: int, launcher: Launcher, node: NodeSettings, storage: str | None) -> None:
    """Raises DsautoError when the trials of a plan over ``nodes`` nodes cannot run as asked."""
    placing = [flag for flag, given in (("--node-rank", node.node_rank != 0), ("--master-addr", node.master_addr),
                                        ("--master-port", node.master_port), ("--hostfile", node.hostfile)) if given]
    if nodes == 1:
        if placing:
            verb = "places" if len(placing) == 1 else "place"
            raise DsautoError(f"{', '.join(placing)} {verb} a trial's ranks on several nodes, but --nodes is 1; "
                              f"pass --nodes with the number of nodes, or drop {', '.join(placing)}.")
        return
    if not 0 <= node.node_rank < nodes:
        raise DsautoError(f"--node-rank {node.node_rank} is not one of the {nodes} nodes (0 to {nodes - 1}).")
    if launcher == "deepspeed":
        if node.hostfile is None:
            raise DsautoError(f"A trial over {nodes} nodes with --launcher deepspeed needs --hostfile FILE "
                              f"(DeepSpeed's launcher starts the other nodes over passwordless ssh); or use "
                              f"--launcher torchrun and run `dsauto tune` on every node with --node-rank.")
        hosts = _hostfile_hosts(node.hostfile)
        if len(hosts) < nodes:
            raise DsautoError(f"The hostfile {node.hostfile} lists {len(hosts)} host"
                              f"{'s' if len(hosts) != 1 else ''} but --nodes is {nodes}; list one "
                              f"`host slots=N` line per node.")
        if node.node_rank != 0:
            raise DsautoError(f"With --hostfile, DeepSpeed's launcher starts every node from node 0, so run "
                              f"`dsauto tune` on node 0 only (got --node-rank {node.node_rank}).")
        return
    if node.hostfile is not None:
        raise DsautoError("--hostfile is read by DeepSpeed's launcher; pass --launcher deepspeed with it, or "
                          "drop it and run `dsauto tune` on every node with --node-rank and --master-addr.")
    if not node.master_addr:
        raise DsautoError(f"A trial over {nodes} nodes starts torchrun on every node: run `dsauto tune` on each "
                          f"with --node-rank K (0 to {nodes - 1}) and --master-addr set to node 0's address, "
                          f"or use --launcher deepspeed --hostfile FILE on node 0 alone.")
    if storage is None:
        raise DsautoError(f"The {nodes} nodes of a tune share its study: pass --storage with a database every "
                          f"node reaches (postgresql://host/db, or sqlite:////shared/folder/study.db).")


def _hostfile_hosts(path: str) -> list[str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise DsautoError(f"Cannot read the hostfile {path} ({exc.strerror or exc}); pass DeepSpeed's "
                          f"hostfile (`host slots=N` lines) to --hostfile.") from None
    return [line.split()[0] for line in lines if line.strip() and not line.lstrip().startswith("#")]


def trial_rendezvous(nodes: int, ranks_per_node: int, launcher: Launcher,
                     node: NodeSettings) -> Rendezvous | None:
    """Where the next trial's ranks meet (node 0 hosts it), or None for a single-node plan."""
    if nodes == 1:
        return None
    port = node.master_port or free_port()
    if launcher == "deepspeed":  # without --master-addr, DeepSpeed's launcher finds the first host's
        return Rendezvous(nodes, ranks_per_node, node.master_addr or "", port, 0, node.hostfile)
    return Rendezvous(nodes, ranks_per_node, node.master_addr or "", port, 0)


def publish(trial: optuna.Trial, rendezvous: Rendezvous, plan: Plan) -> None:
    """Node 0: tell the other nodes where the trial's ranks meet and what they train."""
    trial.set_user_attr(TRIAL_PLAN, plan.to_dict())
    trial.set_user_attr(RENDEZVOUS, to_dict(rendezvous))  # last: a follower starts once it is there


def explain_hang(outcome: TrialOutcome, rendezvous: Rendezvous | None) -> TrialOutcome:
    """Node 0's outcome of a trial, with a hung trial's likely cause when it spans nodes: an agent
    waits at the rendezvous until every node has joined."""
    if rendezvous is None or not outcome.reason.startswith("hung"):
        return outcome
    how = ("is every host of the hostfile reachable over ssh?" if rendezvous.hostfile is not None else
           f"did node{' 1' if rendezvous.nodes == 2 else f's 1 to {rendezvous.nodes - 1}'} run `dsauto tune` with "
           f"--node-rank and the same --storage, and reach {rendezvous.master_addr}:{rendezvous.master_port}?")
    return replace(outcome, reason=f"{outcome.reason} on {rendezvous.nodes} nodes ({how})")


@contextlib.contextmanager
def driving(storage: optuna.storages.BaseStorage, study_name: str, nodes: int) -> Iterator[None]:
    """Node 0's presence in the study while the block runs: a heartbeat every :data:`BEAT_SECONDS`,
    then ``finished`` (or ``stopped`` with the reason), so that the followers end with it."""
    study_id = storage.get_study_id_from_name(study_name)
    info: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "run": uuid.uuid4().hex,
                            "nodes": nodes, "state": "running", "beat": 0, "reason": ""}
    storage.set_study_user_attr(study_id, DRIVER, dict(info))
    done = threading.Event()

    def beat() -> None:
        while not done.wait(BEAT_SECONDS):
            info["beat"] += 1
            with contextlib.suppress(Exception):  # a busy database misses one beat, not the study
                storage.set_study_user_attr(study_id, DRIVER, dict(info))

    thread = threading.Thread(target=beat, name="dsauto-driver-heartbeat", daemon=True)
    thread.start()
    state, reason = "stopped", ""
    try:
        yield
        state = "finished"
    except BaseException as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        raise
    finally:
        done.set()
        thread.join()  # its last beat is written before the end is
        info.update(state=state, reason=reason)
        with contextlib.suppress(Exception):
            storage.set_study_user_attr(study_id, DRIVER, dict(info))


class _DriverWatch:
    """A follower's view of node 0: its current run, and whether it is still heard from. Silence is
    timed on this machine's clock (the beat's changes), so the nodes' clocks need not agree."""

    def __init__(self, storage: optuna.storages.BaseStorage, study_name: str, node: NodeSettings) -> None:
        self.storage, self.study_name, self.node = storage, study_name, node
        self.study_id: int | None = None
        first = self._read()
        # What node 0 wrote before this follower started belongs to an earlier run when it has ended,
        # or when its process is gone from this host: the follower waits for the next run.
        ended = first is not None and (first.get("state") != "running" or self._gone(first))
        self.earlier_run = first["run"] if ended else None
        self.seen: tuple | None = None
        self.changed = time.monotonic()

    @staticmethod
    def _gone(info: dict[str, Any]) -> bool:
        return info.get("host") == socket.gethostname() and not process_alive(info.get("pid"))

    def _read(self) -> dict[str, Any] | None:
        try:
            if self.study_id is None:
                self.study_id = self.storage.get_study_id_from_name(self.study_name)
            return self.storage.get_study_user_attrs(self.study_id).get(DRIVER)
        except KeyError:  # node 0 has not created the study yet
            return None

    def check(self) -> dict[str, Any] | None:
        """Node 0's current run (None until it starts); raises DsautoError when it is gone."""
        info = self._read()
        current = info if info is not None and info.get("run") != self.earlier_run else None
        key = None if current is None else (current["run"], current["beat"], current["state"])
        now = time.monotonic()
        if key != self.seen:
            self.seen, self.changed = key, now
        timeout = self.node.driver_timeout_seconds
        if current is None:
            if now - self.changed > timeout:
                raise DsautoError(
                    f"No node 0 started study {self.study_name} within {timeout:.0f} s, so node "
                    f"{self.node.node_rank} stops; run `dsauto tune` with the same options and --storage "
                    f"and --node-rank 0 on the node at --master-addr, or raise --driver-timeout.")
            return None
        if current["state"] == "running":
            if self._gone(current):
                raise DsautoError(f"Node 0 of study {self.study_name} (dsauto pid {current.get('pid')} on this "
                                  f"host) is gone, so node {self.node.node_rank} stops; rerun `dsauto tune` on "
                                  f"every node (finished trials are kept).")
            if now - self.changed > timeout:
                raise DsautoError(
                    f"Node 0 of study {self.study_name} (dsauto pid {current.get('pid')} on "
                    f"{current.get('host')}) has not been heard from for {now - self.changed:.0f} s, so node "
                    f"{self.node.node_rank} stops; rerun `dsauto tune` on every node (finished trials are kept), "
                    f"or raise --driver-timeout if node 0's database is slow to answer.")
        return current


def follow(storage: optuna.storages.BaseStorage, study_name: str, settings: TrialSettings,
           node: NodeSettings, out_dir: Path | str, say: Say = print) -> None:
    """A follower's life (node rank above 0): start its agent for each trial node 0 publishes,
    until node 0 finishes the study. Raises DsautoError when node 0 stops or is gone."""
    out = Path(out_dir)
    watch = _DriverWatch(storage, study_name, node)
    served: set[int] = set()
    say(f"node {node.node_rank}: following study {study_name}; waiting for node 0")
    while True:
        driver = watch.check()
        if driver is not None and driver["state"] == "finished":
            say(f"node {node.node_rank}: node 0 finished the study ({len(served)} trial"
                f"{'' if len(served) == 1 else 's'} joined here)")
            return
        if driver is not None and driver["state"] == "stopped":
            raise DsautoError(f"Node 0 of study {study_name} stopped ({driver.get('reason') or 'no reason given'}), "
                              f"so node {node.node_rank} stops too; fix that and rerun `dsauto tune` on every node.")
        if driver is not None:
            for trial in storage.get_all_trials(watch.study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                attrs = trial.user_attrs
                if (trial.number in served or RENDEZVOUS not in attrs
                        or (attrs.get("host"), attrs.get("pid")) != (driver.get("host"), driver.get("pid"))):
                    continue  # not published yet, or left running by an earlier node 0
                served.add(trial.number)
                _join(storage, watch, trial, settings, node, out, say)
        time.sleep(POLL_SECONDS)


def _join(storage: optuna.storages.BaseStorage, watch: _DriverWatch, trial: optuna.trial.FrozenTrial,
          settings: TrialSettings, node: NodeSettings, out: Path, say: Say) -> None:
    """Run this node's agent of one trial until it ends, node 0 ends the trial, or the timeout."""
    rendezvous = replace(from_dict(Rendezvous, trial.user_attrs[RENDEZVOUS], f"trial {trial.number}"),
                         node_rank=node.node_rank)
    plan = Plan.from_dict(trial.user_attrs[TRIAL_PLAN], f"the plan of trial {trial.number}")
    work = out / "trials" / f"trial-{trial.number}-node-{node.node_rank}"
    work.mkdir(parents=True, exist_ok=True)
    plans_path, out_path = work / "plan.json", work / "measured.json"  # rank 0 (node 0) writes the result
    write_json(plans_path, [plan.to_dict()])
    extra_env: dict[str, str] = {}
    if settings.script is not None:
        from dsauto.refine.trial_hook import TRIAL_ENV, TrialRequest, write_request

        request = work / "request.json"
        write_request(TrialRequest(config=ds_config(plan), out=str(out_path.resolve()), steps=settings.steps,
                                   warmup_steps=settings.warmup_steps, memory_steps=settings.memory_steps), request)
        extra_env[TRIAL_ENV] = str(request.resolve())
    ranks, port = rendezvous.ranks_per_node, rendezvous.master_port
    command = trial_command(settings, ranks, plans_path, out_path, port, rendezvous)
    say(f"node {node.node_rank}: trial {trial.number}: joining {rendezvous.master_addr}:{port} with {ranks} "
        f"rank{'s' if ranks > 1 else ''} (log {work / 'log.txt'})")
    ended = "its ranks ended"
    with open(work / "log.txt", "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        process = launch(command, launch_env(ranks, extra_env), port, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + settings.timeout_seconds
        trial_id = storage.get_trial_id_from_study_id_trial_number(watch.study_id, trial.number)
        closed: float | None = None
        try:
            while process.poll() is None:
                time.sleep(POLL_SECONDS)
                driver = watch.check()  # raises when node 0 is gone: the agent is ended below
                state = storage.get_trial(trial_id).state
                if state != TrialState.RUNNING or driver is None or driver["state"] != "running":
                    closed = closed or time.monotonic()
                    if time.monotonic() - closed > LINGER_SECONDS:
                        ended = "node 0 ended the trial; its agent here was stopped"
                        break
                if time.monotonic() > deadline:
                    ended = f"no end after {settings.timeout_seconds:.0f} s; its agent here was stopped"
                    break
        finally:
            if process.poll() is None:
                stop(process)
            remove_shared_memory(port)
    say(f"node {node.node_rank}: trial {trial.number}: {ended} (exit code {process.returncode})")
