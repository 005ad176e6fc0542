"""Name what ended an attempt: one pure function from its `Observation` to a `Failure`.

Rules, first match wins (`_RULES`, one small function each; why each sits where it does is
noted at the rule):
exit record > stop for memory pressure (no kernel OOM kill) > exit 75 (unless rtrain had found
the attempt hung and no stop signal reached rtrain) > stop killed after
grace > hang > lost device > CUDA OOM in stderr >
kernel OOM evidence > host OOM in stderr > stop requested > SIGKILL without memory pressure >
failed before the first step (startup) > crash.

Exit 75 with no stop signal at the supervisor is a preemption "on its own": the worker was
asked to stop by someone else (a scheduler signalling every process of the job, the script's
own `request_stop()`), saved and exited; it is free. But the stop rtrain sends a hung attempt
is the same signal, followed by SIGCONT: a child that had stopped itself (SIGSTOP) or was
stuck somewhere the signal reaches may then save and exit 75. That attempt made no progress
for the hang timeout: a hang, charged to the hang budget.
"""

from __future__ import annotations

import math
import re
import signal as _signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rtrain.supervisor.core.errors import ExitCode
from rtrain.supervisor.decide.failures import Failure, FailureKind
from rtrain.supervisor.decide.observation import Observation

GPU_OOM = re.compile(r"CUDA out of memory|torch\.(cuda\.)?OutOfMemoryError|"
                     r"CUBLAS_STATUS_ALLOC_FAILED|HIP out of memory|CUDA error: out of memory")
HOST_OOM = re.compile(r"\bMemoryError\b|std::bad_alloc|Cannot allocate memory")
# NaN losses are not matched in stderr: "nan" appears in too many harmless log lines (metric
# names, tensor prints); the worker's exit record is the evidence for `nonfinite`.

# When several ranks left records, the most specific kind names the attempt: rank 0's
# "crash" is usually the NCCL fallout of rank 3's out-of-memory. Among records of one kind the
# earliest names it: the others are usually the collective failing on the ranks left behind.
# A checkpoint that cannot be loaded comes first: whatever else the ranks report (a collective
# broken by the rank that gave up) follows from it.
_RECORD_PRIORITY = [FailureKind.BAD_CHECKPOINT, FailureKind.OOM_GPU, FailureKind.OOM_HOST,
                    FailureKind.MEMORY_PRESSURE, FailureKind.NONFINITE, FailureKind.DATA,
                    FailureKind.LOST_DEVICE, FailureKind.STARTUP, FailureKind.PREEMPTED,
                    FailureKind.CRASH]


def describe_exit(ev: Observation) -> str:
    """torchelastic-style: "Signal 9 (SIGKILL) received by PID 123" / "PID 123 exited with 1"."""
    who = f"PID {ev.pid}" if ev.pid is not None else "the child"
    if ev.signal:
        try:
            num = f"{int(_signal.Signals[ev.signal])} "
        except KeyError:
            num = ""
        return f"Signal {num}({ev.signal}) received by {who}"
    return f"{who} exited with code {ev.exit_code}"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _memory_pressure(ev: Observation, fraction: float) -> str | None:
    """Why memory looks exhausted, or None when nothing says so."""
    total = ev.host_mem_total
    if not total:
        return None
    if ev.host_mem_available_min is not None and ev.host_mem_available_min < (1 - fraction) * total:
        return (f"host memory available fell to {ev.host_mem_available_min / 2**20:.0f} MiB of "
                f"{total / 2**20:.0f} MiB")
    if ev.peak_rss_bytes >= fraction * total:
        return (f"the process tree peaked at {ev.peak_rss_bytes / 2**20:.0f} MiB of "
                f"{total / 2**20:.0f} MiB")
    return None


def _from_records(records: Sequence[dict[str, Any]], ev: Observation) -> Failure:
    def kind_of(rec: dict[str, Any]) -> FailureKind:
        try:
            return FailureKind(rec.get("kind"))
        except ValueError:
            return FailureKind.CRASH

    def order(r: dict[str, Any]) -> tuple[int, float]:
        t = r.get("time")
        return _RECORD_PRIORITY.index(kind_of(r)), t if isinstance(t, (int, float)) else math.inf

    rec = min(records, key=order)
    kind = kind_of(rec)
    reason = str(rec.get("reason") or rec.get("exception") or kind.value)
    if len(records) > 1:
        others = len(records) - 1
        first = " first" if rec is min(records, key=lambda r: order(r)[1]) else ""
        reason = (f"rank {rec.get('rank', 0)}: {reason} (failed{first}; {others} other "
                  "rank(s) also reported)")
    elif rec.get("rank"):
        reason = f"rank {rec['rank']}: {reason}"
    if rec.get("step") is not None:
        reason += f" at step {rec['step']}"
    return _failure(kind, reason, ev)


def _failure(kind: FailureKind, reason: str, ev: Observation) -> Failure:
    return Failure(kind=kind, reason=reason, exit_code=ev.exit_code, signal=ev.signal,
                   seen=ev)


def classify(seen: Observation, *, memory_pressure_fraction: float) -> Failure:
    """The kind of failure that ended the attempt, with the sentence a person reads.

    Call it only for attempts that did not exit 0 (exit 0 is success, not a failure).
    `memory_pressure_fraction` is the setting of that name (config.py): a SIGKILL once memory
    use reached this share of the total counts as a host OOM.
    """
    ev = seen
    if ev.exit_code == 0 and not ev.signal:
        raise ValueError("exit status 0 is success: there is no failure to classify")
    if ev.exit_records:
        return _from_records(ev.exit_records, ev)
    case = _Case(ev, describe_exit(ev), _memory_pressure(ev, memory_pressure_fraction))
    for rule in _RULES:
        found = rule(case)
        if found is not None:
            return _failure(*found, ev)
    return _failure(FailureKind.CRASH, _crash_reason(case), ev)


@dataclass(frozen=True)
class _Case:
    """What the rules read: the evidence, and two sentences drawn from it."""

    ev: Observation
    how: str  # describe_exit(ev)
    pressure: str | None  # why memory looks exhausted (_memory_pressure), or None


_Found = tuple[FailureKind, str] | None  # a rule's kind and reason, None when it does not apply


def _pressure_stop(c: _Case) -> _Found:
    # rtrain's own stop under memory pressure: a rung down, whether the child saved (exit 75,
    # no step lost) or not. Before exit 75, which would read it as a preemption; unless the
    # kernel OOM killer struck first, which the cgroup rule names.
    ev = c.ev
    if ev.pressure_stop is None or ev.cgroup_oom_kills > 0:
        return None
    if ev.exit_code == ExitCode.PREEMPTED or (ev.stop_confirmed and not ev.killed_after_grace):
        at = f" at step {ev.last_step}" if ev.last_step is not None else ""
        how = f"it committed a checkpoint{at} and exited (no step lost)"
    elif ev.killed_after_grace:
        how = f"it did not save within the grace and was killed ({c.how})"
    else:
        how = f"{c.how} without confirming a checkpoint"
    return FailureKind.MEMORY_PRESSURE, (f"stopped by rtrain under memory pressure "
                                         f"({ev.pressure_stop}); {how}")


def _exit_75(c: _Case) -> _Found:
    if c.ev.exit_code != ExitCode.PREEMPTED:
        return None
    if c.ev.hang and not c.ev.stop_requested:
        return None  # it saved on rtrain's stop for the hang: `_hang` names it
    why = f"on {c.ev.stop_requested}" if c.ev.stop_requested else "on its own"
    grew = None if c.ev.stop_requested else nodes_taken_in(c.ev.stderr_tail)
    if grew is not None:  # standby/rank_host.py: a node waits to join (--nnodes MIN:MAX)
        return FailureKind.PREEMPTED, (f"stopped on its own: {grew} node(s) waiting to join "
                                       "the rendezvous, taken in at the next round (exit 75)")
    return FailureKind.PREEMPTED, f"stopped {why} after committing a checkpoint (exit 75)"


# The rank host's line when it stopped its group for a node waiting to join (GROW_LINE there).
_GREW = re.compile(r"rtrain rank host: (\d+) node\(s\) waiting to join the rendezvous; the "
                   r"group restarts")


def nodes_taken_in(stderr_tail: str) -> int | None:
    """How many nodes waited to join when a rank host stopped its group to take them in (its
    line at the end of the attempt's stderr); None: it did not."""
    found = _GREW.search(stderr_tail[-4096:])
    return None if found is None else int(found.group(1))


def _stop_confirmed(c: _Case) -> _Found:
    ev = c.ev
    if not (ev.stop_requested and ev.stop_confirmed and not ev.killed_after_grace):
        return None
    # Under torchrun the agent's own exit status is not 75, but the ranks said they had
    # committed their checkpoint and stopped (a `stop` heartbeat) before exiting.
    return FailureKind.PREEMPTED, (f"stopped on {ev.stop_requested} after committing a "
                                   f"checkpoint (the workers confirmed it; {c.how})")


def _stop_killed_after_grace(c: _Case) -> _Found:
    ev = c.ev
    if not (ev.stop_requested and ev.killed_after_grace):
        return None
    return FailureKind.PREEMPTED, (f"stop requested by {ev.stop_requested}, but the child did "
                                   f"not save and exit within the grace period and was killed "
                                   f"({c.how}); the newest checkpoint predates the stop")


def _hang(c: _Case) -> _Found:
    # The supervisor's own kill of a silent child arrives as SIGTERM/SIGKILL: name it a hang
    # before any signal rule reads it as something else.
    if not c.ev.hang:
        return None
    how = (f"; it then committed a checkpoint and exited ({c.how})"
           if c.ev.exit_code == ExitCode.PREEMPTED else f" ({c.how})")
    stuck = f"; {c.ev.stuck_summary}" if c.ev.stuck_summary else ""
    return FailureKind.HANG, (f"no progress: {c.ev.hang_detail or 'silent too long'}; "
                              f"stopped by rtrain{how}{stuck}")


def _lost_device(c: _Case) -> _Found:
    if not c.ev.device_lost:
        return None
    return FailureKind.LOST_DEVICE, (f"the GPU was lost "
                                     f"({c.ev.device_detail or 'NVML reports it gone'}); {c.how}")


def _gpu_oom_in_stderr(c: _Case) -> _Found:
    match = GPU_OOM.search(c.ev.stderr_tail)
    if match is None:
        return None
    return FailureKind.OOM_GPU, f"GPU out of memory ({c.how}): {_line_of(c.ev.stderr_tail, match)}"


def _cgroup_oom_kill(c: _Case) -> _Found:
    # The OOM killer may have picked a data-loader worker, so any ending counts.
    if c.ev.cgroup_oom_kills <= 0:
        return None
    return FailureKind.OOM_HOST, (f"{c.how}; the kernel OOM killer killed "
                                  f"{c.ev.cgroup_oom_kills} process(es) in the run's cgroup")


def _sigkill_under_pressure(c: _Case) -> _Found:
    if c.ev.signal != "SIGKILL" or not c.pressure:
        return None
    return FailureKind.OOM_HOST, f"{c.how} while {c.pressure}: out of host memory"


def _host_oom_in_stderr(c: _Case) -> _Found:
    match = HOST_OOM.search(c.ev.stderr_tail)
    if match is None:
        return None
    return FailureKind.OOM_HOST, (f"host out of memory ({c.how}): "
                                  f"{_line_of(c.ev.stderr_tail, match)}")


def _stop_unconfirmed(c: _Case) -> _Found:
    if not c.ev.stop_requested:
        return None
    return FailureKind.PREEMPTED, (f"stop requested by {c.ev.stop_requested}; {c.how} without "
                                   "confirming a checkpoint (no exit 75)")


def _sigkill(c: _Case) -> _Found:
    if c.ev.signal != "SIGKILL":
        return None
    return FailureKind.CRASH, (f"{c.how} with no sign of memory pressure: someone killed it "
                               "(not an out-of-memory)")


def _before_first_step(c: _Case) -> _Found:
    if c.ev.first_step_seen:
        return None
    return FailureKind.STARTUP, _then(f"failed before its first step ({c.how})",
                                      _last_line(c.ev.stderr_tail))


def _crash_reason(c: _Case) -> str:
    last = _torchrun_root_cause(c.ev.stderr_tail) or _last_line(c.ev.stderr_tail)
    step = f" at step {c.ev.last_step}" if c.ev.last_step is not None else ""
    return _then(f"{c.how}{step}", last)


def _then(sentence: str, last_line: str) -> str:
    """The sentence, followed by the stderr line that says most, when there is one."""
    return f"{sentence}: {last_line}" if last_line else sentence


# The rules after the exit records, in the module docstring's order: the first that applies
# names the failure; none applies: a crash.
_RULES: tuple[Callable[[_Case], _Found], ...] = (
    _pressure_stop, _exit_75, _stop_confirmed, _stop_killed_after_grace, _hang, _lost_device,
    _gpu_oom_in_stderr,
    _cgroup_oom_kill, _sigkill_under_pressure, _host_oom_in_stderr, _stop_unconfirmed, _sigkill,
    _before_first_step,
)


# torchrun's failure summary names the rank that failed first, even one killed before it
# could write an exit record.
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)"
                         r".*?traceback\s*:\s*([^\n]+)", re.S)


def _torchrun_root_cause(text: str) -> str | None:
    m = _ROOT_CAUSE.search(text[-8192:])
    if m is None:
        return None
    return f"torchrun: rank {m.group(1)} failed first: {m.group(2).strip()[:300]}"


def _line_of(text: str, match: re.Match[str]) -> str:
    """The whole stderr line holding the match, the line a person would search for."""
    start = text.rfind("\n", 0, match.start()) + 1
    end = text.find("\n", match.end())
    return text[start:end if end != -1 else len(text)].strip()[:300]
