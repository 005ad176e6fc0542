"""Checkpoints written where rtrain does not look: the rule (elsewhere/decide.py) by table, the
bounded scan on real files, the launch's watch with a scripted clock, `rtrain status`, and one
real run whose script writes out/ckpt.pt while rtrain watches an empty dir."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import tuned
from harness import events, launch, run_rtrain, write_events
from scripted_loop import Script, crash, success

from rtrain.supervisor.commands.status import render_text, summarize
from rtrain.supervisor.config import load_config
from rtrain.supervisor.elsewhere.decide import Seen, Written, judge
from rtrain.supervisor.elsewhere.scan import ElsewhereWatch, scan, shown_path
from rtrain.supervisor.launch.loop import LaunchSpec
from rtrain.supervisor.launch.loop import launch as launch_loop
from rtrain.supervisor.records.events import EventLog

CHILDREN = Path(__file__).resolve().parent / "children"
CKPT = Written(path="out/ckpt.pt", mtime=100.0)


def seen(**kw) -> Seen:
    base = {"expects": True, "watched": "./checkpoints", "watched_empty": True,
            "trained_s": 700.0, "written": (CKPT,)}
    return Seen(**{**base, **kw})


@pytest.mark.parametrize("kw, after_s, warns", [
    ({}, 600.0, True),
    ({"trained_s": 599.0}, 600.0, False),           # not yet
    ({"trained_s": 600.0}, 600.0, True),            # the threshold itself counts
    ({"expects": False}, 600.0, False),             # no --resume-arg: the script resumes itself
    ({"watched_empty": False}, 600.0, False),       # resume works
    ({"written": ()}, 600.0, False),                # nothing written: nothing to point at
    ({}, 0.0, False),                               # off
])
def test_the_rule(kw, after_s, warns):
    assert (judge(seen(**kw), after_s) is not None) is warns


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
def test_the_warning_names_the_files_and_the_dir(written, suggest, named):
    w = judge(seen(written=written), 600.0)
    assert w is not None and w.ckpt_dir == suggest
    assert w.message == (f"rtrain watches ./checkpoints, which is still empty after 12 min of "
                         f"training, while the script wrote {named}: pass --ckpt-dir {suggest} "
                         "(until then each relaunch starts fresh)")


def test_many_files_are_counted_not_listed():
    written = tuple(Written(path=f"out/s{i}.pt", mtime=float(i)) for i in range(5))
    w = judge(seen(written=written, trained_s=30.0), 10.0)
    assert w is not None and len(w.files) == 5
    assert "out/s4.pt, out/s3.pt, out/s2.pt and 2 more: pass --ckpt-dir out" in w.message
    assert "after 30 s of training" in w.message


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


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _watch(tmp_path: Path, clock: Clock, said: list[str], **kw) -> ElsewhereWatch:
    run_dir = tmp_path / "rtrain-run"
    run_dir.mkdir(exist_ok=True)
    args = {"after_s": 10.0, "expects": True, "cwd": tmp_path,
            "ckpt_dir": run_dir / "checkpoints", "run_dir": run_dir,
            "events": EventLog(run_dir / "events.jsonl"), "say": said.append,
            "monotonic": clock, **kw}
    return ElsewhereWatch(**args)


def test_the_watch_warns_once_after_the_training_time(tmp_path):
    clock, said = Clock(), []
    w = _watch(tmp_path, clock, said)
    w.attempt_started(0)
    _touch(tmp_path / "out" / "ckpt.pt")
    clock.t = 6.0
    w.poll()
    w.attempt_ended()                       # 6 s of training so far: not yet
    assert said == [] and w.launch_note() is None
    w.attempt_started(1)
    clock.t = 11.0                          # 6 + 5 s: the attempts add up
    w.poll()
    assert len(said) == 1 and said[0].startswith("warning: rtrain watches "
                                                 "./rtrain-run/checkpoints")
    assert "after 11 s of training, while the script wrote out/ckpt.pt: pass --ckpt-dir out" \
        in said[0]
    clock.t = 100.0
    w.poll()
    w.attempt_ended()
    assert len(said) == 1                   # once
    assert w.launch_note() == ("nothing to resume from: the script writes out/ckpt.pt; "
                               "pass --ckpt-dir out")
    w.events.close()
    (e,) = events(tmp_path / "rtrain-run", "checkpoints_elsewhere")
    assert e["attempt"] == 1 and e["files"] == ["out/ckpt.pt"] and e["suggest"] == "out"
    assert e["ckpt_dir"] == str(tmp_path / "rtrain-run" / "checkpoints")


@pytest.mark.parametrize("kw", [{"expects": False}, {"after_s": 0.0}])
def test_the_watch_stays_quiet_when_off(tmp_path, kw):
    clock, said = Clock(), []
    w = _watch(tmp_path, clock, said, **kw)
    w.attempt_started(0)
    _touch(tmp_path / "out" / "ckpt.pt")
    clock.t = 1000.0
    w.poll()
    w.attempt_ended()
    assert said == []


def test_the_watch_stops_once_the_dir_has_a_checkpoint(tmp_path):
    clock, said = Clock(), []
    w = _watch(tmp_path, clock, said)
    w.attempt_started(0)
    _touch(tmp_path / "out" / "ckpt.pt")
    _touch(tmp_path / "rtrain-run" / "checkpoints" / "ckpt.pt")
    clock.t = 50.0
    w.poll()
    w.attempt_ended()
    assert said == []


def test_status_shows_the_warning_while_the_dir_is_empty(tmp_path, make_ckpt):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    message = "rtrain watches ./run/checkpoints, which is still empty ... pass --ckpt-dir out"
    write_events(run_dir, [
        ("launch", {"attempt": 0, "argv": ["python", "t.py"], "settings": {}, "level": 0,
                    "resume_from": None, "pid": 1, "ckpt_dir": str(ckpts), "standby": False,
                    "start_s": 0.1}),
        ("checkpoints_elsewhere", {"attempt": 0, "ckpt_dir": str(ckpts),
                                   "files": ["out/ckpt.pt"], "suggest": "out",
                                   "trained_s": 600.0, "message": message}),
    ])
    s = summarize(run_dir)
    assert s.checkpoints_elsewhere == {"files": ["out/ckpt.pt"], "suggest": "out",
                                       "message": message}
    rows = [r.split() for r in render_text(s).splitlines()]
    assert ["warning:", *message.split()] in rows
    make_ckpt(ckpts, 100)                    # now there is something to resume from
    s = summarize(run_dir)
    assert s.checkpoint is not None and s.checkpoints_elsewhere is None
    assert "still empty" not in render_text(s)


class WritesElsewhere(Script):
    """Each scripted attempt writes out/ckpt.pt, as the script would, and runs 30 s."""

    def watch(self, child, config, **kw):
        _touch(Path(child.spec.cwd) / "out" / "ckpt.pt")
        return super().watch(child, config, **kw)


@pytest.mark.parametrize("resume_args, warned", [(("--resume", "{checkpoint}"), True),
                                                 ((), False)])
def test_the_loop_warns_and_says_it_again_at_the_next_launch(tmp_path, resume_args, warned):
    script = WritesElsewhere([crash(), success()])
    config = load_config({"run_dir": tmp_path / "run", "checkpoints_elsewhere_after_s": 20.0,
                          "backoff.enabled": False}, None, tmp_path)
    spec = LaunchSpec(command=["train.py"], config=config, echo=False, cwd=tmp_path,
                      resume_args=resume_args)
    assert launch_loop(spec, script.seams()) == 0
    found = events(tmp_path / "run", "checkpoints_elsewhere")
    launches = [line for line in script.said if "launched pid" in line]
    if not warned:
        assert found == [] and not any("warning: rtrain watches" in x for x in script.said)
        return
    (e,) = found
    assert e["attempt"] == 0 and e["files"] == ["out/ckpt.pt"] and e["suggest"] == "out"
    assert [x for x in script.said if x.startswith("warning: rtrain watches ./run/checkpoints, "
                                                   "which is still empty after 30 s")]
    assert "(fresh)" in launches[0]
    assert ("(fresh: nothing to resume from: the script writes out/ckpt.pt; pass --ckpt-dir "
            "out)") in launches[1]


@pytest.mark.slow
def test_a_script_saving_elsewhere_is_named_with_the_dir_to_pass(tmp_path):
    """A script writes out/ckpt.pt every few steps and crashes once; rtrain watches the default
    (empty) dir with `--resume-arg`: the warning comes once, names out/, and the status and the
    next launch line say it."""
    tuned.write(tmp_path, {"checkpoints_elsewhere_after_s": 2.0, "sample_interval_s": 0.2})
    run_dir = tmp_path / "rtrain-run"
    r = launch(run_dir, "--resume-arg=--resume {checkpoint}", "--",
               str(CHILDREN / "save_elsewhere.py"), "--out", "out", "--steps", "60",
               "--crash-at", "40", cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    (e,) = events(run_dir, "checkpoints_elsewhere")
    assert e["files"] == ["out/ckpt.pt"] and e["suggest"] == "out"
    assert "while the script wrote out/ckpt.pt: pass --ckpt-dir out" in e["message"]
    assert r.stderr.count("warning: rtrain watches ./rtrain-run/checkpoints, which is still "
                          "empty after") == 1
    launches = [line for line in r.stderr.splitlines() if "launched pid" in line]
    assert len(launches) == 2 and "(fresh)" in launches[0]
    assert "(fresh: nothing to resume from: the script writes out/ckpt.pt; pass --ckpt-dir " \
           "out)" in launches[1]
    status = run_rtrain("status", str(run_dir), cwd=tmp_path)
    assert status.returncode == 0
    assert "warning:" in status.stdout and "pass --ckpt-dir out" in status.stdout

