"""The training child SIGKILLed at random moments, some of them mid-save, loses no sample.

One supervised run is killed at least 12 times: some attempts die inside a save (RTRAIN_FAULTS
kill_in_save), the others are killed from outside, by a thread that reads each attempt's pid
from events.jsonl `launch` events and kills it after a random delay, during start-up or while
it trains (and so sometimes while it saves). rtrain relaunches after each kill. The run must end
bitwise-identical to an uninterrupted one, every checkpoint loaded must have verified at `full`
when it was loaded, the surviving steps must have seen the same samples in the same order, and
no process may be left behind.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from chaos_util import (
    Tail,
    check_exactly_once,
    final_state_diff,
    kill_child,
    reference,
    start_chaos,
    starts,
    step_log,
    surviving,
    wait_gone,
    write_config,
)
from harness import events

# Each attempt costs a Python start with torch's imports, so the kill count sets this test's time:
# 12 kills, 4 of them mid-save and the others from outside (about one in five during start-up,
# the rest while training), reach every kind of moment a kill can hit.
SETTINGS = {"steps": 300, "save_every": 4, "step_sleep": 0.01}  # 12 kills well before the end
KILLS = 12
IN_SAVE = {2, 5, 8, 11}  # attempts armed with kill_in_save; the killer leaves them alone


class Killer(threading.Thread):
    """Kills attempts of one run from outside until `planned` kills were made."""

    def __init__(self, run_dir, planned: int, skip: set[int], seed: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.planned, self.skip = run_dir, planned, skip
        self.rng = random.Random(seed)
        self.kills: list[tuple[int, str]] = []  # (attempt, when)
        self.done = threading.Event()

    def run(self) -> None:
        self.events = Tail(self.run_dir / "events.jsonl")
        self.steps = Tail(self.run_dir / "steps.jsonl")
        self.stepped: set[int] = set()  # attempts that logged a step
        while not self.done.is_set() and len(self.kills) < self.planned:
            for e in self.events.read():
                if e["kind"] == "launch" and e["attempt"] not in self.skip:
                    self._kill_one(e["attempt"], e["pid"])
            time.sleep(0.01)

    def _kill_one(self, attempt: int, pid: int) -> None:
        marker = str(self.run_dir)
        if self.rng.random() < 0.2:  # during start-up: imports, restore
            time.sleep(self.rng.uniform(0.0, 1.5))
            when = "start-up"
        else:  # while training: wait for this attempt's first step, then a random moment
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not self.done.is_set():
                self.stepped.update(r["a"] for r in self.steps.read() if "step" in r)
                if attempt in self.stepped:
                    break
                time.sleep(0.005)
            time.sleep(self.rng.uniform(0.0, 0.25))
            when = "training"
        if kill_child(pid, marker):
            self.kills.append((attempt, when))


@pytest.mark.slow
@pytest.mark.soak  # a loop of random kills
def test_random_kills_end_bitwise_identical(tmp_path):
    ref = reference(tmp_path, SETTINGS)
    write_config(tmp_path / "rtrain.toml", SETTINGS)
    run = tmp_path / "run"
    spec = "; ".join(f"kill_in_save@step=0,attempt={a}" for a in sorted(IN_SAVE))
    killer = Killer(run, KILLS - len(IN_SAVE), IN_SAVE, seed=4)
    killer.start()
    proc = start_chaos(run, faults=spec)
    try:
        _, err = proc.communicate(timeout=400)
    finally:
        killer.done.set()
        if proc.poll() is None:
            proc.kill()
    killer.join(timeout=10)
    assert proc.returncode == 0, err[-3000:]

    exits = events(run, "exit")
    killed = [e["attempt"] for e in exits if e["signal"] == "SIGKILL"]
    assert len(killed) >= KILLS, (killed, killer.kills)
    assert set(killed) >= IN_SAVE, "an armed kill_in_save did not fire"
    assert {c["failure"] for c in events(run, "classification")} == {"crash"}
    assert not events(run, "give_up")

    log = step_log(run)
    # Every checkpoint loaded verified at `full` just before it was loaded (the script checks
    # RTRAIN_RESUME_FROM itself), and it was the one rtrain announced in its launch event.
    launched = {e["attempt"]: e["resume_from"] for e in events(run, "launch")}
    for rec in starts(log):
        assert rec["resume_from"] == launched[rec["a"]]
        if rec["resume_from"] is not None:
            assert rec["verified_full"] is True, rec
            assert "/checkpoint-" in rec["resume_from"], rec
    assert not events(run, "skipped_checkpoint")

    traj = surviving(log)
    want = surviving(step_log(ref))
    assert [traj[s]["ids"] for s in sorted(traj)] == [want[s]["ids"] for s in sorted(want)]
    check_exactly_once(traj, samples=64, steps=SETTINGS["steps"])
    assert final_state_diff(run, ref) is None
    assert wait_gone(str(run)) == [], "processes of the run are still alive"
