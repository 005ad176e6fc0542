"""Warm ranks: a relaunch under `--nproc-per-node N` starts its ranks from the warm standby.

An attempt that finds no standby ready (the first one) runs torchrun (proc/torchrun.py). A
later one hands the standby, an interpreter that has imported the script's heavy modules, the
group instead: it becomes the ranks' host (standby/rank_host.py), forks the N ranks, gives each
the environment torchrun gives a rank and runs the script in each, so no rank imports torch
again. What torchrun's agent does for one node, the host does the same way: it hosts the c10d
TCPStore the ranks' `init_process_group` reaches (TORCHELASTIC_USE_AGENT_STORE=True, on a port
the kernel picked for this attempt's listening socket, so a group never meets a dead one's
keys), ends the other ranks when one fails (SIGTERM, then SIGKILL after the grace) and prints
torchrun's failure summary, whose first observed failure decide/classify.py reads.

Several nodes (`--nnodes N`, the c10d rendezvous): the host joins torch's own dynamic
rendezvous with the endpoint and id torchrun would use for the attempt, as torchrun's agent does
(standby/rank_rdzv.py), and gets its group rank, the world's size and the store the ranks meet
in from it. So a warm node and a node still running torchrun (its first attempt, or a standby
that was not ready) form one group, and a lost node, a replacement node and a changed world size
go through the rendezvous as under torchrun. Over a range of nodes (`--nnodes MIN:MAX`) the host
goes on at the size the rendezvous gives it and, as torchrun's agent does, restarts its group when
a node waits to join (rank_host.py): the supervisor relaunches it, warm, into the next round,
which takes that node in. `node_env` holds a rank's variables that owe nothing to the
rendezvous; the host adds the rest once it has joined. Any other torchrun command (another
rendezvous backend, options rtrain does not write) stays on torchrun.

This module is the supervisor's side, pure and torch-free: what the command runs, what the
standby is started with, and what the hand-off tells the host.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TORCHRUN = "torch.distributed.run"
ONE_NODE_OPTIONS = ("--standalone", "--max-restarts=0")
"""torchrun's options on one node besides --nproc-per-node, both always there (torchrun_command):
a torchrun command without them is not rtrain's."""
NODES_OPTIONS = ("--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id")
"""torchrun's options over several nodes besides --nproc-per-node and --max-restarts=0, each
always there as `--name=value` (torchrun_command)."""
RDZV_BACKEND = "c10d"
"""The one rendezvous a host joins itself: torch's dynamic rendezvous on a c10d store."""
MASTER_ADDR = "localhost"
"""torchrun's own on one node (`--standalone`)."""
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""torchrun sets TORCHELASTIC_SIGNALS_TO_HANDLE to its default in its own environment, which
every rank inherits."""


@dataclass(frozen=True)
class RankPlan:
    """One node's group, as rtrain's torchrun command names it."""

    python: str
    nproc: int
    mode: str  # "script" or "module"
    target: str  # the script as the command names it, or the module
    args: tuple[str, ...]
    torchrun: tuple[str, ...] = ()
    """Several nodes: torchrun's arguments from its first option to the script's last argument
    (the host parses them as torchrun does); () on one node."""

    @property
    def several_nodes(self) -> bool:
        return bool(self.torchrun)

    def rank_argv(self) -> list[str]:
        """The command each rank runs, without torchrun (`python SCRIPT ...`, `-m MODULE`)."""
        head = [self.python, "-m", self.target] if self.mode == "module" else [self.python,
                                                                              self.target]
        return [*head, *self.args]

    def orig_argv(self) -> list[str]:
        """A rank's sys.orig_argv under torchrun: it starts the ranks with `python -u`."""
        argv = self.rank_argv()
        return [argv[0], "-u", *argv[1:]]


def plan_of(command: list[str]) -> RankPlan | None:
    """The group `command` runs under torchrun, one node's (`--standalone`) or one node's share
    of several (`--nnodes`, the c10d rendezvous); None for anything else (another rendezvous
    backend, a torchrun command of the user's own, a plain script)."""
    if len(command) < 4 or command[1:3] != ["-m", TORCHRUN]:
        return None
    nproc, seen, nodes, i = None, set(), {}, 3
    while i < len(command) and command[i].startswith("--"):
        arg = command[i]
        name, eq, value = arg.partition("=")
        if name == "--nproc-per-node":
            if not value.isdigit() or int(value) < 1:
                return None
            nproc = int(value)
        elif arg in ONE_NODE_OPTIONS:
            seen.add(arg)
        elif name in NODES_OPTIONS and eq and value and name not in nodes:
            nodes[name] = value
        else:
            return None
        i += 1
    rest = command[i:]
    if nproc is None or not rest:
        return None
    if nodes:
        if (seen != {"--max-restarts=0"} or set(nodes) != set(NODES_OPTIONS)
                or nodes["--rdzv-backend"] != RDZV_BACKEND
                or not node_count(nodes["--nnodes"])):
            return None
        torchrun = tuple(command[3:])
    elif seen != set(ONE_NODE_OPTIONS):
        return None
    else:
        torchrun = ()
    if rest[0] == "-m":
        if len(rest) < 2:
            return None
        return RankPlan(command[0], nproc, "module", rest[1], tuple(rest[2:]), torchrun)
    return RankPlan(command[0], nproc, "script", rest[0], tuple(rest[1:]), torchrun)


def node_count(nnodes: str) -> bool:
    """`--nnodes N` or `MIN:MAX` (1 <= MIN <= MAX), as torchrun reads it: a node count a host
    can join a rendezvous for. A fixed count never changes while a group runs; over a range the
    host restarts its group when a node waits to join, as torchrun's agent restarts its
    workers (rank_host.py)."""
    low, colon, high = nnodes.partition(":")
    if not low.isdigit() or int(low) < 1:
        return False
    return not colon or (high.isdigit() and int(high) >= int(low))


def standby_env(env: Mapping[str, str], plan: RankPlan) -> dict[str, str]:
    """What every rank of `plan` inherits from torchrun's own environment, which a standby for
    the ranks is started with: libraries read some of it at import (OMP_NUM_THREADS, which
    torchrun sets to 1 for several ranks when it is unset)."""
    out = dict(env)
    if "OMP_NUM_THREADS" not in out and plan.nproc > 1:
        out["OMP_NUM_THREADS"] = "1"
    out.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", SIGNALS_TO_HANDLE)
    return out


def rank_env(plan: RankPlan, env: Mapping[str, str], local_rank: int, run_id: str,
             error_file: str) -> dict[str, str]:
    """The variables torchrun's agent (torch 2.x, local_elastic_agent._start_workers) gives
    local rank `local_rank` on one node, but MASTER_PORT: the host fills it in with the port
    its store listens on."""
    n = str(plan.nproc)
    out = {k: v for k, v in standby_env(env, plan).items() if k not in env}
    out.update({
        "RANK": str(local_rank), "GROUP_RANK": "0", "ROLE_RANK": str(local_rank),
        "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": n, "WORLD_SIZE": n,
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": n, "MASTER_ADDR": MASTER_ADDR,
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "LOCAL_RANK": str(local_rank), "TORCHELASTIC_ERROR_FILE": error_file,
    })
    return out


RDZV_VARIABLES = ("RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE",
                  "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "TORCHELASTIC_USE_AGENT_STORE")
"""A rank's variables over several nodes that come from the rendezvous (the host sets them)."""


def node_env(plan: RankPlan, env: Mapping[str, str], local_rank: int,
             error_file: str) -> dict[str, str]:
    """Over several nodes: the variables torchrun's agent gives local rank `local_rank` that
    owe nothing to the rendezvous (RDZV_VARIABLES are left to the host)."""
    out = rank_env(plan, env, local_rank, "", error_file)
    for name in RDZV_VARIABLES:
        out.pop(name, None)
    return out


def handoff(plan: RankPlan, env: Mapping[str, str], attempt_dir: Path,
            grace_s: float, after_growth: bool = False,
            failed_at: float | None = None) -> dict:
    """What the hand-off tells the standby beyond a single process's argv, env and cwd: each
    rank's variables, the argv a rank sees, and the grace the other ranks get when one fails.
    One node: a fresh run id each attempt, as a fresh torchrun has. Several nodes: torchrun's
    arguments, from which the host joins the rendezvous (its id and round, its store), and
    whether its round has the relaunch's short last call (standby/rank_rdzv.py): not after
    the group stopped to take a waiting node in (`after_growth`), whose round waits for it
    (the stopped host's store went with it, so that node joins again, cold maybe), and when
    the attempt before failed (`failed_at`, unix time), from which that last call counts."""
    run_id = str(uuid.uuid4())
    files = [str(Path(attempt_dir).resolve() / f"rank-{r}-error.json")
             for r in range(plan.nproc)]
    if plan.several_nodes:
        envs = [node_env(plan, env, r, files[r]) for r in range(plan.nproc)]
    else:
        envs = [rank_env(plan, env, r, run_id, files[r]) for r in range(plan.nproc)]
    out = {"envs": envs, "argv": plan.rank_argv(), "orig_argv": plan.orig_argv(),
           "grace_s": grace_s, "addr": MASTER_ADDR, "name": os.path.basename(
               plan.target) if plan.mode == "script" else plan.target}
    if plan.several_nodes:
        out["rdzv"] = {"torchrun": list(plan.torchrun), "short_last_call": not after_growth,
                       "failed_at": failed_at}
    return {"ranks": out}


__all__ = ["RankPlan", "handoff", "node_env", "plan_of", "rank_env", "standby_env"]
