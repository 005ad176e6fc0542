"""`rtrain launch --mirror`: checkpoints copied to a real S3 endpoint (moto's server on
127.0.0.1) or a second directory (a shared filesystem), and a run resumed from there on a
machine whose local run dir is gone."""

from __future__ import annotations

import itertools
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bitwise import assert_bitwise_equal
from tests.harness import CHILDREN, child_env, events, launch, launch_cmd, run_rtrain
from tests.references import cached
from tests.s3server import BUCKET, S3Server

pytestmark = pytest.mark.slow
TRAIN = str(CHILDREN / "train_bitwise.py")
BIG = str(CHILDREN / "commit_big.py")


@pytest.fixture
def s3(s3_server):
    """The module's S3 server (conftest.py), running: a test that restarted it leaves a process
    of its own, which ends with that test (tests/hangs.py)."""
    if s3_server.proc is None or s3_server.proc.poll() is not None:
        s3_server.start()
    return s3_server


class Mirror:
    """A mirror URL with the environment that reaches it, and a reader for assertions."""

    def __init__(self, url: str, env: dict[str, str]) -> None:
        self.url, self.env = url, env

    def open(self):
        from rtrain.supervisor.mirror.store import open_mirror

        return open_mirror(self.url)

    def committed(self) -> list[int]:
        return sorted(c.step for c in self.open().list() if c.committed)


@pytest.fixture(params=["s3", pytest.param("dir", marks=pytest.mark.soak)])
def mirror(request, tmp_path, monkeypatch):
    # Each test its own content cache: a blob another test downloaded would stand in for a
    # file this one corrupts on the mirror (the same training writes the same bytes).
    cache = {"RTRAIN_CACHE_DIR": str(tmp_path / "cache")}
    if request.param == "dir":
        return Mirror(str(tmp_path / "shared-fs" / "ckpts"), cache)
    server = request.getfixturevalue("s3")
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)  # the in-process reader too
    return Mirror(f"s3://{BUCKET}/{request.node.name.replace('[', '-').strip(']')}",
                  {**server.env, **cache})


def reference(tmp_path: Path, steps: int) -> dict:
    """The final state of an uninterrupted run of TRAIN (made once: references.cached)."""
    import torch

    def make(out: Path) -> None:
        subprocess.run([sys.executable, TRAIN, str(out / "ckpt"), str(out / "final.pt"),
                        str(steps), "0"], env=child_env(), check=True, capture_output=True,
                       timeout=120)

    return torch.load(cached("train_bitwise", {"steps": steps}, make) / "final.pt")


def test_a_fresh_machine_resumes_from_the_mirror_bitwise(tmp_path, mirror):
    import torch

    first = tmp_path / "machine-a" / "run"
    first.parent.mkdir()
    r = launch(first, "--mirror", mirror.url, TRAIN, "{ckpt_dir}", str(tmp_path / "a.pt"), "6",
               "0", env=mirror.env, timeout=120)
    assert r.returncode == 0, r.stderr
    final = events(first, "mirror_final")[-1]
    assert final["made_it"] is True and final["step"] == 6, final
    assert 6 in mirror.committed()
    if not mirror.url.startswith("s3://"):  # a shared directory: private, as the run's files
        ckpt = Path(mirror.url) / "checkpoint-6"
        assert ckpt.stat().st_mode & 0o777 == 0o700
        assert {p.stat().st_mode & 0o777 for p in ckpt.iterdir()} == {0o600}
    shutil.rmtree(tmp_path / "machine-a")  # the machine and its disk are gone

    second = tmp_path / "machine-b" / "run"
    second.parent.mkdir()
    r = launch(second, "--mirror", mirror.url, TRAIN, "{ckpt_dir}", str(tmp_path / "b.pt"),
               "12", "0", env=mirror.env, timeout=120)
    assert r.returncode == 0, r.stderr
    down = events(second, "mirror_downloaded")
    assert [d["step"] for d in down] == [6]
    assert events(second, "launch")[0]["resume_from"].endswith("checkpoint-6")
    assert_bitwise_equal(torch.load(tmp_path / "b.pt"), reference(tmp_path, 12))


@pytest.mark.soak  # the mirror's failure cases; a fresh machine's resume is the default's
def test_a_corrupt_file_on_the_mirror_is_skipped_for_the_one_before(tmp_path, mirror):
    run = tmp_path / "a" / "run"
    run.parent.mkdir()
    # milestone_every = 3: both checkpoints go up even when the second comes before the first
    # was sent.
    (run.parent / "rtrain.toml").write_text("milestone_every = 3\nkeep_remote = 5\n")
    r = launch(run, "--mirror", mirror.url, TRAIN, "{ckpt_dir}", str(tmp_path / "a.pt"), "6",
               "0", env=mirror.env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert mirror.committed() == [3, 6]
    m = mirror.open()
    target = f"{m.root}/checkpoint-6/model.safetensors"
    data = bytearray(m.fs.cat_file(target))
    data[-1] ^= 0xFF  # one flipped byte, same size: only a content hash sees it
    m.fs.pipe_file(target, bytes(data))
    shutil.rmtree(run)

    r = launch(run, "--mirror", mirror.url, TRAIN, "{ckpt_dir}", str(tmp_path / "b.pt"), "9",
               "0", env=mirror.env, timeout=120)
    assert r.returncode == 0, r.stderr
    skipped = events(run, "skipped_checkpoint")
    assert len(skipped) == 1 and skipped[0]["path"].endswith("checkpoint-6")
    assert "on the mirror" in skipped[0]["reason"] and "model.safetensors" in skipped[0]["reason"]
    assert [d["step"] for d in events(run, "mirror_downloaded")] == [3]
    assert events(run, "launch")[0]["resume_from"].endswith("checkpoint-3")
    assert not (run / "checkpoints" / "checkpoint-6").exists() or \
        events(run, "mirror_uploaded"), "a corrupt download never becomes a local checkpoint"


def test_wrong_credentials_stop_the_launch_before_training(tmp_path):
    server = S3Server(auth=True).start()
    try:
        run = tmp_path / "run"
        r = launch(run, "--mirror", f"s3://{BUCKET}/p", TRAIN, "{ckpt_dir}",
                   str(tmp_path / "x.pt"), "3", "0", env=server.env, timeout=60)
    finally:
        server.stop()
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("rtrain: error: "), r.stderr
    assert "credential" in lines[0].lower() or "denied" in lines[0].lower(), lines[0]
    assert "testing" not in r.stderr  # the secret never appears
    assert not (run / "attempts").exists(), "no attempt may start"


def _wait_event(run: Path, kind: str, timeout: float, pred=lambda e: True) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in events(run, kind) if pred(e)]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no {kind} event within {timeout} s: {[e['kind'] for e in events(run)]}")


@pytest.mark.soak  # the mirror's failure cases; a fresh machine's resume is the default's
def test_preemption_uploads_the_final_checkpoint_and_status_says_so(tmp_path, s3, monkeypatch):
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    url = f"s3://{BUCKET}/preempt"
    run = tmp_path / "run"
    proc = subprocess.Popen(launch_cmd(run, "--mirror", url, BIG, "{ckpt_dir}", "4", "3", "0.5"),
                            cwd=tmp_path, env=child_env(**s3.env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_event(run, "mirror_uploaded", 60)
        _wait_event(run, "launch", 5)
        time.sleep(1.2)  # the last checkpoint is committed; its upload may be under way
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    final = events(run, "mirror_final")[-1]
    assert final == {**final, "step": 3, "made_it": True}
    assert 3 in Mirror(url, s3.env).committed()
    status = run_rtrain("status", str(run), env=s3.env)
    assert "step 3 made it to the mirror" in status.stdout, status.stdout
    data = json.loads(run_rtrain("status", "--json", str(run), env=s3.env).stdout)
    assert data["mirror"]["final"]["made_it"] is True and data["mirror"]["behind_steps"] == 0


def _remote_state(m, step: int) -> tuple[bool, int]:
    """(manifest present, number of other files) of checkpoint-<step> on the mirror."""
    try:
        names = [p.rsplit("/", 1)[-1] for p in m.fs.find(f"{m.root}/checkpoint-{step}")]
    except FileNotFoundError:
        return False, 0
    return "manifest.json" in names, len([n for n in names if n != "manifest.json"])


@pytest.mark.soak  # the mirror's failure cases; a fresh machine's resume is the default's
def test_sigkill_of_rtrain_mid_upload_leaves_no_manifest_without_its_files(tmp_path, s3,
                                                                             monkeypatch):
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    url = f"s3://{BUCKET}/kill"
    run = tmp_path / "run"
    m = Mirror(url, s3.env).open()
    # One checkpoint of 4 x 96 MiB: its small files arrive well before its large ones.
    cmd = launch_cmd(run, "--mirror", url, BIG, "{ckpt_dir}", "96", "1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(**s3.env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen_partial = False
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            m.fs.invalidate_cache()
            committed, files = _remote_state(m, 1)
            assert not committed or files == 5, "a manifest went up before its files"
            if files and not committed:
                seen_partial = True
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        proc.wait(30)
    finally:
        proc.kill()
    assert seen_partial, "the upload finished before it could be interrupted"
    time.sleep(1)  # the uploader dies with rtrain (PDEATHSIG): nothing more arrives
    m.fs.invalidate_cache()
    assert _remote_state(m, 1)[0] is False
    assert [c.committed for c in m.list()] == [False]

    # The next launch finishes the upload: all files, then the manifest.
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(**s3.env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_event(run, "mirror_uploaded", 90)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        proc.kill()
    m.fs.invalidate_cache()
    assert _remote_state(m, 1) == (True, 5)
    from rtrain.supervisor.mirror.verify_remote import verify_remote

    [rc] = m.list()
    assert verify_remote(m, rc, "full", None).ok


@pytest.mark.soak  # the mirror's failure cases; a fresh machine's resume is the default's
def test_an_outage_of_the_store_never_slows_training_and_is_caught_up(tmp_path, s3, monkeypatch):
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    url = f"s3://{BUCKET}/outage"
    run = tmp_path / "run"
    # A checkpoint every 0.5 s for about 30 s.
    proc = subprocess.Popen(launch_cmd(run, "--mirror", url, BIG, "{ckpt_dir}", "1", "60", "0.5",
                                       "1"),
                            cwd=tmp_path, env=child_env(**s3.env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_event(run, "mirror_uploaded", 60)
        time.sleep(3)  # a pace to compare with
        s3.stop()
        down_at = time.time()
        time.sleep(20)
        s3.start()  # same port, empty but for the bucket
        up_at = time.time()
        caught = _wait_event(run, "mirror_uploaded", 60, lambda e: e["time"] > up_at)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    failed = [e for e in events(run, "mirror_failed") if down_at <= e["time"] <= up_at + 1]
    # An upload that failed is retried within 30 s. A prune that failed (the store went down
    # right after an upload) waits for the next upload's prune instead: it has no retry of its own.
    uploads = [e for e in failed if not e["reason"].startswith("retention: ")]
    assert uploads, "the outage was not reported"
    assert all(e["retry_in_s"] <= 30 for e in uploads), uploads
    # Training went on: commits kept their pace (one every ~0.5 s) through the outage.
    assert not [e for e in events(run, "classification") if e["failure"] != "preempted"]
    # Compared with the pace before the outage, in the same run (the machine is shared).
    times = sorted(p.stat().st_mtime for p in (run / "checkpoints").glob("checkpoint-*"))
    before = [t for t in times if t < down_at]
    during = [t for t in times if down_at <= t <= up_at]
    pace_before = (len(before) - 1) / (before[-1] - before[0])
    pace_during = len(during) / (up_at - down_at)
    assert pace_during >= 0.7 * pace_before, (pace_during, pace_before)
    assert max(b - a for a, b in itertools.pairwise(times)) < 5.0
    # Caught up: right after the restart the newest went first, and the end is current. "Newest"
    # as of when that upload began: checkpoints kept coming while it ran, longer on a busy machine.
    began = caught["time"] - caught["seconds"]
    newest_then = max(int(p.name.split("-")[1])
                      for p in (run / "checkpoints").glob("checkpoint-*")
                      if p.stat().st_mtime <= began)
    assert caught["step"] >= newest_then - 3
    assert events(run, "mirror_superseded"), "the steps committed during the outage never go up"
    assert events(run, "mirror_final")[-1]["made_it"] is True


@pytest.mark.soak  # the mirror's failure cases; a fresh machine's resume is the default's
def test_a_store_down_at_a_relaunch_does_not_stop_training_but_stops_a_new_run(tmp_path):
    server = S3Server().start()
    url = f"s3://{BUCKET}/down"
    run = tmp_path / "run"
    args = ("--mirror", url, BIG, "{ckpt_dir}", "1", "2", "0.2")
    try:
        proc = subprocess.Popen(launch_cmd(run, *args), cwd=tmp_path, env=child_env(**server.env),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _wait_event(run, "mirror_uploaded", 60, lambda e: e["step"] == 2)
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        finally:
            proc.kill()
        assert proc.returncode == 75
    finally:
        server.stop()
    # The store is down: the requeued run trains anyway; the new one is told at once.
    new = launch(tmp_path / "new-run", *args, env=server.env, timeout=120)
    assert new.returncode == 2 and "the endpoint does not answer" in new.stderr, new.stderr
    proc = subprocess.Popen(launch_cmd(run, *args), cwd=tmp_path, env=child_env(**server.env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_event(run, "launch", 60, lambda e: e["attempt"] == 1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    assert "training goes on, uploads will catch up" in err
    assert events(run, "mirror_final")[-1]["made_it"] is False


@pytest.mark.soak  # the mirror's failure cases; a fresh machine's resume is the default's
def test_encrypted_checkpoints_travel_encrypted_and_resume_bitwise(tmp_path):
    import torch

    from rtrain.checkpoint.encrypted_file import MAGIC

    key = {"RTRAIN_ENCRYPTION_KEY": "ab" * 32, "RTRAIN_CACHE_DIR": str(tmp_path / "cache")}
    mirror = tmp_path / "shared-fs"
    first = tmp_path / "a" / "run"
    first.parent.mkdir()
    r = launch(first, "--mirror", str(mirror), TRAIN, "{ckpt_dir}", str(tmp_path / "a.pt"), "6",
               "0", env=key, timeout=120)
    assert r.returncode == 0, r.stderr
    for f in (mirror / "checkpoint-6").iterdir():  # ciphertext on the mirror, not just locally
        if f.name != "manifest.json":
            assert f.read_bytes()[:len(MAGIC)] == MAGIC, f.name
    shutil.rmtree(first.parent)

    second = tmp_path / "b" / "run"
    second.parent.mkdir()
    r = launch(second, "--mirror", str(mirror), TRAIN, "{ckpt_dir}", str(tmp_path / "b.pt"),
               "12", "0", env=key, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [d["step"] for d in events(second, "mirror_downloaded")] == [6]
    assert_bitwise_equal(torch.load(tmp_path / "b.pt"), reference(tmp_path, 12))


@pytest.mark.soak  # the mirror's failure cases; a fresh machine's resume is the default's
def test_an_upload_outlives_the_child_killed_during_it(tmp_path, s3, monkeypatch):
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    url = f"s3://{BUCKET}/child-killed"
    run = tmp_path / "run"
    # Attempt 0 commits 4 x 96 MiB and SIGKILLs itself at once: the upload has just begun.
    proc = subprocess.Popen(launch_cmd(run, "--mirror", url, BIG, "{ckpt_dir}", "96", "1"),
                            cwd=tmp_path, env=child_env(**s3.env, COMMIT_BIG_KILL_SELF="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        uploaded = _wait_event(run, "mirror_uploaded", 120)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    killed = next(e for e in events(run, "exit") if e["attempt"] == 0)
    assert killed["signal"] == "SIGKILL"
    assert uploaded["step"] == 1 and uploaded["time"] > killed["time"], (uploaded, killed)
    m = Mirror(url, s3.env).open()
    from rtrain.supervisor.mirror.verify_remote import verify_remote

    [rc] = m.list()
    assert rc.committed and verify_remote(m, rc, "full", None).ok


def _train_and_stop(run: Path, url: str, env: dict[str, str], steps: int, *extra: str,
                    cwd: Path) -> str:
    """Launch BIG until `steps` is on the mirror (it then waits to be stopped), stop it as a
    preemption would; rtrain's stderr."""
    proc = subprocess.Popen(launch_cmd(run, "--mirror", url, *extra, BIG, "{ckpt_dir}", "1",
                                       str(steps)),
                            cwd=cwd, env=child_env(**env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_event(run, "mirror_uploaded", 60, lambda e: e["step"] == steps)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    return err


def test_an_earlier_run_under_the_url_neither_stops_uploads_nor_is_resumed_from(tmp_path, s3,
                                                                              monkeypatch):
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)  # the in-process reader too
    url = f"s3://{BUCKET}/two-runs"
    _train_and_stop(tmp_path / "earlier", url, s3.env, 8, cwd=tmp_path)
    # A new run under the same URL, started over: its steps are all below the earlier run's.
    run = tmp_path / "machine-a" / "run"
    err = _train_and_stop(run, url, s3.env, 3, "--resume", "never", cwd=tmp_path)
    [said] = events(run, "mirror_other_run")
    assert said["newest"] == 8 and "holds checkpoints of another run (step 8" in err, err
    final = events(run, "mirror_final")[-1]
    assert final == {**final, "step": 3, "made_it": True}, final
    # Each run's retention (keep 3) counts its own only: both runs' newest stay.
    assert {3, 8} <= set(Mirror(url, s3.env).committed())
    # Its machine is gone; a fresh one continues it from its own newest, not from step 8.
    shutil.rmtree(tmp_path / "machine-a")
    again = tmp_path / "machine-b" / "run"
    proc = subprocess.Popen(launch_cmd(again, "--mirror", url, BIG, "{ckpt_dir}", "1", "5"),
                            cwd=tmp_path, env=child_env(**s3.env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_event(again, "mirror_uploaded", 60, lambda e: e["step"] == 5)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert [d["step"] for d in events(again, "mirror_downloaded")] == [3]
    assert events(again, "launch")[0]["resume_from"].endswith("checkpoint-3")
