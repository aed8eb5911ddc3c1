"""Trials of a plan over several nodes: the launchers' command lines (read back by the launchers'
own parsers), the checks of the node options, a follower whose node 0 is gone, and two "nodes" on
this machine (two torchrun agents of one rank each) measuring trials of one shared study."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import optuna
import pytest

from dsauto.errors import DsautoError
from dsauto.refine.launchers import Rendezvous, deepspeed_env_file
from dsauto.refine.nodes import DRIVER, NodeSettings, check_nodes, driving, explain_hang, follow
from dsauto.refine.runner import TrialOutcome, TrialSettings, trial_command
from dsauto.refine.study import open_storage

PLANS, MEASURED = Path("plan.json"), Path("measured.json")


def test_torchrun_command_of_a_follower_node_reads_back_in_torchrun():
    from torch.distributed.run import get_args_parser

    rendezvous = Rendezvous(nodes=2, ranks_per_node=4, master_addr="node0", master_port=29511, node_rank=1)
    command = trial_command(TrialSettings(steps=3), 4, PLANS, MEASURED, 29511, rendezvous)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    args = get_args_parser().parse_args(command[3:])
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "4")
    assert (args.master_addr, args.master_port, args.rdzv_backend) == ("node0", 29511, "static")
    assert args.module and args.training_script == "dsauto.profile.steps"
    assert args.training_script_args[args.training_script_args.index("--steps") + 1] == "3"


def test_deepspeed_hostfile_command_reads_back_in_deepspeeds_launcher(tmp_path):
    from deepspeed.launcher.runner import fetch_hostfile, parse_args

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=8\nnode1 slots=8\n")
    script = tmp_path / "train.py"
    script.write_text("")
    settings = TrialSettings(script=str(script), script_args=("--epochs", "1"), launcher="deepspeed")
    rendezvous = Rendezvous(2, 8, "node0", 29512, hostfile=str(hostfile))
    command = trial_command(settings, 8, PLANS, MEASURED, 29512, rendezvous)
    assert command[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    args = parse_args(command[3:])
    assert (args.hostfile, args.num_nodes, args.num_gpus) == (str(hostfile), 2, 8)
    assert (args.master_addr, args.master_port, args.include) == ("node0", 29512, "")
    assert (args.user_script, args.user_args) == (str(script), ["--epochs", "1"])
    assert dict(fetch_hostfile(str(hostfile))) == {"node0": 8, "node1": 8}
    # The trial's own variables reach the other nodes through the launcher's environment file.
    (tmp_path / "trial").mkdir()
    env = deepspeed_env_file(tmp_path / "trial", {"DSAUTO_TRIAL": "/shared/request.json"})
    path = env["DS_ENV_FILE"]
    assert os.path.join(os.path.expanduser("~"), path) == path  # the launcher joins it to its folders
    assert "DSAUTO_TRIAL=/shared/request.json\n" in Path(path).read_text()


@pytest.mark.parametrize(("nodes", "launcher", "node", "storage", "message"), [
    (2, "torchrun", NodeSettings(), "sqlite:///s.db", r"run `dsauto tune` on each with --node-rank K \(0 to 1\) "
                                                      r"and --master-addr"),
    (2, "torchrun", NodeSettings(master_addr="n0"), None, r"pass --storage with a database every node reaches"),
    (2, "torchrun", NodeSettings(node_rank=2, master_addr="n0"), "sqlite:///s.db", r"--node-rank 2 is not one of"),
    (2, "torchrun", NodeSettings(master_addr="n0", hostfile="h"), "sqlite:///s.db", r"pass --launcher deepspeed"),
    (2, "deepspeed", NodeSettings(), None, r"needs --hostfile FILE \(DeepSpeed's launcher starts the other nodes "
                                           r"over passwordless ssh\)"),
    (1, "torchrun", NodeSettings(node_rank=1, master_addr="n0"), None, r"^--node-rank, --master-addr place .* "
                                                                        r"but --nodes is 1"),
])
def test_node_options_that_cannot_work_are_one_sentence(nodes, launcher, node, storage, message):
    with pytest.raises(DsautoError, match=message):
        check_nodes(nodes, launcher, node, storage)


def test_a_hostfile_with_too_few_hosts_is_refused(tmp_path):
    (tmp_path / "hostfile").write_text("# the nodes\nnode0 slots=8\n")
    node = NodeSettings(hostfile=str(tmp_path / "hostfile"))
    with pytest.raises(DsautoError, match=r"lists 1 host but --nodes is 2"):
        check_nodes(2, "deepspeed", node, None)
    check_nodes(1 + 0, "deepspeed", NodeSettings(), None)  # one node: nothing to place


def test_a_hung_trial_over_nodes_names_the_likely_cause():
    hung = TrialOutcome("failed", "hung: no result after 600 s", None, 600.0, "log.txt")
    outcome = explain_hang(hung, Rendezvous(3, 8, "node0", 29513))
    assert outcome.reason == ("hung: no result after 600 s on 3 nodes (did nodes 1 to 2 run `dsauto tune` with "
                              "--node-rank and the same --storage, and reach node0:29513?)")
    assert explain_hang(hung, None) == hung


def _study(tmp_path: Path) -> tuple[str, optuna.storages.BaseStorage]:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    storage = open_storage(url)
    optuna.create_study(study_name="s", storage=storage)
    return url, storage


def test_a_follower_stops_when_node_0_is_silent_or_never_came(tmp_path):
    url, storage = _study(tmp_path)
    node = NodeSettings(node_rank=1, master_addr="127.0.0.1", driver_timeout_seconds=1)
    with pytest.raises(DsautoError, match=r"^No node 0 started study s within 1 s, so node 1 stops"):
        follow(storage, "s", TrialSettings(), node, tmp_path / "out", say=lambda line: None)
    study_id = storage.get_study_id_from_name("s")
    storage.set_study_user_attr(study_id, DRIVER, {"host": "elsewhere", "pid": 1, "run": "r", "state": "running",
                                                   "beat": 7, "reason": ""})
    with pytest.raises(DsautoError, match=r"^Node 0 of study s \(dsauto pid 1 on elsewhere\) has not been heard "
                                          r"from for \d+ s, so node 1 stops"):
        follow(storage, "s", TrialSettings(), node, tmp_path / "out", say=lambda line: None)


def test_a_follower_ends_when_node_0_finishes_and_says_why_node_0_stopped(tmp_path):
    _, storage = _study(tmp_path)
    node = NodeSettings(node_rank=1, master_addr="127.0.0.1", driver_timeout_seconds=60)
    lines: list[str] = []
    waiting = threading.Event()

    def say(line: str) -> None:
        lines.append(line)
        waiting.set()

    errors: list[Exception] = []

    def run_follower() -> threading.Thread:
        def target() -> None:
            try:
                follow(storage, "s", TrialSettings(), node, tmp_path, say)
            except DsautoError as exc:
                errors.append(exc)

        waiting.clear()
        thread = threading.Thread(target=target)
        thread.start()
        assert waiting.wait(60)  # it has looked at the study
        return thread

    follower = run_follower()
    with driving(storage, "s", 2):
        pass
    follower.join(60)
    assert not follower.is_alive() and lines[-1] == "node 1: node 0 finished the study (0 trials joined here)"
    assert not errors

    follower = run_follower()
    with pytest.raises(RuntimeError), driving(storage, "s", 2):
        raise RuntimeError("out of trials")
    follower.join(60)
    info = storage.get_study_user_attrs(storage.get_study_id_from_name("s"))[DRIVER]
    assert (info["state"], info["reason"], info["pid"]) == ("stopped", "out of trials", os.getpid())
    assert [str(e) for e in errors] == ["Node 0 of study s stopped (out of trials), so node 1 stops too; fix that "
                                        "and rerun `dsauto tune` on every node."]
    # A finished or stopped node 0 seen at the start is an earlier run's: the follower waits for the next.
    with pytest.raises(DsautoError, match=r"No node 0 started"):
        follow(storage, "s", TrialSettings(), NodeSettings(1, "h", driver_timeout_seconds=1), tmp_path, lines.append)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # the test asks for node 0's trial by hand
def test_a_follower_ends_its_agent_at_the_trial_timeout(tmp_path):
    import psutil

    from dsauto.profile.launch import free_port
    from dsauto.refine.nodes import publish
    from dsauto.search.planner import Planner
    from dsauto.spec.loaders import load_cluster, load_model
    from dsauto.spec.training import TrainSpec

    earlier = {c.pid for c in psutil.Process().children(recursive=True)}  # other tests' helpers
    _, storage = _study(tmp_path)
    plan = Planner(load_model("gpt-tiny"), load_cluster("cpu", nodes=2, gpus_per_node=1),
                   TrainSpec(4, 64, "fp32")).search()[0]
    study = optuna.load_study(study_name="s", storage=storage)
    lines: list[str] = []
    node = NodeSettings(node_rank=1, master_addr="127.0.0.1", driver_timeout_seconds=60)
    with driving(storage, "s", 2):
        trial = study.ask()  # node 0's trial, whose rendezvous nobody hosts: the agent here waits there
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        publish(trial, Rendezvous(2, 1, "127.0.0.1", free_port()), plan)
        follower = threading.Thread(target=follow, args=(storage, "s", TrialSettings(timeout_seconds=2), node,
                                                         tmp_path, lines.append))
        follower.start()
        while not any("no end after" in line for line in lines) and follower.is_alive():
            follower.join(0.5)
    follower.join(60)
    assert not follower.is_alive()
    assert lines[1].startswith("node 1: trial 0: joining 127.0.0.1:")
    assert lines[2].startswith("node 1: trial 0: no end after 2 s; its agent here was stopped")
    assert lines[3] == "node 1: node 0 finished the study (1 trial joined here)"
    log = (tmp_path / "trials" / "trial-0-node-1" / "log.txt").read_text()
    assert "--nnodes 2 --node_rank 1 --nproc_per_node 1 --master_addr 127.0.0.1" in log
    assert not [c for c in psutil.Process().children(recursive=True)
                if c.is_running() and c.pid not in earlier]  # the agent is gone


def test_a_follower_whose_node_0_is_gone_exits_with_one_sentence(tmp_path):
    url, storage = _study(tmp_path)
    follower = subprocess.Popen(
        [sys.executable, "-m", "dsauto.cli", "tune", "--model", "gpt-tiny", "--hardware", "cpu", "--nodes", "2",
         "--gpus-per-node", "1", "--seq-len", "64", "--trials", "1", "--storage", url, "--study-name", "s",
         "--master-addr", "127.0.0.1", "--node-rank", "1", "--out", str(tmp_path / "b")],
        stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        while "node 1: following study s; waiting for node 0" not in seen:  # it has looked at the study
            line = follower.stderr.readline()
            assert line, seen[-2000:]
            seen += line
        # Node 0 starts, then dies without a word (kill -9).
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        pid = int(gone.stdout)
        storage.set_study_user_attr(storage.get_study_id_from_name("s"), DRIVER, {
            "host": socket.gethostname(), "pid": pid, "run": "r", "state": "running", "beat": 0, "reason": ""})
        rest = follower.stderr.read()
        assert follower.wait(timeout=120) == 2, rest[-2000:]
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert rest.strip().splitlines()[-1] == (
        f"dsauto: error: Node 0 of study s (dsauto pid {pid} on this host) is gone, so node 1 stops; rerun "
        f"`dsauto tune` on every node (finished trials are kept).")


@pytest.mark.slow
def test_two_nodes_on_this_machine_measure_trials_of_one_study(tmp_path):
    """Node 0 and node 1 as two tunes on localhost, one torchrun agent of one rank each per trial."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    profile = subprocess.run([sys.executable, "-m", "dsauto.cli", "profile", "--model", "gpt-tiny", "--seq-len", "64",
                              "--tp", "1", "--micro-batches", "1,2,4", "--out", str(tmp_path / "profiles")],
                             capture_output=True, text=True, env=env, timeout=300)
    assert profile.returncode == 0, profile.stderr[-2000:]

    def node(rank: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "dsauto.cli", "tune", "--model", "gpt-tiny", "--hardware", "cpu",
                   "--nodes", "2", "--gpus-per-node", "1", "--seq-len", "64", "--global-batch", "8",
                   "--trials", "1", "--trial-steps", "1", "--trial-warmup", "0", "--trial-timeout", "300",
                   "--storage", storage, "--master-addr", "127.0.0.1", "--node-rank", str(rank),
                   "--out", str(tmp_path / f"out{rank}"), "--profile", str(tmp_path / "profiles")]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    follower, driver = node(1), node(0)  # the follower may start first: it waits for node 0
    outputs = [p.communicate(timeout=600)[0] for p in (driver, follower)]
    assert [driver.returncode, follower.returncode] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]

    (summary,) = optuna.get_all_study_summaries(storage)
    trials = optuna.load_study(study_name=summary.study_name, storage=storage).get_trials()
    assert len(trials) == 1  # recorded once, by node 0: the follower adds none
    assert all(t.user_attrs["status"] == "complete" and t.user_attrs["pid"] == driver.pid for t in trials)
    for t in trials:
        driver_log = (tmp_path / "out0" / "trials" / f"trial-{t.number}" / "log.txt").read_text()
        assert "--nnodes 2 --node_rank 0 --nproc_per_node 1" in driver_log
        assert "on 2 ranks: step" in driver_log  # rank 0 measured with the follower's rank in the job
        follower_log = (tmp_path / "out1" / "node-1" / "trials" / f"trial-{t.number}-node-1" / "log.txt").read_text()
        assert "--nnodes 2 --node_rank 1 --nproc_per_node 1" in follower_log
        assert not (tmp_path / "out1" / "node-1" / "trials" / f"trial-{t.number}-node-1" / "measured.json").exists()
    assert "node 1: node 0 finished the study (1 trial joined here)" in outputs[1]
    assert (tmp_path / "out0" / "plan.yaml").exists() and not (tmp_path / "out1" / "plan.yaml").exists()
