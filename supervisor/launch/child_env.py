"""What an attempt is started with: its argv (knob templates filled in, `--resume-arg`s when it
resumes) and its environment (contract 1: where to write, what to resume from, where to send
heartbeats, the token its control FIFO requests must carry, the checkpoint generation that fences
off writers of earlier attempts, the run's failure record that the worker's save cadence
follows, and the compile caches every attempt shares: compilecache/dirs.py)."""

from __future__ import annotations

import json
import os
import secrets
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrain.checkpoint import generation
from rtrain.supervisor.core import filemode, protocol
from rtrain.supervisor.launch import argv_templates


@dataclass(frozen=True, kw_only=True)
class AttemptPlan:
    """One attempt's coordinates, from which its argv and environment follow."""

    attempt: int
    settings: dict[str, Any]
    resume_from: str | None
    """The chosen checkpoint's resolved path; None for a fresh start."""
    run_dir: Path
    ckpt_dir: Path
    attempt_dir: Path
    failures: int | None = None
    """The run's failures so far that lost work (None: unknown, the log could not be read)."""
    run_s: float | None = None
    """Seconds the run's attempts have run so far."""
    save_cost: dict[str, float] | None = None
    """The save stall and step time the newest `cadence` event measured (None: none yet)."""
    run: str | None = None
    """The run identity (checkpoint/runid.py), the same in every attempt; None: none settled."""


def argv(command: list[str], resume_args: tuple[str, ...], plan: AttemptPlan) -> list[str]:
    values = {**plan.settings, "checkpoint": plan.resume_from or "", "attempt": plan.attempt,
              "run_dir": str(plan.run_dir.resolve()), "ckpt_dir": str(plan.ckpt_dir)}
    out = argv_templates.render(command, values)
    if plan.resume_from is not None:
        out += argv_templates.render(list(resume_args), values)
    return out


def environment(plan: AttemptPlan, *, stop_signal: str, heartbeat_addr: str, dump_signal: int,
                relieve_signal: int, file_mode: int,
                base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update({
        protocol.ENV_RUN_DIR: str(plan.run_dir.resolve()),
        protocol.ENV_CKPT_DIR: str(plan.ckpt_dir.resolve()),
        protocol.ENV_ATTEMPT: str(plan.attempt),
        protocol.ENV_SETTINGS: json.dumps(plan.settings),
        protocol.ENV_STATUS: str(plan.attempt_dir.resolve()),
        protocol.ENV_STOP_SIGNAL: stop_signal,
        protocol.ENV_HEARTBEAT: heartbeat_addr,
        protocol.ENV_DUMP_SIGNAL: signal.Signals(dump_signal).name,
        protocol.ENV_RELIEVE_SIGNAL: signal.Signals(relieve_signal).name,
        filemode.ENV_FILE_MODE: f"{file_mode:04o}",
        # The attempt's own: the worker serves control-FIFO requests only with it. Never
        # written to the run dir (proc/control.py).
        protocol.ENV_CONTROL_TOKEN: secrets.token_hex(16),
        "PYTHONUNBUFFERED": "1",  # output reaches the tee (and hang detection) at once
    })
    for name, value in ((protocol.ENV_FAILURES, plan.failures),
                        (protocol.ENV_RUN_SECONDS, plan.run_s)):
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(round(value, 1) if isinstance(value, float) else value)
    if plan.save_cost:
        env[protocol.ENV_SAVE_COST] = json.dumps(plan.save_cost)
    else:
        env.pop(protocol.ENV_SAVE_COST, None)
    if plan.resume_from:
        env[protocol.ENV_RESUME_FROM] = plan.resume_from
    else:
        env.pop(protocol.ENV_RESUME_FROM, None)
    # Only names rtrain sets are its own: an environment handed down (a nested launch) keeps
    # none of an earlier run's.
    for name in (protocol.ENV_RUN_ID, protocol.ENV_TRACKER_VARS):
        env.pop(name, None)
    return env


def fence_earlier_writers(env: dict[str, str], ckpt_dir: Path,
                          say: Callable[[str], None], node: str | None = None) -> None:
    """Advance the checkpoint dir's generation and hand the new token to the attempt: from now
    on, writers left from earlier attempts cannot commit. `node`: this node's key among
    several sharing the dir (generation.node_key), whose own generation it advances."""
    try:
        token = generation.new_token() if node is None else generation.node_token(node)
        generation.advance(ckpt_dir, token)
        env[protocol.ENV_GENERATION] = token
    except OSError as e:
        env.pop(protocol.ENV_GENERATION, None)
        say(f"cannot write the checkpoint generation in {ckpt_dir} ({e.strerror or e});"
            " writers left from earlier attempts are not fenced off")
