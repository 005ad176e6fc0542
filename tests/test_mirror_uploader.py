"""The uploader process (supervisor/mirror/uploader.py) on its own: its messages, one uploader
per checkpoint dir, a damaged local checkpoint never sent. A directory is the mirror here;
tests/test_mirror_launch.py runs it under rtrain launch against S3."""

from __future__ import annotations

import json
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import build_checkpoint
from harness import REPO, child_env

from rtrain.checkpoint import runid
from rtrain.supervisor.mirror.uploader import Spec

pytestmark = pytest.mark.slow


def identified(ckpt_dir: Path) -> Path:
    """A checkpoint dir with a run identity, as a launch settles it before the uploader starts:
    its checkpoints are this run's."""
    ckpt_dir.mkdir(parents=True)
    runid.write(ckpt_dir, runid.new())
    return ckpt_dir


class Uploader:
    """The uploader as a child process, its JSON lines read by a thread so that a wait for a
    message that never comes fails at its timeout instead of blocking on the pipe."""

    def __init__(self, ckpt_dir: Path, mirror: Path, **kw) -> None:
        spec = Spec(ckpt_dir=ckpt_dir, url=str(mirror), keep_remote=kw.get("keep_remote", 3),
                    milestone_every=kw.get("milestone_every", 0), parallel=2)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rtrain.supervisor.mirror.uploader", spec.dumps()], cwd=REPO,
            env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.seen: list[dict] = []
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")  # the pipe closed: the uploader exited

    def until(self, kind: str, timeout: float = 20) -> dict:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if not line:
                break
            self.seen.append(json.loads(line))
            if self.seen[-1]["kind"] == kind:
                return self.seen[-1]
        raise AssertionError(f"no {kind!r} message: {self.seen}")

    def finish(self) -> dict:
        self.proc.stdin.write("finish\n")
        self.proc.stdin.flush()
        final = self.until("final")
        assert self.proc.wait(10) == 0
        return final


def test_newest_first_the_overtaken_skipped_and_the_final_made_it(tmp_path):
    ck, mirror = identified(tmp_path / "ck"), tmp_path / "mirror"
    for step in (10, 20, 30):
        build_checkpoint(ck, step)
    up = Uploader(ck, mirror, milestone_every=10)
    try:
        up.until("started")
        sent = [up.until("uploaded")["step"] for _ in range(3)]
        assert sent == [30, 20, 10]  # newest first, then the milestones
        # Both land while the uploader is stopped, so it sees them in one look, as it would
        # two commits made during one long upload.
        up.proc.send_signal(signal.SIGSTOP)
        try:
            build_checkpoint(ck, 35)
            build_checkpoint(ck, 45)
        finally:
            up.proc.send_signal(signal.SIGCONT)
        assert up.until("uploaded")["step"] == 45
        assert up.until("superseded")["steps"] == [35]  # once the newer one is across
        assert up.finish() == {"kind": "final", "step": 45, "made_it": True,
                               "reason": "uploaded"}
    finally:
        up.proc.kill()
    assert sorted(p.name for p in mirror.iterdir()) == [
        "checkpoint-10", "checkpoint-20", "checkpoint-30", "checkpoint-45"]


def test_a_damaged_local_checkpoint_is_never_sent(tmp_path):
    ck, mirror = identified(tmp_path / "ck"), tmp_path / "mirror"
    build_checkpoint(ck, 10)
    bad = build_checkpoint(ck, 20)
    data = bytearray((bad / "state.json").read_bytes())
    data[0] ^= 1  # same size, other bytes
    (bad / "state.json").write_bytes(bytes(data))
    up = Uploader(ck, mirror)
    try:
        failed = up.until("failed")
        assert failed["step"] == 20 and failed["given_up"] is True
        assert "state.json: hash mismatch" in failed["reason"]
        assert up.until("uploaded")["step"] == 10  # the newest good one instead
        assert up.finish()["made_it"] is False  # the newest local one is not on the mirror
    finally:
        up.proc.kill()
    assert not (mirror / "checkpoint-20" / "manifest.json").exists()


def test_one_uploader_per_checkpoint_dir_the_other_stands_by(tmp_path):
    ck, mirror = identified(tmp_path / "ck"), tmp_path / "mirror"
    build_checkpoint(ck, 10)
    first = Uploader(ck, mirror)
    second = None
    try:
        first.until("uploaded")
        second = Uploader(ck, mirror)
        assert "another rtrain" in second.until("standby")["reason"]
        assert first.finish()["made_it"] is True
        # The holder is gone: the one standing by takes over within its retry interval.
        build_checkpoint(ck, 20)
        assert second.until("uploaded", timeout=15)["step"] == 20
        assert second.finish()["made_it"] is True
    finally:
        first.proc.kill()
        if second is not None:
            second.proc.kill()


def test_a_link_and_a_renamed_copy_never_go_up_and_never_supersede_the_real_ones(tmp_path):
    ck, mirror = identified(tmp_path / "ck"), tmp_path / "mirror"
    other = identified(tmp_path / "other-run")
    for step in (2, 4):
        build_checkpoint(ck, step)
    (ck / "checkpoint-999999").symlink_to(build_checkpoint(other, 5))  # another run's, private
    shutil.copytree(ck / "checkpoint-2", ck / "checkpoint-1000000", symlinks=True)  # cp -a
    up = Uploader(ck, mirror)
    try:
        assert up.until("uploaded")["step"] == 4
        build_checkpoint(ck, 6)
        assert up.until("uploaded")["step"] == 6  # later ones go too: nothing stands above
        final = up.finish()
        assert final["step"] == 6 and final["made_it"] is True, final
    finally:
        up.proc.kill()
    refused = {m["name"]: m["reason"] for m in up.seen if m["kind"] == "refused"}
    assert "symbolic link" in refused["checkpoint-999999"]
    assert "manifest says step 2" in refused["checkpoint-1000000"]
    assert sorted(p.name for p in mirror.iterdir()) == ["checkpoint-4", "checkpoint-6"]


def test_an_earlier_runs_higher_step_on_the_mirror_is_said_and_this_runs_go_up(tmp_path):
    from rtrain.supervisor.mirror.store import open_mirror

    mirror = tmp_path / "mirror"
    open_mirror(str(mirror)).upload(build_checkpoint(identified(tmp_path / "earlier"), 1000))
    ck = identified(tmp_path / "ck")
    build_checkpoint(ck, 2)
    up = Uploader(ck, mirror)
    try:
        said = up.until("other_run")
        assert said["newest"] == 1000 and "another run (step 1000" in said["reason"]
        assert up.until("uploaded")["step"] == 2
        assert up.finish()["made_it"] is True
    finally:
        up.proc.kill()
    assert sorted(p.name for p in mirror.iterdir()) == ["checkpoint-1000", "checkpoint-2"]
