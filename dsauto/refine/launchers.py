"""The launchers' own command-line spelling of a trial that spans several nodes.

Two launchers start the ranks of a multi-node trial:

- **torchrun** (static rendezvous), one agent per node, each started by that node's own
  ``dsauto tune --node-rank K``: ``torchrun --nnodes N --node_rank K --nproc_per_node G
  --master_addr A --master_port P``. Node 0's agent hosts the rendezvous store at ``A:P``; every
  agent waits there until all ``N`` have joined (torch/distributed/run.py, ``--rdzv-backend static``,
  the default when ``--nnodes`` is a single number).
- **DeepSpeed's launcher** with a hostfile, started by node 0 alone: ``deepspeed --hostfile H
  --num_nodes N --num_gpus G --master_addr A --master_port P``. It reaches the other hosts over
  pdsh/ssh, so it needs passwordless ssh between the nodes and the trial's files on a filesystem
  every node sees (deepspeed/launcher/runner.py, ``main``: ``PDSHRunner``). It forwards to the remote
  ranks only the variables whose names start with its export prefixes, plus those listed in its
  environment file (``DS_ENV_FILE``, default ``.deepspeed_env`` in the home and working folders);
  :func:`deepspeed_env_file` writes such a file for the trial's own variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Launcher = Literal["torchrun", "deepspeed"]

DEEPSPEED_ENV_FILES = (Path.home() / ".deepspeed_env", Path(".deepspeed_env"))
"""Where DeepSpeed's launcher looks for the variables to export when ``DS_ENV_FILE`` is not set
(deepspeed/launcher/runner.py, ``DEEPSPEED_ENVIRONMENT_PATHS``): a file of the trial replaces them,
so their lines are copied into it."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one multi-node trial meet, as node 0 publishes it to the other nodes."""

    nodes: int
    """Nodes of the trial (each runs ``ranks_per_node`` ranks)."""
    ranks_per_node: int
    """Ranks each node starts (``--gpus-per-node``)."""
    master_addr: str
    """Address of node 0, where the rendezvous store listens (reachable from every node)."""
    master_port: int
    """Port of the rendezvous store on node 0."""
    node_rank: int = 0
    """This node's place, 0 to ``nodes - 1`` (node 0 hosts the store and gets global rank 0)."""
    hostfile: str | None = None
    """DeepSpeed's hostfile (``host slots=G`` lines), when its launcher starts every node from node 0."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def node_args(launcher: Launcher, rendezvous: Rendezvous) -> list[str]:
    """The launcher's own options that place a trial's ranks on ``rendezvous``'s nodes."""
    r = rendezvous
    if launcher == "deepspeed":
        if r.hostfile is None:
            raise ValueError("DeepSpeed's launcher reaches other nodes only through a hostfile")
        address = ["--master_addr", r.master_addr] if r.master_addr else []  # else the first host's
        return ["--hostfile", r.hostfile, "--num_nodes", str(r.nodes), "--num_gpus", str(r.ranks_per_node),
                *address, "--master_port", str(r.master_port)]
    return ["--nnodes", str(r.nodes), "--node_rank", str(r.node_rank), "--nproc_per_node", str(r.ranks_per_node),
            "--master_addr", r.master_addr, "--master_port", str(r.master_port)]


def deepspeed_env_file(folder: Path, exports: dict[str, str]) -> dict[str, str]:
    """Writes ``exports`` (and the lines of the user's own ``.deepspeed_env`` files) to a file in
    ``folder`` and returns the variable that makes DeepSpeed's launcher forward them to every node."""
    lines = []
    for path in DEEPSPEED_ENV_FILES:
        if path.is_file():
            lines += [line for line in path.read_text().splitlines() if "=" in line]
    lines += [f"{key}={value}" for key, value in exports.items()]
    path = folder / "deepspeed_env"
    path.write_text("".join(line + "\n" for line in lines))
    # The launcher joins the name to its search folders; an absolute name stands for itself.
    return {"DS_ENV_FILE": os.path.abspath(path)}
