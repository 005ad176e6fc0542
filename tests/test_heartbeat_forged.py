"""Heartbeats from anyone but the attempt's own processes are refused (proc/senders.py): from
another user, and from this user's processes outside the attempt's tree. Real processes, a real
other uid (nobody, through setpriv), the real socket.

Each kind of heartbeat is forged: a `persist` asking for a prune to one checkpoint deletes
nothing (the Keep policy is the snapshot manifest's, and the datagram is refused anyway), step
heartbeats do not hide a hang, and the script's own heartbeats still count."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import CHILDREN, child_env, events, launch_2_ranks, launch_cmd, wait_for

from rtrain.supervisor.core.protocol import PROTOCOL_VERSION
from rtrain.supervisor.proc.heartbeat import HeartbeatReceiver

pytestmark = pytest.mark.slow

NOBODY = 65534
PYTHON = os.path.realpath(sys.executable)  # the interpreter itself: nobody may run it
KINDS = ["start", "step", "save_begin", "save_end", "save_skipped", "saved_at_failure",
         "exiting", "hang_save_done", "control_refused", "cadence", "backoff", "snapshot",
         "persist", "compile_cache_loaded", "relieved", "exception", "stop"]
KEEP_1 = {"keep": 1, "keep_best": 0, "metric": None, "mode": "min", "milestone_every": 0}

# Sends every kind of heartbeat (or only step ones, with rising steps) to ADDRESS for SECONDS,
# as rank 0 with a plausible pid; prints how the sends went. BLOCK "1": wait for room in the
# receiver's queue (the attempt's own sender, drained meanwhile).
FORGER = r"""
import json, socket, sys, time
address, seconds = sys.argv[1], float(sys.argv[2])
only_steps, v = sys.argv[3] == "1", int(sys.argv[4])
kinds = json.loads(sys.argv[5])
keep = json.loads(sys.argv[6])
flags = 0 if sys.argv[7] == "1" else socket.MSG_DONTWAIT  # a forger is not drained meanwhile
addr = b"\0" + address[1:].encode() if address.startswith("@") else address
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sent, errors, step, end = 0, set(), 10**6, time.monotonic() + seconds
while time.monotonic() < end:
    for kind in (["step"] if only_steps else kinds):
        step += 1
        # persist: "the newest snapshot at step 1 or later", then prune to keep=1
        hb = {"v": v, "pid": 1, "rank": 0, "time": time.time(), "event": kind,
              "step": 1 if kind == "persist" else step,
              "persist": keep, "snapshot": {"off": "forged"}, "reason": "forged",
              "settings": {"batch_size": 1}, "max_step_interval": 1e9}
        try:
            s.sendto(json.dumps(hb).encode(), flags, addr)
            sent += 1
        except OSError as e:
            errors.add(e.__class__.__name__)
    time.sleep(0.1)
print(json.dumps({"sent": sent, "errors": sorted(errors)}))
"""


def _forge(address: str, *, uid: int | None = None, seconds: float = 1.0,
           only_steps: bool = False) -> subprocess.Popen:
    argv = [PYTHON, "-I", "-c", FORGER, address, str(seconds), "1" if only_steps else "0",
            str(PROTOCOL_VERSION), json.dumps(KINDS), json.dumps(KEEP_1), "0"]
    if uid is not None:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd="/", env=child_env())


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out)


def _drain_while(r: HeartbeatReceiver, *procs: subprocess.Popen) -> list:
    """What `r` hears while `procs` run (as rtrain drains: the queue holds a few only)."""
    heard, deadline = [], time.monotonic() + 60
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        heard += r.drain()
        time.sleep(0.01)
    return heard + r.drain()


def _needs_setpriv() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another user")


def test_the_receiver_hears_the_attempts_tree_only(tmp_path):
    """The gate alone, on an abstract socket (which anyone may send to): another uid and this
    uid's processes outside the attempt are refused, the attempt's root's grandchild heard."""
    _needs_setpriv()
    with HeartbeatReceiver(name=f"@rtrain-test-{os.getpid()}") as r:
        # The attempt: a process whose child, once told, sends one heartbeat of each kind.
        go = tmp_path / "go"
        root = subprocess.Popen(
            [PYTHON, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])",
             PYTHON, "-c", "import os, sys, time\n"
             "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
             "sys.argv = sys.argv[2:]\n"
             "exec(sys.argv[0])", str(go), FORGER, r.name, "0.3", "0", str(PROTOCOL_VERSION),
             json.dumps(KINDS), json.dumps(KEEP_1), "1"], stdout=subprocess.PIPE, text=True,
            env=child_env())
        r.attempt(root.pid)
        other = _forge(r.name, uid=NOBODY, seconds=0.5)
        outside = _forge(r.name, seconds=0.5)
        got = _drain_while(r, other, outside)
        assert _result(other)["sent"] > 0 and _result(outside)["sent"] > 0
        assert got == []  # refused, every kind
        refused = r.gate.take_refused()
        assert any(f"uid {NOBODY}" in k for k in refused)
        assert any(f"pid {outside.pid} (a process outside the attempt)" == k for k in refused)
        go.touch()
        heard = _drain_while(r, root)
        out, _ = root.communicate(timeout=60)
        assert json.loads(out)["sent"] > 0
        heard += r.drain()
        assert {hb.event for hb in heard} == set(KINDS)  # the attempt's own: all heard
        grandchild = {hb.pid for hb in heard}
        assert len(grandchild) == 1 and grandchild != {1}  # the sender's pid, not its word
        assert all(not hasattr(hb, "persist") for hb in heard)  # a policy is never read
        assert r.gate.take_refused() == {}


def _start(tmp_path: Path, mode: str, *args: str) -> tuple[subprocess.Popen, Path, str]:
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        launch_cmd(run, "--max-restarts", "0", *args, str(CHILDREN / "hb_target.py"),
                   str(out), mode),
        cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        address = wait_for(out / "address", timeout=90)
    except BaseException:
        proc.kill()
        raise
    return proc, run, address


def test_forged_heartbeats_of_every_kind_move_nothing(tmp_path):
    """A run that keeps every checkpoint, the memory tier on: another user and this user's
    process outside the run send every kind of heartbeat, `persist` ones asking for keep=1.
    Nothing is pruned, the tier is not turned off, no refused request is reported for the
    worker; the refusals are said in one event; the script's own heartbeats still count."""
    _needs_setpriv()
    proc, run, address = _start(tmp_path, "wait")
    try:
        other = _forge(address, uid=NOBODY, seconds=2.0)
        outside = _forge(address, seconds=2.0)
        other_sent, outside_sent = _result(other), _result(outside)
        time.sleep(1.0)  # a copy and a prune, had one been asked, would be done by now
        (tmp_path / "out" / "go").touch()
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    steps = sorted(int(p.name.rsplit("-", 1)[1]) for p in (run / "checkpoints").iterdir()
                   if p.name.startswith("checkpoint-"))
    assert steps[:6] == [1, 2, 3, 4, 5, 6]  # keep=None: every one stays
    assert not address.startswith("@")  # a socket file in a directory of this user's
    assert "PermissionError" in other_sent["errors"]  # another user cannot even send
    assert outside_sent["sent"] > 0
    [refused] = events(run, "heartbeats_refused")
    assert refused["count"] > 0 and "outside the attempt" in " ".join(refused["senders"])
    assert "refused" in err and "heartbeat" in err
    assert not [e for e in events(run, "memory_tier") if e.get("reason") == "forged"]
    assert not events(run, "control_refused") and not events(run, "pressure_relieved")
    assert not events(run, "snapshot_persisted") or all(
        e["why"] != "disk cadence" for e in events(run, "snapshot_persisted"))
    summaries = [e for e in events(run, "heartbeat_summary") if e["step"] is not None]
    assert summaries and max(e["step"] for e in summaries) < 10**6  # the script's steps


def test_forged_step_heartbeats_do_not_hide_a_hang(tmp_path):
    """The script stops sending and sleeps; someone outside the run sends a step heartbeat
    every 0.1 s with rising steps. rtrain still finds the hang after its timeout."""
    proc, run, address = _start(tmp_path, "hang", "--hang-timeout", "4", "--grace", "2")
    forger = _forge(address, seconds=40, only_steps=True)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        forger.kill()
        forger.communicate()
    [c] = events(run, "classification")
    assert c["failure"] == "hang", err
    assert "no heartbeat" in c["reason"]


def test_the_ranks_under_torchrun_are_heard_and_none_refused(tmp_path):
    """Honest heartbeats from two ranks (torchrun's children, the script's grandchildren of
    rtrain's child): heard, none refused."""
    run = tmp_path / "run"
    r = launch_2_ranks(run, str(tmp_path / "out"), "6")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not events(run, "heartbeats_refused") and "refused" not in r.stderr
    assert [e["step"] for e in events(run, "heartbeat_summary") if e["step"] is not None]
    [ended] = events(run, "exit")
    assert ended["last_step"] == 6, ended  # the step heartbeats were heard to the end
