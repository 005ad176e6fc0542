"""The mirror sends and counts only this run's checkpoints (checkpoint/runid.py,
supervisor/mirror/outgoing.py, the uploader's loop in-process, the resume's look at the
mirror): a link, a copy under another step's name or another run's checkpoint never goes up
or supersedes the real ones, another run's checkpoints under the same URL never stop this
run's uploads, and a fresh machine resumes from this run's newest. A directory is the mirror;
nothing here starts a process."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import build_checkpoint

from rtrain.checkpoint import manifest as mf
from rtrain.checkpoint import runid
from rtrain.checkpoint.hashing import derive_key
from rtrain.supervisor.config import Config
from rtrain.supervisor.decide.history import History
from rtrain.supervisor.decide.policy import ResumeMode
from rtrain.supervisor.launch.resume import Checkpoints
from rtrain.supervisor.mirror import outgoing
from rtrain.supervisor.mirror.fetch_newer import NewerOnMirror
from rtrain.supervisor.mirror.store import CorruptLocal, OtherRun, open_mirror
from rtrain.supervisor.mirror.uploader import Spec, Uploader
from rtrain.supervisor.records.events import EventLog, read_events

KEY = derive_key(b"a signing key for the tests")


def run_dir(path: Path, run: str | None = None) -> Path:
    """A checkpoint dir of run `run` (a new one by default)."""
    path.mkdir(parents=True, exist_ok=True)
    runid.write(path, run or runid.new())
    return path


class Finishing:
    """The uploader's commands when the supervisor already said "finish": send what waits,
    then the final message."""

    finishing = True

    def wait(self, timeout: float) -> None:
        pass


def upload_all(ck: Path, mirror_dir: Path, capsys, *, keep_remote: int = 3,
               key: bytes | None = None) -> list[dict]:
    """Run the uploader's loop over `ck` to its final message; its messages, in order."""
    spec = Spec(ckpt_dir=ck, url=str(mirror_dir), keep_remote=keep_remote, milestone_every=0,
                parallel=2)
    capsys.readouterr()
    code = Uploader(spec, open_mirror(str(mirror_dir)), Finishing(), run=runid.read(ck),
                    key=key).run()
    assert code == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def of_kind(messages: list[dict], kind: str) -> list[dict]:
    return [m for m in messages if m["kind"] == kind]


def committed(mirror_dir: Path) -> list[str]:
    return sorted(p.name for p in mirror_dir.iterdir() if (p / "manifest.json").exists()) \
        if mirror_dir.exists() else []


# -- the run identity ------------------------------------------------------------------------


def test_a_commit_names_the_run_of_its_directory(tmp_path):
    ck = run_dir(tmp_path / "ck")
    m = mf.load(build_checkpoint(ck, 3))
    assert m["run"] == runid.read(ck) and runid.valid(m["run"])
    assert "run" not in mf.load(build_checkpoint(tmp_path / "plain", 3))  # no identity: none


def test_a_manifest_whose_run_is_no_identity_is_refused():
    raw = json.loads(mf.dumps({"format": mf.FORMAT, "version": 1, "step": 1, "epoch": 0,
                               "samples_seen": 0, "created": 1.0, "files": {}}))
    mf.parse(json.dumps({**raw, "run": "0" * 32}).encode())
    for bad in ("../x", 7, "A" * 32, "0" * 31):
        with pytest.raises(mf.ManifestError, match="'run' is not a run identity"):
            mf.parse(json.dumps({**raw, "run": bad}).encode())


def test_settle_keeps_adopts_or_starts_over():
    a, b = runid.new(), runid.new()
    assert runid.settle(a, b, start_over=False) == a  # the dir's identity stays
    assert runid.settle(None, b, start_over=False) == b  # a fresh machine continues b
    assert runid.settle(None, None, start_over=False) is None  # a new one
    assert runid.settle(a, b, start_over=True) is None  # --resume never: a run of its own


def test_the_run_a_fresh_machine_continues_is_the_last_to_commit():
    a, b = runid.new(), runid.new()
    assert runid.continued_run([(a, 100.0), (b, 300.0), (a, 200.0)]) == b
    assert runid.continued_run([(None, 500.0), (b, 300.0)]) is None
    assert runid.continued_run([]) is None


def test_the_identity_file_is_replaced_whole_and_a_link_is_not_read(tmp_path):
    ck = run_dir(tmp_path / "ck")
    first = runid.read(ck)
    runid.write(ck, second := runid.new())
    assert runid.read(ck) == second != first
    assert [p.name for p in ck.iterdir()] == [runid.RUN_FILE]  # no temp file left
    (ck / runid.RUN_FILE).unlink()
    (tmp_path / "theirs").write_text(first)
    (ck / runid.RUN_FILE).symlink_to(tmp_path / "theirs")
    assert runid.read(ck) is None


def test_nodes_settling_at_once_agree_and_the_uploader_follows_the_dir(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    first, second = runid.new(), runid.new()
    assert runid.write(ck, first, replace=False) == first
    assert runid.write(ck, second, replace=False) == first  # the other node's claim
    assert runid.read(ck) == first and sorted(os.listdir(ck)) == [runid.RUN_FILE]
    build_checkpoint(ck, 2)
    spec = Spec(ckpt_dir=ck, url=str(tmp_path / "mirror"), keep_remote=3, milestone_every=0,
                parallel=2)
    up = Uploader(spec, open_mirror(str(tmp_path / "mirror")), Finishing(), run=second)
    capsys.readouterr()
    assert up.run() == 0  # started with the identity its node settled, then followed the file
    final = [json.loads(x) for x in capsys.readouterr().out.splitlines()][-1]
    assert final == {"kind": "final", "step": 2, "made_it": True, "reason": "uploaded"}


# -- item 3: what the uploader refuses locally -----------------------------------------------


def test_a_link_a_renamed_copy_and_another_runs_checkpoint_are_refused(tmp_path):
    ck = run_dir(tmp_path / "ck")
    other = run_dir(tmp_path / "other")
    real = build_checkpoint(ck, 2)
    private = build_checkpoint(other, 5)
    (ck / "checkpoint-999999").symlink_to(private)
    shutil.copytree(real, ck / "checkpoint-1000000", symlinks=True)
    shutil.copytree(private, ck / "checkpoint-5", symlinks=True)
    run = runid.read(ck)
    assert outgoing.check(real, run, None) is None
    assert "symbolic link" in outgoing.check(ck / "checkpoint-999999", run, None)
    assert "manifest says step 2" in outgoing.check(ck / "checkpoint-1000000", run, None)
    assert "belongs to another run" in outgoing.check(ck / "checkpoint-5", run, None)
    assert "no run identity" in outgoing.check(build_checkpoint(tmp_path / "plain", 4), run,
                                               None)
    assert "unsigned" in outgoing.check(real, run, KEY)
    assert outgoing.check(build_checkpoint(ck, 3, key=KEY), run, KEY) is None


def test_a_linked_or_special_file_inside_a_checkpoint_is_refused(tmp_path):
    ck = run_dir(tmp_path / "ck")
    elsewhere = tmp_path / "secret.bin"
    a = build_checkpoint(ck, 2, files={"extra.bin": b"x" * 10})
    elsewhere.write_bytes(b"y" * 10)
    (a / "extra.bin").unlink()
    (a / "extra.bin").symlink_to(elsewhere)
    assert "'extra.bin' is a symbolic link" in outgoing.check(a, runid.read(ck), None)
    b = build_checkpoint(ck, 4, files={"extra.bin": b"x" * 10})
    (b / "extra.bin").unlink()
    os.mkfifo(b / "extra.bin")
    assert "FIFO" in outgoing.check(b, runid.read(ck), None)


def test_the_transfer_itself_follows_no_link_and_refuses_a_renamed_copy(tmp_path):
    ck = run_dir(tmp_path / "ck")
    mirror = open_mirror(str(tmp_path / "mirror"))
    real = build_checkpoint(ck, 2, files={"extra.bin": b"x" * 10})
    (ck / "checkpoint-9").symlink_to(real)
    with pytest.raises(CorruptLocal, match="symbolic link"):
        mirror.upload(ck / "checkpoint-9")
    shutil.copytree(real, ck / "checkpoint-8")
    with pytest.raises(CorruptLocal, match="manifest says step 2"):
        mirror.upload(ck / "checkpoint-8")
    (tmp_path / "outside.bin").write_bytes(b"x" * 10)  # same bytes, same hash: only the link
    (real / "extra.bin").unlink()
    (real / "extra.bin").symlink_to(tmp_path / "outside.bin")
    with pytest.raises(CorruptLocal, match=r"extra\.bin is a symbolic link"):
        mirror.upload(real)
    assert committed(tmp_path / "mirror") == []


def test_the_put_sends_the_bytes_that_were_hashed_not_what_the_name_points_at_then(
        tmp_path, monkeypatch):
    ck = run_dir(tmp_path / "ck")
    real = build_checkpoint(ck, 2, files={"extra.bin": b"a" * 10})
    (tmp_path / "private.bin").write_bytes(b"b" * 10)
    mirror = open_mirror(str(tmp_path / "mirror"))
    put = mirror.fs.put_file

    def swapped_then_put(src, dest, **kw):
        if dest.endswith("extra.bin"):  # hashed already: the name now leads elsewhere
            (real / "extra.bin").unlink()
            (real / "extra.bin").symlink_to(tmp_path / "private.bin")
        return put(src, dest, **kw)

    monkeypatch.setattr(mirror.fs, "put_file", swapped_then_put)
    mirror.upload(real)
    assert (tmp_path / "mirror" / "checkpoint-2" / "extra.bin").read_bytes() == b"a" * 10


def test_the_uploader_sends_the_real_checkpoints_and_says_why_not_the_link(tmp_path, capsys):
    ck = run_dir(tmp_path / "ck")
    other = run_dir(tmp_path / "other-run")
    for step in (2, 4):
        build_checkpoint(ck, step)
    (ck / "checkpoint-999999").symlink_to(build_checkpoint(other, 5))
    shutil.copytree(ck / "checkpoint-2", ck / "checkpoint-1000000", symlinks=True)
    got = upload_all(ck, tmp_path / "mirror", capsys)
    refused = {m["name"]: m["reason"] for m in of_kind(got, "refused")}
    assert set(refused) == {"checkpoint-999999", "checkpoint-1000000"}
    assert "symbolic link" in refused["checkpoint-999999"]
    assert "manifest says step 2" in refused["checkpoint-1000000"]
    assert [m["step"] for m in of_kind(got, "uploaded")] == [4]
    assert of_kind(got, "superseded") == [{"kind": "superseded", "steps": [2]}]
    assert got[-1] == {"kind": "final", "step": 4, "made_it": True, "reason": "uploaded"}
    assert committed(tmp_path / "mirror") == ["checkpoint-4"]


def test_a_newest_that_fails_its_hashes_supersedes_nothing(tmp_path, capsys):
    ck = run_dir(tmp_path / "ck")
    build_checkpoint(ck, 2)
    bad = build_checkpoint(ck, 4)
    data = bytearray((bad / "state.json").read_bytes())
    data[0] ^= 1  # same size, other bytes: only the hash tells
    (bad / "state.json").write_bytes(bytes(data))
    got = upload_all(ck, tmp_path / "mirror", capsys)
    [failed] = of_kind(got, "failed")
    assert failed["step"] == 4 and failed["given_up"] and "hash mismatch" in failed["reason"]
    assert [m["step"] for m in of_kind(got, "uploaded")] == [2]
    assert of_kind(got, "superseded") == []  # step 2 was never passed over
    assert got[-1]["made_it"] is False and "hash mismatch" in got[-1]["reason"]
    assert committed(tmp_path / "mirror") == ["checkpoint-2"]


# -- item 4: another run's checkpoints on the mirror -----------------------------------------


def test_a_higher_step_of_another_run_on_the_mirror_does_not_stop_this_runs_uploads(
        tmp_path, capsys):
    mirror_dir = tmp_path / "mirror"
    earlier = run_dir(tmp_path / "earlier")
    for step in (1000, 2000):
        open_mirror(str(mirror_dir)).upload(build_checkpoint(earlier, step))
    ck = run_dir(tmp_path / "ck")
    for step in (2, 4):
        build_checkpoint(ck, step)
    got = upload_all(ck, mirror_dir, capsys, keep_remote=1)
    [said] = of_kind(got, "other_run")
    assert said["steps"] == [1000, 2000] and said["newest"] == 2000
    assert "the mirror prefix holds checkpoints of another run (step 2000" in said["reason"]
    assert [m["step"] for m in of_kind(got, "uploaded")] == [4]
    assert got[-1]["made_it"] is True and got[-1]["step"] == 4
    # This run's retention (keep 1) counts only its own: the earlier run's stay.
    assert committed(mirror_dir) == ["checkpoint-1000", "checkpoint-2000", "checkpoint-4"]
    build_checkpoint(ck, 6)
    got = upload_all(ck, mirror_dir, capsys, keep_remote=1)
    assert of_kind(got, "started")[0]["remote_steps"] == [4]
    assert of_kind(got, "pruned") == [{"kind": "pruned", "steps": [4]}]
    assert committed(mirror_dir) == ["checkpoint-1000", "checkpoint-2000", "checkpoint-6"]


def test_a_step_the_mirror_holds_for_another_run_is_never_replaced(tmp_path, capsys):
    mirror_dir = tmp_path / "mirror"
    theirs = build_checkpoint(run_dir(tmp_path / "earlier"), 4)
    open_mirror(str(mirror_dir)).upload(theirs)
    ck = run_dir(tmp_path / "ck")
    build_checkpoint(ck, 2)
    build_checkpoint(ck, 4)
    got = upload_all(ck, mirror_dir, capsys)
    [refused] = of_kind(got, "refused")
    assert refused["step"] == 4 and "belongs to another run" in refused["reason"]
    assert [m["step"] for m in of_kind(got, "uploaded")] == [2]  # the newest it may send
    assert got[-1]["made_it"] is False and "belongs to another run" in got[-1]["reason"]
    assert (mirror_dir / "checkpoint-4" / "manifest.json").read_bytes() == \
        (theirs / "manifest.json").read_bytes()
    with pytest.raises(OtherRun):  # the transfer's own guard, whoever calls it
        open_mirror(str(mirror_dir)).upload(ck / "checkpoint-4")


def test_under_a_signing_key_a_renamed_copy_is_refused_and_the_real_ones_go(tmp_path, capsys):
    ck = run_dir(tmp_path / "ck")
    for step in (2, 4):
        build_checkpoint(ck, step, key=KEY)
    shutil.copytree(ck / "checkpoint-2", ck / "checkpoint-1000000")  # its signature is valid
    got = upload_all(ck, tmp_path / "mirror", capsys, key=KEY)
    assert [m["name"] for m in of_kind(got, "refused")] == ["checkpoint-1000000"]
    assert got[-1] == {"kind": "final", "step": 4, "made_it": True, "reason": "uploaded"}


# -- item 4: a resume on a fresh machine -----------------------------------------------------


class Remote:
    """What `NewerOnMirror` uses of the launch's `Mirroring`."""

    def __init__(self, mirror_dir: Path) -> None:
        self.mirror = open_mirror(str(mirror_dir))
        self.display = self.mirror.display
        self.answered = True


def first_pick(ck: Path, mirror_dir: Path, tmp_path: Path, **cfg) -> tuple[Checkpoints, list]:
    said: list[str] = []
    events = EventLog(tmp_path / "events.jsonl")
    cps = Checkpoints(ck, Config(mirror=str(mirror_dir), **cfg), None, events, said.append)
    cps.fetch_newer = NewerOnMirror(Remote(mirror_dir), ck, cps.key, file_mode=cps.cfg.file_mode,
                                    events=events, say=said.append)
    sel = cps.pick(History(), ResumeMode.LATEST, first=True)
    events.close()
    return cps, [sel, said]


def test_a_fresh_machine_resumes_from_this_runs_newest_not_an_earlier_runs_higher_step(
        tmp_path, monkeypatch):
    monkeypatch.setenv("RTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    mirror_dir = tmp_path / "mirror"
    earlier = run_dir(tmp_path / "earlier")
    ours = run_dir(tmp_path / "ours")
    m = open_mirror(str(mirror_dir))
    m.upload(build_checkpoint(earlier, 1000))  # committed first: the earlier run
    for step in (2, 4):
        m.upload(build_checkpoint(ours, step))
    fresh = tmp_path / "fresh" / "checkpoints"
    cps, (sel, said) = first_pick(fresh, mirror_dir, tmp_path)
    assert sel.chosen is not None and sel.chosen.path.name == "checkpoint-4"
    assert runid.read(fresh) == runid.read(ours) == cps.run  # it continues that run
    assert any("holds checkpoints of another run (step 1000, run " in line for line in said), said
    kinds = [e["kind"] for e in read_events(tmp_path / "events.jsonl")]
    assert kinds == ["mirror_other_run", "mirror_downloaded"]
    assert not (fresh / "checkpoint-1000").exists()


def test_a_run_with_its_identity_never_resumes_from_another_runs_checkpoint(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("RTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    mirror_dir = tmp_path / "mirror"
    ours = run_dir(tmp_path / "ours")
    m = open_mirror(str(mirror_dir))
    m.upload(build_checkpoint(ours, 2))
    m.upload(build_checkpoint(run_dir(tmp_path / "later"), 1000))  # even one committed later
    ck = run_dir(tmp_path / "machine" / "checkpoints", runid.read(ours))  # its local dir lost
    cps, (sel, _) = first_pick(ck, mirror_dir, tmp_path)
    assert sel.chosen.path.name == "checkpoint-2" and cps.run == runid.read(ours)


def test_a_new_run_that_starts_over_gets_an_identity_of_its_own(tmp_path):
    ck = run_dir(tmp_path / "ck")
    before = runid.read(ck)
    build_checkpoint(ck, 2)
    cps, (sel, _) = first_pick(ck, tmp_path / "mirror", tmp_path, resume="never")
    assert sel.chosen is None and cps.run == runid.read(ck) != before
    cps, (sel, _) = first_pick(ck, tmp_path / "mirror", tmp_path)  # a relaunch keeps it
    assert sel.chosen.path.name == "checkpoint-2" and cps.run == runid.read(ck)
