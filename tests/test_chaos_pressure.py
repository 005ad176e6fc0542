"""Degrade before the OOM, for real: rtrain and its child run in a cgroup-v1 memory group with a
hard limit, and the child's memory grows every step. Sustained pressure first asks the child to
relieve it; a child that frees nothing is then stopped at a step boundary (it saves) and
relaunched one rung down, before the kernel's OOM killer fires: no kill, no step run twice. A
child that frees its cache on the request trains on at its batch size."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import harness
import pytest
from chaos_util import write_config
from harness import CHILDREN, child_env, events, rtrain_cmd

LIMIT = 1 << 30
# The child (torch) and rtrain start near 400 MiB together; at batch_size 16 the child keeps
# 4 MiB more per step, so the 0.7 line (717 MiB) is crossed within ~100 of its 200 steps, and
# the 300 MiB between that line and the limit take it several seconds to fill: enough for two
# 0.5 s windows and a save. At batch_size 8 (2 MiB a step) a whole run stays under the line.
SETTINGS = {"batch_size": 16, "grad_accum": 1, "steps": 200, "grow_kb": 256,
            "step_sleep": 0.05, "save_every": 50}
PRESSURE = {"fraction": 0.7, "sustain_s": 0.5}


@pytest.fixture
def memory_cgroup():
    with harness.memory_cgroup("rtrain-pressure", LIMIT) as cg:
        yield cg


def _oom_kills(cg: Path) -> int:
    for line in (cg / "memory.oom_control").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    raise AssertionError("no oom_kill counter in memory.oom_control")


def _start_in(cg: Path, tmp_path: Path, settings: dict, faults: str = "", tuned: bool = True,
              python: tuple[str, ...] = (), **config) -> tuple[Path, subprocess.Popen]:
    """rtrain launching leak_train.py inside `cg`; `tuned`: the 0.1 s samples and PRESSURE,
    else the defaults of `sample_interval_s` and `[pressure]`; `python`: the interpreter
    named before the script (a `python SCRIPT` command can have a warm standby)."""
    if tuned:
        config = {"sample_interval_s": 0.1, "pressure": PRESSURE, **config}
    write_config(tmp_path / "rtrain.toml", settings, **config)
    run = tmp_path / "run"
    argv = rtrain_cmd("launch", "--run-dir", str(run), "-q", *python,
                      str(CHILDREN / "leak_train.py"), "{run_dir}")
    cmd = " ".join(f"'{a}'" for a in argv)
    proc = subprocess.Popen(["sh", "-c", f"echo $$ > {cg}/cgroup.procs && exec {cmd}"],
                            env=child_env(RTRAIN_FAULTS=faults), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return run, proc


def _finish(run: Path, proc: subprocess.Popen) -> list[dict]:
    _, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err[-3000:]
    return _steps(run)


def _steps(run: Path) -> list[dict]:
    path = run / "steps.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(ln) for ln in text.splitlines() if ln.endswith("}")]


def _launch_in(cg: Path, tmp_path: Path, settings: dict,
               tuned: bool = True, **config) -> tuple[Path, list[dict]]:
    run, proc = _start_in(cg, tmp_path, settings, tuned=tuned, **config)
    return run, _finish(run, proc)


@pytest.mark.slow
@pytest.mark.soak  # a degrade on pressure: the steady-growth test below, by the default line
def test_a_child_that_frees_nothing_is_stopped_and_degraded_before_the_kill(tmp_path,
                                                                            memory_cgroup):
    run, lines = _launch_in(memory_cgroup, tmp_path, SETTINGS)

    assert _oom_kills(memory_cgroup) == 0, "the kernel OOM killer fired"
    exits = events(run, "exit")
    assert all(e["signal"] is None for e in exits), exits
    assert exits[0]["returncode"] == 75  # saved at a step boundary, then exited
    pressure = events(run, "memory_pressure")
    assert [p["action"] for p in pressure[:2]] == ["relieve", "degrade"], pressure
    assert pressure[0]["source"] == "cgroup" and pressure[0]["limit"] == LIMIT
    assert pressure[0]["used"] >= 0.7 * LIMIT
    relieved = events(run, "pressure_relieved")
    assert relieved and relieved[0]["attempt"] == 0 and "gc collected" in relieved[0]["detail"]

    [first, *_] = events(run, "classification")
    assert first["failure"] == "memory_pressure", first
    assert "no step lost" in first["reason"]
    launches = events(run, "launch")
    sizes = [(e["settings"]["batch_size"], e["settings"]["grad_accum"]) for e in launches]
    assert sizes[:2] == [(16, 1), (8, 2)], sizes
    assert events(run, "degrade")[0]["change"].startswith("batch_size 16 -> 8")

    steps = [ln["step"] for ln in lines if "step" in ln]
    assert steps == list(range(1, SETTINGS["steps"] + 1)), "a step ran twice or never"
    last0 = max(ln["step"] for ln in lines if ln.get("a") == 0 and "step" in ln)
    # The stop's own checkpoint: attempt 1 resumed from the last step attempt 0 ran.
    assert launches[1]["resume_from"].endswith(f"checkpoint-{last0}")
    assert last0 % SETTINGS["save_every"] != 0  # not a scheduled save: the stop's
    starts = [ln for ln in lines if "start" in ln]
    assert starts[1]["start"] == last0 and starts[1]["settings"]["batch_size"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("memory", [1, pytest.param(-2, marks=pytest.mark.soak, id="default")])
def test_pressure_drops_the_memory_tier_before_anything_is_asked_of_the_training(
        tmp_path, memory_cgroup, memory):
    """The memory tier's snapshots count against the run's cgroup: when the watch asks the
    child to relieve, rtrain has dropped the tier first (its snapshots freed, no more in that
    attempt), and still no OOM kill and no step run twice. The same with the tier on by
    default (`memory=` left out: -2)."""
    run, lines = _launch_in(memory_cgroup, tmp_path, {**SETTINGS, "memory": memory})
    assert _oom_kills(memory_cgroup) == 0
    kinds = [(e["kind"], e.get("state")) for e in events(run)
             if e["kind"] in ("memory_tier", "memory_pressure") and e.get("attempt") == 0]
    assert kinds[0] == ("memory_tier", "on"), kinds
    first_ask = kinds.index(next(k for k in kinds if k[0] == "memory_pressure"))
    assert ("memory_tier", "dropped") in kinds[:first_ask], kinds
    [dropped] = [e for e in events(run, "memory_tier") if e["state"] == "dropped"
                 and e["attempt"] == 0]
    assert dropped["reason"].startswith("memory pressure: ")
    stopped = [e for e in events(run, "memory_tier") if e["state"] == "off"
               and e["attempt"] == 0]
    assert stopped and "rtrain dropped it" in stopped[0]["reason"]  # no snapshot after it
    steps = [ln["step"] for ln in lines if "step" in ln]
    assert steps == list(range(1, SETTINGS["steps"] + 1)), "a step ran twice or never"


@pytest.mark.slow
@pytest.mark.soak  # relief in process; the stop and degrade is the default tier's
def test_a_child_that_frees_its_cache_trains_on_at_its_batch_size(tmp_path, memory_cgroup):
    run, lines = _launch_in(memory_cgroup, tmp_path, {**SETTINGS, "free_on_relieve": True})

    assert _oom_kills(memory_cgroup) == 0
    pressure = events(run, "memory_pressure")
    assert pressure and {p["action"] for p in pressure} == {"relieve"}, pressure
    relieved = events(run, "pressure_relieved")
    assert relieved and "cache of" in relieved[0]["detail"]
    assert len(events(run, "launch")) == 1 and events(run, "classification") == []
    assert events(run, "exit")[0]["returncode"] == 0
    assert {ln["bs"] for ln in lines if "step" in ln} == {16}


@pytest.mark.slow
@pytest.mark.soak  # the two pressure cases above are the default tier's
def test_the_climb_back_waits_for_room_then_climbs(tmp_path, memory_cgroup):
    # Degraded by pressure near step 140 (batch 16 -> 8). Attempt 1 crashes at step 200, over
    # restore_after_steps (40) healthy steps on rung 1: rung 0 peaked near the 1 GiB limit, so
    # it stays. While attempt 2 runs the limit grows to 4 GiB; it crashes at step 240 (from the
    # checkpoint at 150 or later): now rung 0's recorded peak fits, and attempt 3 runs at 16.
    run, proc = _start_in(memory_cgroup, tmp_path, {**SETTINGS, "steps": 300},
                          faults="crash@step=200,attempt=1; crash@step=240,attempt=2",
                          restore_after_steps=40)
    deadline = time.monotonic() + 240
    while not any(ln.get("a") == 2 for ln in _steps(run)):
        assert proc.poll() is None and time.monotonic() < deadline, "attempt 2 never started"
        time.sleep(0.1)
    for name in ("memory.memsw.limit_in_bytes", "memory.limit_in_bytes"):  # memsw >= memory
        try:
            (memory_cgroup / name).write_text(str(4 * LIMIT))
        except OSError:
            assert name.startswith("memory.memsw"), name
    lines = _finish(run, proc)

    starts = [ln for ln in lines if "start" in ln]
    assert starts[1]["start"] <= 160, "degraded too late for the healthy-step count"
    assert _oom_kills(memory_cgroup) == 0
    assert [e["failure"] for e in events(run, "classification")] == [
        "memory_pressure", "crash", "crash"]
    assert [e["level"] for e in events(run, "launch")] == [0, 1, 1, 0]
    reasons = [e["reason"] for e in events(run, "decision")]
    assert "staying on this rung after 40 healthy steps: the rung above does not fit" \
        in reasons[1]
    assert "climbing back one rung after 40 healthy steps" in reasons[2]
    assert "of 4096 MiB fit with 10% headroom" in reasons[2]
    assert [ln["settings"]["batch_size"] for ln in starts] == [16, 8, 8, 16]
    peaks = json.loads((run / "state.json").read_text())["history"]["rung_peaks"]
    assert peaks["0"]["host"] > 0.6 * LIMIT and peaks["1"]["host"] < peaks["0"]["host"]


# ------------------------------------------------------------------ the defaults

SMALL = 700 << 20
# 8 MiB more each 0.45 s step at batch 32: 18 MiB/s, from 55% of a 700 MiB limit (rtrain, torch
# and memory held for it): the limit is reached about 17 s (38 steps) into training. At batch 16
# (one rung down) the rest of the run grows 4 MiB a step and fits.
GROWING = {"batch_size": 32, "grad_accum": 1, "steps": 42, "grow_kb": 256, "step_sleep": 0.45,
           "save_every": 10, "fill_to": 0.55}


@pytest.fixture
def small_cgroup():
    with harness.memory_cgroup("rtrain-pressure-defaults", SMALL) as cg:
        yield cg


@pytest.mark.slow
def test_with_the_defaults_a_steady_growth_is_degraded_before_the_kill(tmp_path, small_cgroup):
    # The pressure watch's defaults; the zygote kept to its first heartbeat (where an idle core
    # starts it sooner, the standby it makes is dropped first and its 300 MiB freed leave the
    # growth room to finish: test_rising_pressure_drops_the_warm_standby_first is that case).
    run, lines = _launch_in(small_cgroup, tmp_path, GROWING, tuned=False,
                            standby_idle_cores=1e9)

    assert _oom_kills(small_cgroup) == 0, "the kernel OOM killer fired"
    exits = events(run, "exit")
    assert all(e["signal"] is None for e in exits), exits
    assert exits[0]["returncode"] == 75
    pressure = events(run, "memory_pressure")
    assert pressure and pressure[-1]["action"] == "degrade", pressure
    assert all(p["attempt"] == 0 and p["source"] == "cgroup" for p in pressure), pressure
    assert "MiB/s" in pressure[-1]["why"] and pressure[-1]["left_s"] > 0, pressure
    assert pressure[0]["used"] < 0.95 * SMALL  # the trend, before the hard line
    [first, *_] = events(run, "classification")
    assert first["failure"] == "memory_pressure" and "no step lost" in first["reason"], first
    launches = events(run, "launch")
    assert [e["settings"]["batch_size"] for e in launches] == [32, 16]
    steps = [ln["step"] for ln in lines if "step" in ln]
    assert steps == list(range(1, GROWING["steps"] + 1)), "a step ran twice or never"
    last0 = max(ln["step"] for ln in lines if ln.get("a") == 0 and "step" in ln)
    assert launches[1]["resume_from"].endswith(f"checkpoint-{last0}")


@pytest.mark.slow
def test_with_the_defaults_a_run_flat_at_92_percent_is_left_alone(tmp_path, small_cgroup):
    # 30 steps of 0.3 s: past the trend's window (8 s) and the hard line's sustain_s (5 s)
    flat = {**GROWING, "grow_kb": 0, "fill_to": 0.92, "steps": 30, "step_sleep": 0.3}
    # The zygote kept to its first heartbeat, as above: one an idle core starts during the
    # child's fill is counted in it, and its standby, dropped first at the rise, leaves 63%.
    run, lines = _launch_in(small_cgroup, tmp_path, flat, tuned=False, standby_idle_cores=1e9)

    assert _oom_kills(small_cgroup) == 0
    assert events(run, "memory_pressure") == []
    assert len(events(run, "launch")) == 1 and events(run, "exit")[0]["returncode"] == 0
    assert [ln["step"] for ln in lines if "step" in ln] == list(range(1, 31))
    shares = sorted(ln["share"] for ln in lines if "step" in ln)
    assert 0.91 <= shares[len(shares) // 2] < 0.95, shares  # flat at 92%, as the watch reads it


@pytest.mark.slow
def test_rising_pressure_drops_the_warm_standby_first(tmp_path):
    # Under 1200 MiB, rtrain and the child near 300 MiB leave room for a standby (it imports
    # torch, up to 300 MiB, in rtrain's memory cgroup: the run's). 32 MiB more a step: within
    # about 9 s of the limit the trend says pressure is rising, and the standby goes before
    # anything is asked of the training.
    limit = 1200 << 20
    with harness.memory_cgroup("rtrain-pressure-standby", limit) as cg:
        run, proc = _start_in(cg, tmp_path, {**GROWING, "grow_kb": 1024, "steps": 18,
                                             "fill_to": 0.01}, tuned=False,
                              python=(sys.executable,))
        _, err = proc.communicate(timeout=150)
        assert proc.returncode == 0, err[-3000:]
        assert _oom_kills(cg) == 0
    kinds = [e["kind"] for e in events(run) if e["kind"].startswith(("standby", "memory"))]
    dropped = [e for e in events(run, "standby_discarded")
               if e["reason"].startswith("memory pressure: the run's cgroup at")]
    assert dropped and dropped[0]["attempt"] == 0, kinds
    first = kinds.index("standby_discarded")
    assert "memory_pressure" not in kinds[:first], kinds  # before anything was asked
    # And none again in that attempt (a relaunch, if the load made the trend steep enough to
    # stop the training too, starts its own).
    again = [e for e in events(run, "standby_ready")
             if e["attempt"] == dropped[0]["attempt"] and e["time"] > dropped[0]["time"]]
    assert not again, kinds
    assert "dropped the warm standby" in err and "counts against the same memory" in err
