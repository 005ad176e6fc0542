"""Carrying out a decision's side effects outside the run dir: asking Slurm to requeue (away
from the node, after a lost device), waiting for a dead child's GPU memory to be
released and sleeping the backoff before a relaunch, and warning when the run stops with steps
unsaved."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from rtrain.supervisor.config import Config
from rtrain.supervisor.decide.policy import Decision
from rtrain.supervisor.launch.spec import Seams
from rtrain.supervisor.proc import slurm
from rtrain.supervisor.proc.gpu import GpuReader, wait_gpu_released
from rtrain.supervisor.proc.signals import SignalCatcher
from rtrain.supervisor.records import saves
from rtrain.supervisor.records.events import EventLog


def requeue(decision: Decision, events: EventLog, say: Callable[[str], None]) -> str:
    """Ask Slurm to requeue the job (away from this node after a failed device); the stop's
    reason with what Slurm answered."""
    if decision.exclude_node:
        done, what = slurm.exclude_node()
        events.emit("exclude_node", done=done, detail=what)
        say(what)
    done, what = slurm.requeue()
    events.emit("requeue", done=done, detail=what)
    return f"{decision.reason}; {what}"


def wait_before_relaunch(decision: Decision, signals: SignalCatcher, pids: list[int], *,
                         gpu: GpuReader, config: Config, seams: Seams, events: EventLog,
                         say: Callable[[str], None]) -> list[str] | None:
    """Wait for the GPU memory of `pids` to be released, then sleep the backoff. Returns the
    names of the stop signals that cut the backoff short (no child runs then); None when the
    wait ran out."""
    held = wait_gpu_released(gpu, pids, config.gpu_release_wait_s, clock=seams.monotonic,
                             sleep=seams.sleep)
    if held:
        events.emit("gpu_not_released", pids=sorted(held))
        say(f"GPU memory still held by pids {sorted(held)} after "
            f"{config.gpu_release_wait_s:g} s; relaunching anyway")
    if decision.backoff_s > 0 and seams.backoff(decision.backoff_s, signals):
        names = [signal.Signals(s).name for s in signals.take()]
        events.emit("signal", name=",".join(names))
        return names
    return None


def unsaved_final(events: EventLog, last_step: int | None, newest_step: int | None,
                  skipped: list[dict[str, Any]]) -> str | None:
    """The run stops here: when failed saves left its last steps in no checkpoint, record it
    (`final_state_unsaved`) and return the warning; None when the state is saved."""
    warning = saves.unsaved_final(last_step, newest_step, skipped)
    if warning is not None:
        events.emit("final_state_unsaved", last_step=last_step, checkpoint_step=newest_step,
                    skipped_saves=len(skipped), reason=warning)
    return warning
