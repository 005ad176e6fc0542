"""`rtrain launch --nproc-per-node N train.py`: the script runs under torchrun, rtrain around it.

torchrun (torch.distributed.elastic) starts and rendezvous the ranks; rtrain keeps owning
restarts (`--max-restarts=0`: a failed rank ends the attempt, and rtrain relaunches the whole
group from the newest verified checkpoint). One node uses `--standalone`: a c10d rendezvous on
localhost:0, so each attempt gets a free port and no two runs on a machine collide. Several
nodes name the rendezvous endpoint and one fixed id (`RDZV_ID`), the same on every node: each
node's supervisor counts its own attempts (a replacement node starts again at 0), so nothing
per node may enter the id. A failed group's rendezvous is not met again: the c10d store lives
in the torchrun that hosts it, and one failed rank fails the collectives of every other, so
every torchrun of the group ends and the next group meets in a fresh store (a relaunch that
still finds the old one finds it closed, fails at once and is relaunched; a relaunch in the
warm standby joins again until the old store is gone instead, standby/rank_rdzv.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from rtrain.supervisor.core.errors import UsageError

RDZV_ID = "rtrain"


@dataclass(frozen=True, kw_only=True)
class TorchrunSpec:
    nproc_per_node: int
    """Ranks on this node (`--nproc-per-node`)."""
    nnodes: str | None = None
    """`N` or `MIN:MAX`; more than one node needs `rdzv_endpoint`."""
    rdzv_endpoint: str | None = None
    """host:port of the rendezvous (multi-node)."""
    rdzv_backend: str | None = None
    """Rendezvous backend (default c10d)."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node {self.nproc_per_node}: give 1 or more")
        multi = self.nnodes not in (None, "1", "1:1")
        if multi and not self.rdzv_endpoint:
            raise UsageError(f"--nnodes {self.nnodes}: several nodes need --rdzv-endpoint "
                             "HOST:PORT (the same on every node)")


def several_nodes(command: list[str]) -> bool:
    """torchrun's `--nnodes` above 1 in the child's command (rtrain's --nnodes puts it there)."""
    value = _option(command, "--nnodes")
    return value is not None and value.strip() not in ("1", "1:1")


def rdzv_host(command: list[str]) -> str | None:
    """The host of the rendezvous endpoint in the child's command (`--rdzv-endpoint` or
    torchrun's older `--rdzv_endpoint`), None when it names none."""
    value = _option(command, "--rdzv-endpoint") or _option(command, "--rdzv_endpoint")
    if not value:
        return None
    if value.startswith("["):  # [v6 address]:port
        host = value[1:].partition("]")[0]
    else:
        host = value.rpartition(":")[0] if value.count(":") == 1 else value
    return host or None


def _option(command: list[str], name: str) -> str | None:
    """The value of `name` in `command` (`--name=V` or `--name V`); the last one wins."""
    found = None
    for i, arg in enumerate(command):
        if arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(command):
            found = command[i + 1]
    return found


def torchrun_command(spec: TorchrunSpec, script: str | None, module: str | None,
                     args: list[str], python: str | None = None) -> list[str]:
    """The argv that runs `script` (or `-m module`) under torchrun with `python`."""
    if module is None and (script is None or not script.endswith(".py")):
        raise UsageError("--nproc-per-node runs a .py script or -m MODULE under torchrun; to run "
                         "your own torchrun command, drop --nproc-per-node and give it after "
                         "`--` (rtrain launch -- torchrun ... train.py)")
    py = python or sys.executable
    argv = [py, "-m", "torch.distributed.run", f"--nproc-per-node={spec.nproc_per_node}",
            "--max-restarts=0"]
    if spec.rdzv_endpoint is None and spec.nnodes in (None, "1", "1:1"):
        argv.append("--standalone")
    else:
        argv += [f"--nnodes={spec.nnodes or 1}",
                 f"--rdzv-backend={spec.rdzv_backend or 'c10d'}",
                 f"--rdzv-endpoint={spec.rdzv_endpoint}",
                 f"--rdzv-id={RDZV_ID}"]
    if module is not None:  # the module's first argument lands in the SCRIPT slot: keep it
        return [*argv, "-m", module, *([script] if script is not None else []), *args]
    return [*argv, script, *args]
