"""The Slurm job we run in: its id, its time limit's end (`job_times`), requeueing it
(`--requeue`, array-aware; exit 75 when that is impossible) and excluding a node from it."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass


def job_id(env: Mapping[str, str]) -> str | None:
    """The id `scontrol requeue` wants: `<array job>_<task>` for an array task."""
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID")


def job_info(env: Mapping[str, str] | None = None) -> dict[str, object] | None:
    """The Slurm job we run in, for the `launch` event; None outside Slurm.

    `restart_count` is SLURM_RESTART_COUNT (0 in the first run, +1 per requeue); `array` is
    `<array job>_<task>` for an array task, else None.
    """
    env = os.environ if env is None else env
    jid = env.get("SLURM_JOB_ID")
    if not jid:
        return None
    try:
        restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        restarts = 0
    array = job_id(env) if env.get("SLURM_ARRAY_TASK_ID") else None
    return {"job_id": jid, "restart_count": restarts, "array": array}


@dataclass(frozen=True)
class JobTimes:
    """When the job started and when its time limit ends it, as the scheduler says (unix
    seconds): the job's real start, not ours (the batch script's setup runs before rtrain)."""

    start: float | None
    end: float | None  # None: no time limit (TimeLimit=UNLIMITED, EndTime=Unknown)


def parse_job_times(shown: str) -> JobTimes | None:
    """StartTime and EndTime of `scontrol show job` output; None when it shows no job.

    Slurm prints them as local time without a zone (2026-11-30T21:46:58), in the zone of the
    machine that runs scontrol; rtrain runs on the job's node, so the local zone reads them."""
    if not re.search(r"\bJobId=\S+", shown):
        return None
    return JobTimes(start=_local_time(shown, "StartTime"), end=_local_time(shown, "EndTime"))


def _local_time(shown: str, name: str) -> float | None:
    m = re.search(rf"\b{name}=(\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d)\b", shown)
    if m is None:  # Unknown, None, N/A
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))


def job_times(env: Mapping[str, str] | None = None,
              timeout_s: float = 10.0) -> tuple[JobTimes | None, str]:
    """The job's start and end from the scheduler (`scontrol show job`; where slurmctld does
    not answer, SLURM_JOB_START_TIME / SLURM_JOB_END_TIME, which newer Slurm sets). Returns
    (times, what happened); times None outside Slurm or when neither source says. Never raises;
    asked before every attempt, so a slurmctld that does not answer costs `timeout_s` at most."""
    env = os.environ if env is None else env
    jid = env.get("SLURM_JOB_ID")
    if not jid:
        return None, "not running under Slurm"
    scontrol = shutil.which("scontrol")
    why = "scontrol not found on PATH"
    if scontrol is not None:
        try:
            r = subprocess.run([scontrol, "show", "job", "--oneliner", jid], capture_output=True,
                               text=True, timeout=timeout_s)
            times = parse_job_times(r.stdout) if r.returncode == 0 else None
            if times is not None:
                return times, f"scontrol show job {jid}"
            why = f"scontrol show job {jid} failed ({_last_line(r)})"
        except (OSError, subprocess.TimeoutExpired) as e:
            why = f"scontrol show job {jid} failed ({e})"
    start, end = _env_time(env, "SLURM_JOB_START_TIME"), _env_time(env, "SLURM_JOB_END_TIME")
    if end is not None:
        return JobTimes(start=start, end=end), f"SLURM_JOB_END_TIME ({why})"
    return None, why


def _env_time(env: Mapping[str, str], name: str) -> float | None:
    try:
        value = float(env.get(name) or "")
    except ValueError:
        return None
    return value if value > 0 else None


def job_state(jid: str, *, scontrol: str = "scontrol", timeout_s: float = 30.0) -> str | None:
    """The job's JobState (RUNNING, CANCELLED, ...) from `scontrol show job`; None if unknown."""
    try:
        r = subprocess.run([scontrol, "show", "job", "--oneliner", jid], capture_output=True,
                           text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bJobState=(\S+)", r.stdout)
    return m.group(1) if r.returncode == 0 and m else None


def exclude_node(env: Mapping[str, str] | None = None,
                 timeout_s: float = 30.0) -> tuple[bool, str]:
    """Add the node we run on to the job's excluded nodes (ExcNodeList), so a requeue does not
    land on it again. Returns (done, what happened), never raises."""
    env = os.environ if env is None else env
    jid = job_id(env)
    node = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    scontrol = shutil.which("scontrol")
    if jid is None or scontrol is None:
        return False, "not running under Slurm (no SLURM_JOB_ID or scontrol): no node excluded"
    try:
        shown = subprocess.run([scontrol, "show", "job", "--oneliner", jid], capture_output=True,
                               text=True, timeout=timeout_s)
        m = re.search(r"\bExcNodeList=(\S+)", shown.stdout)
        old = [] if not m or m.group(1) == "(null)" else m.group(1).split(",")
        nodes = ",".join(dict.fromkeys([*old, node]))
        r = subprocess.run([scontrol, "update", f"JobId={jid}", f"ExcNodeList={nodes}"],
                           capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"could not exclude node {node} from job {jid}: {e}"
    if r.returncode != 0:
        return False, f"could not exclude node {node} from job {jid}: {_last_line(r)}"
    return True, f"excluded node {node} from job {jid} (ExcNodeList={nodes})"


def requeue(env: Mapping[str, str] | None = None, timeout_s: float = 30.0) -> tuple[bool, str]:
    """Ask Slurm to requeue this job. Returns (done, what happened), never raises."""
    env = os.environ if env is None else env
    jid = job_id(env)
    if jid is None:
        return False, "not running under Slurm (no SLURM_JOB_ID): exiting 75 instead"
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return False, "scontrol not found on PATH: exiting 75 instead"
    state = job_state(jid, scontrol=scontrol, timeout_s=timeout_s)
    if state not in (None, "RUNNING"):
        # Slurm is ending the job itself (COMPLETING): `scancel JOB`, the time limit reached
        # without the --signal warning, or a preemption it handles. Its SIGTERM looks like our
        # warning signal, but requeueing would bring back a job a person just cancelled.
        return False, (f"Slurm is already ending job {jid} (JobState={state}: scancel, time "
                       "limit or preemption): not requeueing it, exiting 75")
    try:
        r = subprocess.run([scontrol, "requeue", jid], capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"scontrol requeue {jid} failed ({e}): exiting 75 instead"
    if r.returncode != 0:
        return False, f"scontrol requeue {jid} failed ({_last_line(r)}): exiting 75 instead"
    return True, f"requeued Slurm job {jid}"


def _last_line(r: subprocess.CompletedProcess) -> str:
    """What a failed scontrol said last, for the one-line reason."""
    return ((r.stderr or r.stdout).strip().splitlines() or [f"exit {r.returncode}"])[-1]
