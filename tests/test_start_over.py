"""A run started over (`--resume never`) in a checkpoint dir that still holds an earlier run's
checkpoints owns only its own from then on: the earlier run's are set aside
(`ckpt/setaside.py`) before its first attempt, so its first relaunch resumes from its own newest
(never the earlier run's higher step), and a mirror's checkpoints made before the start-over
are never fetched for it."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import build_checkpoint
from scripted_loop import Script, crash, run, success

from rtrain.checkpoint.layout import EARLIER_PREFIX, list_checkpoints
from rtrain.supervisor.ckpt import keepcopy, setaside
from rtrain.supervisor.config import load_config
from rtrain.supervisor.decide.policy import History, ResumeMode
from rtrain.supervisor.launch.resume import Checkpoints
from rtrain.supervisor.proc.torchrun import several_nodes
from rtrain.supervisor.records.events import EventLog, read_events

pytestmark = pytest.mark.usefixtures("unsupervised")


@dataclass
class SavingScript(Script):
    """Each attempt commits the steps given for it into the checkpoint dir before its
    outcome, as the training script's own saves would."""

    ckpt_dir: Path | None = None
    saves: tuple[tuple[int, ...], ...] = ()

    def watch(self, child, config, **kw):
        n = len(self.spawned) - 1
        for step in self.saves[n] if n < len(self.saves) else ():
            build_checkpoint(self.ckpt_dir, step)
        return super().watch(child, config, **kw)


def _steps(ckpts: Path) -> list[int]:
    return [s for s, _ in list_checkpoints(ckpts)]


def test_a_crash_after_starting_over_resumes_from_the_new_run_s_own_checkpoint(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    for step in (8, 10):  # the earlier run's
        build_checkpoint(ckpts, step)
    (ckpts / "notes.txt").write_text("not a checkpoint")
    script = SavingScript([crash(), success()], ckpt_dir=ckpts, saves=((2, 3),))
    code, evs = run(tmp_path, script, resume="never")
    assert code == 0
    launches = [e for e in evs if e["kind"] == "launch"]
    assert launches[0]["resume_from"] is None
    assert launches[1]["resume_from"].endswith("/checkpoint-3")  # not the earlier run's 10
    aside = [e for e in evs if e["kind"] == "checkpoints_set_aside"]
    assert len(aside) == 1 and aside[0]["names"] == ["checkpoint-10", "checkpoint-8"]
    kinds = [e["kind"] for e in evs]
    assert kinds.index("checkpoints_set_aside") < kinds.index("launch")
    moved = Path(aside[0]["path"])
    assert moved.parent == ckpts and moved.name.startswith(EARLIER_PREFIX)
    assert _steps(moved) == [10, 8] and _steps(ckpts) == [3, 2]
    note = (moved / setaside.NOTE).read_text()
    assert "--resume never" in note and "checkpoint-10\n" in note
    assert (ckpts / "notes.txt").exists()  # not a checkpoint: left where it was
    assert any(s.startswith("starting over: 2 checkpoint(s) of an earlier run") for s in
               script.said)
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["history"]["started_over"] == pytest.approx(1_000.0)


def test_a_continued_run_sets_nothing_aside(tmp_path):
    """--resume never applies to a run's first launch only: a relaunch of the run (after a
    stop, a requeue) resumes from its newest as always: what is in the dir is the run's own."""
    import signal

    ckpts = tmp_path / "run" / "checkpoints"
    build_checkpoint(ckpts, 10)
    # The second crash, without progress, is the one that backs off (and is stopped there).
    stopped = SavingScript([crash(), crash(), success()], ckpt_dir=ckpts, saves=((2,), ()),
                           stop_during_backoff=signal.SIGTERM)
    code, _ = run(tmp_path, stopped, resume="never")
    assert code == 75 and _steps(ckpts) == [2]
    code, evs = run(tmp_path, Script([success()]), resume="never")
    assert code == 0
    assert len([e for e in evs if e["kind"] == "checkpoints_set_aside"]) == 1  # the first's
    assert [e for e in evs if e["kind"] == "launch"][-1]["resume_from"].endswith(
        "/checkpoint-2")
    assert _steps(ckpts) == [2]


def test_a_fresh_dir_starts_over_without_a_word(tmp_path):
    code, evs = run(tmp_path, Script([success()]), resume="never")
    assert code == 0 and not [e for e in evs if e["kind"] == "checkpoints_set_aside"]
    assert not list((tmp_path / "run" / "checkpoints").glob(f"{EARLIER_PREFIX}*"))


def test_every_checkpoint_a_pick_could_consider_is_set_aside_and_nothing_else(tmp_path):
    ckpts = tmp_path / "ckpt"
    build_checkpoint(ckpts, 5)
    for name in ("last.ckpt", "model.pt", "training_args.bin", "notes.txt", ".hidden.pt"):
        (ckpts / name).write_bytes(b"x")
    (ckpts / ".rtrain-generation").write_text("0" * 32)
    done = setaside.set_aside(ckpts, time.time())
    assert done is not None and done.names == ("checkpoint-5", "last.ckpt", "model.pt")
    left = sorted(os.listdir(ckpts))
    assert left == sorted([".hidden.pt", ".rtrain-generation", "notes.txt",
                           "training_args.bin", done.path.name])
    assert setaside.set_aside(ckpts, time.time()) is None  # nothing left to set aside
    assert len(list(ckpts.glob(f"{EARLIER_PREFIX}*"))) == 1


def test_several_nodes_are_told_and_the_dir_left_as_it_is():
    assert several_nodes(["python", "-m", "torch.distributed.run", "--nnodes=2", "t.py"])
    assert several_nodes(["torchrun", "--nnodes", "1:4", "t.py"])
    assert not several_nodes(["torchrun", "--nnodes=1", "--nproc-per-node=2", "t.py"])
    assert not several_nodes(["python", "train.py", "--nnodes"])


def test_rtrain_s_copy_of_an_earlier_run_s_file_is_forgotten(tmp_path):
    run_dir = tmp_path / "run"
    record = run_dir / keepcopy.KEPT_DIR / keepcopy.RECORD
    record.parent.mkdir(parents=True)
    record.write_text("{}")
    ckpts = run_dir / "checkpoints"
    build_checkpoint(ckpts, 4)
    cfg = load_config({"run_dir": run_dir}, None, tmp_path)
    said: list[str] = []
    c = Checkpoints(ckpts, cfg, None, EventLog(run_dir / "events.jsonl"), said.append,
                    run_dir=run_dir)
    h = c.start_over(History(), 123.0, ["train.py"])
    assert h.started_over == 123.0 and not record.exists()


# ---------------------------------------------------------------- the mirror


def _with_mirror(tmp_path):
    from rtrain.supervisor.mirror.fetch_newer import NewerOnMirror
    from rtrain.supervisor.mirror.store import open_mirror

    remote = tmp_path / "mirror"
    remote.mkdir()
    build_checkpoint(remote, 10)  # the earlier run's, uploaded before the start-over
    since = time.time()
    ckpts = tmp_path / "run" / "checkpoints"
    build_checkpoint(ckpts, 3)  # the new run's
    cfg = load_config({"run_dir": tmp_path / "run", "verify": "quick"}, None, tmp_path)
    said: list[str] = []
    events = EventLog(tmp_path / "run" / "events.jsonl")
    c = Checkpoints(ckpts, cfg, None, events, said.append)
    mirror = open_mirror(str(remote))
    mirroring = SimpleNamespace(mirror=mirror, display=mirror.display, answered=True)
    c.fetch_newer = NewerOnMirror(mirroring, ckpts, None, file_mode=cfg.file_mode,
                                  events=events, say=said.append)
    return c, since, said


def test_a_mirror_s_checkpoint_made_before_the_start_over_is_never_fetched(tmp_path):
    c, since, said = _with_mirror(tmp_path)
    sel = c.pick(History(started_over=since), ResumeMode.LATEST, first=False)
    assert sel.chosen.path.name == "checkpoint-3"
    assert any("skipping checkpoint-10 on the mirror: made before this run started over" in s
               for s in said)
    evs = read_events(tmp_path / "run" / "events.jsonl")
    assert not [e for e in evs if e["kind"] == "mirror_downloaded"]


def test_without_a_start_over_the_mirror_s_newer_checkpoint_is_fetched(tmp_path):
    c, _, _ = _with_mirror(tmp_path)
    sel = c.pick(History(), ResumeMode.LATEST, first=False)
    assert sel.chosen.path.name == "checkpoint-10"
