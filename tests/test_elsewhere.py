"""Never a silent restart from scratch: the rule (elsewhere/decide.py) by table, the bounded scan
on real files, the launch's watch at attempt ends, `rtrain status`, and one real run whose
script writes out/ckpt.pt while rtrain watches an empty dir."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import tuned
from harness import child_env, events, launch, launch_cmd, run_rtrain, write_events
from scripted_loop import Script, crash, success

from rtrain.supervisor.commands.status import render_text, summarize
from rtrain.supervisor.config import load_config
from rtrain.supervisor.decide.observation import Observation
from rtrain.supervisor.elsewhere.decide import Reason, Seen, Written, judge
from rtrain.supervisor.elsewhere.scan import ElsewhereWatch, scan, shown_path
from rtrain.supervisor.launch.loop import LaunchSpec
from rtrain.supervisor.launch.loop import launch as launch_loop
from rtrain.supervisor.records.events import EventLog

CHILDREN = Path(__file__).resolve().parent / "children"
CKPT = Written(path="out/ckpt.pt", mtime=100.0)


def seen(**kw) -> Seen:
    base = {"hands": True, "worker": False, "watched": "./checkpoints", "resumable": False,
            "present": (), "written": (CKPT,)}
    return Seen(**{**base, **kw})


@pytest.mark.parametrize("kw, reason", [
    ({}, Reason.ELSEWHERE),
    ({"resumable": True}, None),                                  # resume works
    ({"written": ()}, Reason.EMPTY),                              # nothing anywhere yet
    ({"written": (), "present": ("notes.txt",)}, Reason.NOT_CHECKPOINTS),
    ({"hands": False}, Reason.NO_HANDOFF),                        # nothing takes one
    ({"hands": False, "worker": True}, Reason.EMPTY),             # the Checkpointer would
    ({"hands": False, "worker": True, "present": ("a.txt",)}, Reason.NOT_CHECKPOINTS),
])
def test_the_rule(kw, reason):
    notice = judge(seen(**kw))
    assert (notice.reason if notice else None) is reason


@pytest.mark.parametrize("written, suggest, named", [
    ((CKPT,), "out", "out/ckpt.pt"),
    ((Written(path="ckpt.pt", mtime=1.0),), ".", "ckpt.pt"),
    # A Trainer's checkpoint dir: its parent is the dir to watch.
    ((Written(path="out/checkpoint-40/", mtime=5.0, is_dir=True),), "out",
     "out/checkpoint-40/"),
    # The newest file names the dir; every file is in the event.
    ((Written(path="a/old.pt", mtime=1.0), Written(path="b/new.pt", mtime=9.0)), "b",
     "b/new.pt, a/old.pt"),
])
def test_the_notice_names_the_files_and_the_dir(written, suggest, named):
    w = judge(seen(written=written))
    assert w is not None and w.ckpt_dir == suggest
    assert w.message == (f"rtrain cannot resume this script: ./checkpoints holds no checkpoint, "
                         f"while the script wrote {named}: pass --ckpt-dir {suggest} "
                         "(until then each relaunch starts fresh)")


@pytest.mark.parametrize("kw, message", [
    ({"hands": False, "written": ()},
     "rtrain cannot resume this script: ./checkpoints holds no checkpoint, and nothing hands "
     "one to the script (no --resume-arg, no {checkpoint} in its arguments, no "
     "rtrain.Checkpointer): each relaunch starts fresh; pass --resume-arg with the script's "
     "resume option and --ckpt-dir where it saves"),
    ({"written": (), "present": ("data/", "notes.txt")},
     "rtrain cannot resume this script: ./checkpoints holds no checkpoint, only data/, "
     "notes.txt, which rtrain does not recognise as checkpoints: each relaunch starts fresh "
     "until the script saves one there (pass --ckpt-dir where it saves)"),
    ({"written": ()},
     "nothing to resume from yet: ./checkpoints holds no checkpoint (the script ended before "
     "it saved one there): each relaunch starts fresh until it does (if it saves elsewhere, "
     "pass that --ckpt-dir)"),
])
def test_each_reason_says_what_to_do(kw, message):
    notice = judge(seen(**kw))
    assert notice is not None and notice.message == message


def test_many_files_are_counted_not_listed():
    written = tuple(Written(path=f"out/s{i}.pt", mtime=float(i)) for i in range(5))
    w = judge(seen(written=written))
    assert w is not None and len(w.files) == 5
    assert "out/s4.pt, out/s3.pt, out/s2.pt and 2 more: pass --ckpt-dir out" in w.message
    w = judge(seen(written=(), present=tuple(f"f{i}.txt" for i in range(5))))
    assert w is not None and "only f0.txt, f1.txt, f2.txt and 2 more, which" in w.message


def _touch(path: Path, mtime: float | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def test_scan_finds_what_the_script_wrote_and_nothing_else(tmp_path):
    since = time.time() - 60
    for name in ("out/ckpt.pt", "w.pth", "m/last.ckpt", "x/model.safetensors", "y/pytorch.bin",
                 "hf/checkpoint-7/model.safetensors"):
        _touch(tmp_path / name)
    for name in ("old/ckpt.pt",):
        _touch(tmp_path / name, mtime=since - 3600)          # before the attempt
    for name in (".hidden/ckpt.pt", "__pycache__/c.pt", "run/checkpoints/c.pt",
                 "watched/c.pt", "out/notes.txt", "hf/training_args.bin",
                 "a/b/c/d/deep.pt"):                          # skipped, or too deep
        _touch(tmp_path / name)
    (tmp_path / "link").symlink_to(tmp_path / "out")          # never followed
    found = scan(tmp_path, since=since, skip=(tmp_path / "run", tmp_path / "watched"))
    assert sorted(w.path for w in found) == [
        "hf/checkpoint-7/", "m/last.ckpt", "out/ckpt.pt", "w.pth", "x/model.safetensors",
        "y/pytorch.bin"]
    assert [w.is_dir for w in found if w.path.startswith("hf/")] == [True]


def test_scan_is_bounded(tmp_path):
    since = time.time() - 60
    for i in range(50):
        _touch(tmp_path / f"f{i:02}.pt")
    assert len(scan(tmp_path, since=since, max_entries=10)) == 10
    _touch(tmp_path / "a/b/c.pt")
    assert [w.path for w in scan(tmp_path / "a", since=since, max_depth=1)] == []
    assert [w.path for w in scan(tmp_path / "a", since=since, max_depth=2)] == ["b/c.pt"]


def test_shown_path(tmp_path):
    assert shown_path(tmp_path / "rtrain-run" / "checkpoints", tmp_path) == \
        "./rtrain-run/checkpoints"
    assert shown_path(tmp_path, tmp_path) == "."
    assert shown_path(Path("/elsewhere/ckpts"), tmp_path) == "/elsewhere/ckpts"


def _watch(tmp_path: Path, said: list[str], **kw) -> ElsewhereWatch:
    run_dir = tmp_path / "rtrain-run"
    run_dir.mkdir(exist_ok=True)
    args = {"hands": True, "cwd": tmp_path, "ckpt_dir": run_dir / "checkpoints",
            "run_dir": run_dir, "events": EventLog(run_dir / "events.jsonl"),
            "say": said.append, **kw}
    return ElsewhereWatch(**args)


KILLED = Observation(returncode=-9, duration_s=3.0)


def test_the_watch_says_it_once_at_the_first_fresh_relaunch(tmp_path):
    said: list[str] = []
    w = _watch(tmp_path, said)
    w.attempt_started(0, fresh=True)
    _touch(tmp_path / "out" / "ckpt.pt")
    w.attempt_ended(KILLED)
    assert said == []                       # the run may end here: nothing to say yet
    w.attempt_started(1, fresh=True)
    assert len(said) == 1 and said[0] == (
        "warning: rtrain cannot resume this script: ./rtrain-run/checkpoints holds no "
        "checkpoint, while the script wrote out/ckpt.pt: pass --ckpt-dir out (until then each "
        "relaunch starts fresh)")
    w.attempt_ended(KILLED)
    w.attempt_started(2, fresh=True)
    assert len(said) == 1                   # once
    assert w.launch_note() == ("nothing to resume from: the script writes out/ckpt.pt; "
                               "pass --ckpt-dir out")
    w.events.close()
    (e,) = events(tmp_path / "rtrain-run", "cannot_resume")
    assert e["attempt"] == 0 and e["files"] == ["out/ckpt.pt"] and e["suggest"] == "out"
    assert e["reason"] == "elsewhere"
    assert e["ckpt_dir"] == str(tmp_path / "rtrain-run" / "checkpoints")


def test_the_watch_names_what_the_dir_holds_instead(tmp_path):
    """`--ckpt-dir .` for a script that saves nothing: its own files are named, never the run
    dir inside it nor rtrain's hidden files."""
    said: list[str] = []
    (tmp_path / "train.py").write_text("")
    (tmp_path / "data").mkdir()
    (tmp_path / ".rtrain-generation").write_text("0" * 32)
    w = _watch(tmp_path, said, hands=False, ckpt_dir=tmp_path)
    w.attempt_started(0, fresh=True)
    w.attempt_ended(KILLED)
    w.attempt_started(1, fresh=True)
    w.events.close()
    (e,) = events(tmp_path / "rtrain-run", "cannot_resume")
    assert e["reason"] == "no_handoff" and e["files"] == ["data/", "train.py"]
    assert said == [f"warning: {e['message']}"] and "no --resume-arg" in said[0]


def test_the_watch_is_quiet_unless_a_failure_is_relaunched_fresh(tmp_path):
    said: list[str] = []
    w = _watch(tmp_path, said)
    w.attempt_started(0, fresh=True)
    w.attempt_ended(Observation(returncode=0))
    w.attempt_started(1, fresh=True)        # after a success (a later launch): nothing failed
    w.attempt_ended(KILLED)
    w.attempt_started(2, fresh=False)       # resumed from a checkpoint
    _touch(tmp_path / "rtrain-run" / "checkpoints" / "ckpt.pt")
    w.attempt_ended(KILLED)
    w.attempt_started(3, fresh=True)        # the dir holds one now
    assert said == []


def test_status_shows_the_notice_while_the_dir_is_empty(tmp_path, make_ckpt):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    message = "rtrain cannot resume this script: ./run/checkpoints holds no checkpoint, ..."
    write_events(run_dir, [
        ("launch", {"attempt": 0, "argv": ["python", "t.py"], "settings": {}, "level": 0,
                    "resume_from": None, "pid": 1, "ckpt_dir": str(ckpts), "standby": False,
                    "start_s": 0.1}),
        ("cannot_resume", {"attempt": 0, "reason": "elsewhere", "ckpt_dir": str(ckpts),
                           "files": ["out/ckpt.pt"], "suggest": "out", "message": message}),
    ])
    s = summarize(run_dir)
    assert s.cannot_resume == {"reason": "elsewhere", "files": ["out/ckpt.pt"],
                               "suggest": "out", "message": message}
    rows = [r.split() for r in render_text(s).splitlines()]
    assert ["warning:", *message.split()] in rows
    make_ckpt(ckpts, 100)                    # now there is something to resume from
    s = summarize(run_dir)
    assert s.checkpoint is not None and s.cannot_resume is None
    assert "cannot resume" not in render_text(s)


class WritesElsewhere(Script):
    """Each scripted attempt writes out/ckpt.pt, as the script would, and runs 30 s."""

    def watch(self, child, config, **kw):
        _touch(Path(child.spec.cwd) / "out" / "ckpt.pt")
        return super().watch(child, config, **kw)


@pytest.mark.parametrize("resume_args, reason", [(("--resume", "{checkpoint}"), "elsewhere"),
                                                 ((), "no_handoff")])
def test_the_loop_says_it_and_again_at_the_next_launch(tmp_path, resume_args, reason):
    script = WritesElsewhere([crash(), success()])
    config = load_config({"run_dir": tmp_path / "run", "backoff.enabled": False}, None,
                         tmp_path)
    spec = LaunchSpec(command=["train.py"], config=config, echo=False, cwd=tmp_path,
                      resume_args=resume_args)
    assert launch_loop(spec, script.seams()) == 0
    (e,) = events(tmp_path / "run", "cannot_resume")
    assert e["attempt"] == 0 and e["reason"] == reason
    assert [x for x in script.said if x == f"warning: {e['message']}"]
    launches = [line for line in script.said if "launched pid" in line]
    assert "(fresh)" in launches[0]
    if reason == "elsewhere":
        assert e["files"] == ["out/ckpt.pt"] and e["suggest"] == "out"
        assert ("(fresh: nothing to resume from: the script writes out/ckpt.pt; pass "
                "--ckpt-dir out)") in launches[1]
    else:
        assert ("(fresh: nothing to resume from: the script takes no checkpoint from "
                "rtrain)") in launches[1]


@pytest.mark.slow
def test_a_script_saving_elsewhere_is_named_with_the_dir_to_pass(tmp_path):
    """A script writes out/ckpt.pt every few steps and crashes once; rtrain watches the default
    (empty) dir with `--resume-arg`: the warning comes once, names out/, and the status and the
    next launch line say it."""
    tuned.write(tmp_path, {"sample_interval_s": 0.2})
    run_dir = tmp_path / "rtrain-run"
    r = launch(run_dir, "--resume-arg=--resume {checkpoint}", "--",
               str(CHILDREN / "save_elsewhere.py"), "--out", "out", "--steps", "60",
               "--crash-at", "40", cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    (e,) = events(run_dir, "cannot_resume")
    assert e["files"] == ["out/ckpt.pt"] and e["suggest"] == "out"
    assert "while the script wrote out/ckpt.pt: pass --ckpt-dir out" in e["message"]
    assert r.stderr.count("warning: rtrain cannot resume this script: ./rtrain-run/checkpoints "
                          "holds no checkpoint, while") == 1
    launches = [line for line in r.stderr.splitlines() if "launched pid" in line]
    assert len(launches) == 2 and "(fresh)" in launches[0]
    assert "(fresh: nothing to resume from: the script writes out/ckpt.pt; pass --ckpt-dir " \
           "out)" in launches[1]
    status = run_rtrain("status", str(run_dir), cwd=tmp_path)
    assert status.returncode == 0
    assert "warning:" in status.stdout and "pass --ckpt-dir out" in status.stdout



@pytest.mark.slow
def test_a_script_that_cannot_resume_killed_three_times_runs_on_its_budgets(tmp_path):
    """An mnist-style script (it saves only at the end) SIGKILLed from outside three times
    while it trains: no crash loop; rtrain says once, with the reason, that it cannot resume
    the script, and `rtrain status` counts the failures and the budget alike."""
    tuned.write(tmp_path, {"sample_interval_s": 0.2, "restart": {"trained_s": 1.0}})
    run_dir = tmp_path / "rtrain-run"
    proc = subprocess.Popen(
        launch_cmd(run_dir, "--no-standby", str(CHILDREN / "mnist_style.py"), "--epochs", "2",
                   "--save-model"),
        cwd=tmp_path, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        for attempt in range(3):
            started = tmp_path / f"started-{attempt}"
            deadline = time.monotonic() + 60
            while not started.exists() or not started.read_text():
                assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                time.sleep(0.05)
            time.sleep(1.5)  # it trains past `trained_s`
            os.kill(int(started.read_text()), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert (tmp_path / "mnist_cnn.pt").exists() and not (tmp_path / "started-4").exists()
    (e,) = events(run_dir, "cannot_resume")
    assert e["attempt"] == 0 and e["reason"] == "no_handoff"
    assert stderr.count("rtrain cannot resume this script") == 1
    assert ("warning: rtrain cannot resume this script: ./rtrain-run/checkpoints holds no "
            "checkpoint, and nothing hands one to the script (no --resume-arg") in stderr
    assert "crash loop" not in stderr
    status = run_rtrain("status", str(run_dir), cwd=tmp_path).stdout
    assert "attempts:      4 launched; failures: crash 3\n" in status, status
    assert "budgets:       crash 3 relaunches charged since the last progress" in status, status
