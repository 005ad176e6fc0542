"""Checkpoint dirs made by someone hostile or careless: FIFOs, devices and links where files
should be, and parser bombs in manifests and headers. Every reader must answer (never hang,
never crash) and report the bad checkpoint with its reason while using the good ones.

The commands run as real `rtrain` subprocesses with a timeout: a reader that opens a FIFO blocks
forever, and the timeout turns that into a failure instead of a frozen test run.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time

import pytest
from harness import REPO, child_env

from rtrain.checkpoint import hashing
from rtrain.checkpoint.layout import MANIFEST, list_checkpoints
from rtrain.checkpoint.manifest import dumps

HANG_S = 30  # far above a normal run, even on a loaded machine


def run_bounded(*argv: str) -> subprocess.CompletedProcess:
    """`python ARGV` with rtrain importable; a run past HANG_S fails the test."""
    try:
        return subprocess.run([sys.executable, *argv], cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(argv[:4])} hung for {HANG_S} s")


def rtrain_bounded(*args: str) -> subprocess.CompletedProcess:
    return run_bounded("-m", "rtrain", *args)


@pytest.fixture
def three(tmp_path, make_ckpt):
    d = tmp_path / "checkpoints"
    for step in (100, 200, 300):
        make_ckpt(d, step, metrics={"loss": 1 / step})
    return d


def listing(ckpt_dir, *extra: str) -> dict[str, dict]:
    r = rtrain_bounded("inspect", str(ckpt_dir), "--json", *extra)
    assert r.returncode in (0, 1), r.stderr
    assert "Traceback" not in r.stderr
    return {c["name"]: c for c in json.loads(r.stdout)["checkpoints"]}


def rewrite_manifest(ckpt, **changes) -> None:
    m = json.loads((ckpt / MANIFEST).read_bytes())
    m.update(changes)
    (ckpt / MANIFEST).write_bytes(dumps(m))


# --- files that are not regular files ---------------------------------------------------------


@pytest.mark.slow
def test_fifo_as_manifest_is_reported_by_inspect_and_prune(three):
    (three / "checkpoint-300" / MANIFEST).unlink()
    os.mkfifo(three / "checkpoint-300" / MANIFEST)
    for level in ("quick", "full"):
        rows = listing(three, "--verify", level)
        assert rows["checkpoint-300"]["status"] == "corrupt"
        assert "FIFO" in rows["checkpoint-300"]["reason"]
        assert rows["checkpoint-200"]["resume"] and rows["checkpoint-200"]["status"] == "ok"
    r = rtrain_bounded("prune", str(three), "--keep", "1")
    assert r.returncode == 0, r.stderr
    # The FIFO one is newer than any good one: left for a person; the newest good one stays.
    assert sorted(s for s, _ in list_checkpoints(three)) == [200, 300]


@pytest.mark.slow
def test_fifo_listed_in_the_manifest_is_refused_before_hashing(three):
    ckpt = three / "checkpoint-300"
    (ckpt / "state.json").unlink()
    os.mkfifo(ckpt / "state.json")
    m = json.loads((ckpt / MANIFEST).read_bytes())
    m["files"]["state.json"]["size"] = 0  # a FIFO stats as 0 bytes: sizes alone match
    rewrite_manifest(ckpt, files=m["files"])
    rows = listing(three, "--verify", "full")
    assert rows["checkpoint-300"]["status"] == "corrupt"
    assert "'state.json' is a FIFO" in rows["checkpoint-300"]["reason"]
    r = rtrain_bounded("inspect", str(ckpt), "--verify", "full")
    assert r.returncode == 1 and "is a FIFO" in r.stdout


@pytest.mark.slow
def test_fifo_in_a_trainer_checkpoint(tmp_path, make_ckpt):
    d = tmp_path / "out"
    hf = d / "checkpoint-10"
    hf.mkdir(parents=True)
    make_ckpt(tmp_path / "scratch", 1)
    shutil.copy(tmp_path / "scratch" / "checkpoint-1" / "model.safetensors", hf)
    os.mkfifo(hf / "trainer_state.json")
    rows = listing(d)
    assert rows["checkpoint-10"]["status"] == "corrupt"
    assert "FIFO" in rows["checkpoint-10"]["reason"]


@pytest.mark.slow
def test_restore_skips_a_fifo_manifest(three):
    (three / "checkpoint-300" / MANIFEST).unlink()
    os.mkfifo(three / "checkpoint-300" / MANIFEST)
    r = run_bounded("-c", "import sys; from rtrain import Checkpointer; "
                          "print(Checkpointer(ckpt_dir=sys.argv[1]).restore())", str(three))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "200"
    assert "skipping checkpoint-300" in r.stderr and "FIFO" in r.stderr


@pytest.mark.slow
def test_symlinked_manifest_is_reported_not_followed(three, tmp_path):
    outside = tmp_path / "elsewhere.json"
    shutil.copy(three / "checkpoint-300" / MANIFEST, outside)  # a valid manifest
    (three / "checkpoint-300" / MANIFEST).unlink()
    (three / "checkpoint-300" / MANIFEST).symlink_to(outside)
    rows = listing(three, "--verify", "full")
    assert rows["checkpoint-300"]["status"] == "corrupt"
    assert "symbolic link" in rows["checkpoint-300"]["reason"]
    assert rows["checkpoint-200"]["resume"]


@pytest.mark.slow
def test_symlinked_checkpoint_dir_is_reported_and_prune_never_follows_it(three, tmp_path,
                                                                         make_ckpt):
    outside = tmp_path / "outside"
    newer, older = make_ckpt(outside, 500), make_ckpt(outside, 50)
    (three / "checkpoint-500").symlink_to(newer)
    (three / "checkpoint-50").symlink_to(older)
    rows = listing(three)
    for name in ("checkpoint-500", "checkpoint-50"):
        assert rows[name]["status"] == "corrupt"
        assert "symbolic link" in rows[name]["reason"], rows[name]
    assert rows["checkpoint-300"]["resume"]
    r = rtrain_bounded("prune", str(three), "--keep", "1")
    assert r.returncode == 0, r.stderr
    # The older link is removed as a failed entry (the link only), the newer one is left.
    assert not os.path.lexists(three / "checkpoint-50")
    assert (three / "checkpoint-500").is_symlink()
    assert sorted(s for s, _ in list_checkpoints(outside)) == [50, 500]
    assert (older / MANIFEST).is_file() and (older / "model.safetensors").is_file()


def test_open_regular_refuses_what_is_not_a_regular_file(tmp_path):
    from rtrain.checkpoint import safeio

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for name, words in (("fifo", "FIFO"), ("link", "symbolic link")):
        with pytest.raises(safeio.UnsafeFile, match=words):
            safeio.open_regular(tmp_path / name)
    with pytest.raises(safeio.UnsafeFile, match="character device"):
        safeio.open_regular("/dev/zero")
    with safeio.open_regular(tmp_path / "link", follow_symlinks=True) as f:
        assert f.read() == b"x"


# --- parser bombs -----------------------------------------------------------------------------


def _nested_manifest(ckpt) -> None:
    (ckpt / MANIFEST).write_bytes(b"[" * 200_000 + b"]" * 200_000)


def _huge_manifest(ckpt) -> None:
    m = json.loads((ckpt / MANIFEST).read_bytes())
    m["info"] = {"pad": "x" * (17 << 20)}  # valid, and a size no real manifest has
    (ckpt / MANIFEST).write_bytes(dumps(m))


def _nan_created(ckpt) -> None:
    raw = (ckpt / MANIFEST).read_bytes()
    m = json.loads(raw)
    (ckpt / MANIFEST).write_bytes(raw.replace(b'"created": ' + repr(m["created"]).encode(),
                                              b'"created": 1e400'))


def _huge_int_metric(ckpt) -> None:
    raw = (ckpt / MANIFEST).read_bytes()
    (ckpt / MANIFEST).write_bytes(raw.replace(b'"metrics": {', b'"metrics": {"n": 1'
                                              + b"0" * 5000 + b", ", 1))


def _negative_samples(ckpt) -> None:
    rewrite_manifest(ckpt, samples_seen=-5)


BOMBS = {
    "nested": (_nested_manifest, "nested more than"),
    "huge": (_huge_manifest, "16 MiB"),
    "non-finite": (_nan_created, "too large for a float"),
    "huge int": (_huge_int_metric, "too large to read"),
    "negative count": (_negative_samples, "out of range"),
}


@pytest.mark.slow
@pytest.mark.parametrize("bomb", BOMBS)
def test_manifest_bomb_is_one_corrupt_row_among_good_ones(three, bomb):
    make, words = BOMBS[bomb]
    make(three / "checkpoint-300")
    r = rtrain_bounded("inspect", str(three))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    rows = {(ln.split()[1] if ln.split()[0] == "*" else ln.split()[0]): ln
            for ln in r.stdout.splitlines()[2:5]}
    assert "corrupt: manifest.json" in rows["300"] and words in rows["300"]
    assert rows["200"].startswith("  *") and rows["100"].rstrip().endswith("ok")


@pytest.mark.slow
def test_restore_passes_over_a_nested_manifest(three):
    _nested_manifest(three / "checkpoint-300")
    r = run_bounded("-c", "import sys; from rtrain import Checkpointer; "
                          "print(Checkpointer(ckpt_dir=sys.argv[1]).restore())", str(three))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "200"


def _header_file(path, header: bytes, length: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header)


@pytest.mark.slow
@pytest.mark.parametrize("header, length, words", [
    (b"[" * 100_000 + b"]" * 100_000, None, "nested more than"),
    (b"{}", 8 << 30, "does not fit"),
], ids=["deep", "8-GiB-length"])  # ids: pytest < 9.2 names a case by its bytes, and the child
# inherits the name in PYTEST_CURRENT_TEST, past the kernel's limit on one variable (E2BIG)
def test_safetensors_header_bomb_in_one_checkpoint(three, header, length, words):
    ckpt = three / "checkpoint-300"
    _header_file(ckpt / "model.safetensors", header, length)
    m = json.loads((ckpt / MANIFEST).read_bytes())
    path = ckpt / "model.safetensors"
    m["files"]["model.safetensors"] = {"size": path.stat().st_size,
                                       "hash": hashing.hash_file(path)}
    rewrite_manifest(ckpt, files=m["files"], tensors=None)  # inspect reads the file's header
    r = rtrain_bounded("inspect", str(ckpt), "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    tensors = json.loads(r.stdout)["tensors"]["model.safetensors"]
    assert tensors.startswith("header unreadable") and words in tensors


@pytest.mark.slow
def test_metrics_file_passes_over_a_fifo_manifest(three, tmp_path):
    (three / "checkpoint-300" / MANIFEST).unlink()
    os.mkfifo(three / "checkpoint-300" / MANIFEST)
    out = tmp_path / "m.prom"
    r = run_bounded("-c", "import sys; from pathlib import Path; "
                          "from rtrain.supervisor.metrics.file import MetricsFile; "
                          "MetricsFile(Path(sys.argv[1]), run_dir=Path(sys.argv[2]), "
                          "ckpt_dir=Path(sys.argv[3])).heartbeat(step=1)",
                    str(out), str(tmp_path), str(three))
    assert r.returncode == 0, r.stderr
    assert "rtrain_last_checkpoint_age_seconds" in out.read_text()


@pytest.mark.parametrize("raw", [b'"\\' * 2_000_000, b'"' * 4_000_000, b"[" * 4_000_000],
                         ids=["escapes", "quotes", "brackets"])
def test_bomb_screening_is_linear(raw):
    """4 MB of quotes, backslashes or brackets: refused in about a second, where a quadratic
    scan (or the recursive parser) would take hours (or overflow)."""
    from rtrain.checkpoint import safeio

    t0 = time.process_time()
    with pytest.raises(ValueError):
        safeio.parse_json(raw)
    assert time.process_time() - t0 < 30


def test_a_save_replaces_a_link_with_its_name_and_leaves_the_target(three, tmp_path, make_ckpt):
    outside = make_ckpt(tmp_path / "outside", 400)
    (three / "checkpoint-400").symlink_to(outside)
    (three / ".trash-checkpoint-9-abcd").symlink_to(outside)  # a leftover that is a link
    saved = make_ckpt(three, 400)  # the run saves step 400 again
    assert not saved.is_symlink() and saved.is_dir()
    assert (outside / MANIFEST).is_file() and (outside / "model.safetensors").is_file()
    from rtrain.supervisor.retention import prune_dir as prune_mod
    from rtrain.supervisor.retention.decide import RetentionPolicy

    prune_mod.prune(three, RetentionPolicy(keep=4))
    assert not os.path.lexists(three / ".trash-checkpoint-9-abcd")
    assert (outside / MANIFEST).is_file()


@pytest.mark.slow
def test_launch_resumes_from_the_newest_good_one_past_a_fifo_and_a_bomb(three, tmp_path,
                                                                          make_ckpt):
    make_ckpt(three, 400)
    (three / "checkpoint-400" / MANIFEST).unlink()
    os.mkfifo(three / "checkpoint-400" / MANIFEST)
    _nested_manifest(three / "checkpoint-300")
    (tmp_path / "echo.py").write_text(
        "import os; print('FROM', os.environ.get('RTRAIN_RESUME_FROM'))\n")
    r = run_bounded("-m", "rtrain", "launch", "--run-dir", str(tmp_path / "run"), "-q",
                    "--no-backoff", "--ckpt-dir", str(three), str(tmp_path / "echo.py"))
    assert r.returncode == 0, r.stderr
    assert "skipping checkpoint-400: corrupt: manifest.json is a FIFO" in r.stderr
    assert "skipping checkpoint-300: corrupt: manifest.json is nested" in r.stderr
    log = next((tmp_path / "run" / "attempts").rglob("*.log")).read_text()
    assert f"FROM {three / 'checkpoint-200'}" in log
