"""Done-when of the restart policy, end to end with the default configuration: a run whose
training child is SIGKILLed 6 times at random moments, each time after it made progress, still
finishes, bitwise-identical to an uninterrupted run (budgets refill with progress); kills
before any checkpoint stop by the crash-loop rule, and the run then stays down."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from chaos_util import (
    Tail,
    final_state_diff,
    kill_child,
    launch_chaos,
    reference,
    start_chaos,
    wait_gone,
)
from harness import events

from rtrain.supervisor.records.runstate import load_state

SETTINGS = {"steps": 360, "save_every": 4, "step_sleep": 0.01}
KILLS = 6
PROGRESS = 30  # steps an attempt makes before it may be killed (> forgive_after_steps, 20)


def default_config(path: Path) -> None:
    """Only the training knobs: every [restart] and [backoff] value is rtrain's default."""
    path.write_text("[settings]\n" + "".join(f"{k} = {v}\n" for k, v in SETTINGS.items()))


class Killer(threading.Thread):
    """SIGKILLs each new attempt once it has trained `after` steps (then a random moment
    later), or, with `after` None, during its start-up, until `planned` kills were made."""

    def __init__(self, run: Path, planned: int, after: int | None, seed: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.planned, self.after = run, planned, after
        self.rng = random.Random(seed)
        self.kills: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        launches, steps = Tail(self.run_dir / "events.jsonl"), Tail(self.run_dir / "steps.jsonl")
        first: dict[int, int] = {}  # attempt -> first step it logged
        last: dict[int, int] = {}
        pending: list[tuple[int, int]] = []
        while not self.done.is_set() and len(self.kills) < self.planned:
            pending += [(e["attempt"], e["pid"]) for e in launches.read() if e["kind"] == "launch"]
            for rec in steps.read():
                if "step" in rec:
                    first.setdefault(rec["a"], rec["step"])
                    last[rec["a"]] = rec["step"]
            for attempt, pid in list(pending):
                trained = last.get(attempt, 0) - first.get(attempt, 0)
                if self.after is None or trained >= self.after:
                    time.sleep(self.rng.uniform(0.0, 0.3))
                    if kill_child(pid, str(self.run_dir)):
                        self.kills.append(attempt)
                    pending.remove((attempt, pid))
            time.sleep(0.005)


def supervise(tmp_path: Path, after: int | None, planned: int) -> tuple[Path, int, Killer]:
    default_config(tmp_path / "rtrain.toml")
    run = tmp_path / "run"
    killer = Killer(run, planned, after, seed=9)
    killer.start()
    proc = start_chaos(run)
    try:
        proc.communicate(timeout=500)
    finally:
        killer.done.set()
        if proc.poll() is None:
            proc.kill()
    killer.join(timeout=10)
    assert wait_gone(str(run)) == [], "processes of the run are still alive"
    return run, proc.returncode, killer


@pytest.mark.slow
@pytest.mark.soak  # six kills in a row; one is the default tier's
def test_six_kills_after_progress_finish_bitwise_identical(tmp_path):
    ref = reference(tmp_path, SETTINGS)
    run, code, killer = supervise(tmp_path, PROGRESS, KILLS)
    assert code == 0, events(run, "give_up")
    killed = [e["attempt"] for e in events(run, "exit") if e["signal"] == "SIGKILL"]
    assert len(killed) == KILLS, (killed, killer.kills)
    assert not events(run, "give_up")
    decisions = [d for d in events(run, "decision") if d["action"] == "relaunch"]
    assert len(decisions) == KILLS  # 6 crashes > the default crash budget (3)...
    h = load_state(run).history  # ... none charged: each came after a newer checkpoint
    assert h.total_restarts == 0 and h.budgets_used == {}
    assert final_state_diff(run, ref) is None


@pytest.mark.slow
def test_kills_before_any_checkpoint_stop_by_the_crash_loop_rule(tmp_path):
    run, code, _ = supervise(tmp_path, None, 10)
    assert code == 1
    assert len(events(run, "launch")) == 3  # crash_loop_k = 3 by default
    give_up = events(run, "give_up")[0]
    assert "crash loop: 3 consecutive attempts ended without a newer verified checkpoint " \
           "(newest: none (no checkpoint yet))" in give_up["reason"]
    again = launch_chaos(run)  # the same command, as a cron or Slurm wrapper repeats it
    assert again.returncode == 5, again.stderr
    assert "gave up" in again.stderr and "--retry" in again.stderr
    assert len(events(run, "launch")) == 3  # nothing launched
