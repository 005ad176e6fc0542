"""Secrets and file modes: a signing key file others can read is refused (unless
RTRAIN_ALLOW_SHARED_KEY=1), hooks never see the signing key while the training child does, and
a real launch leaves its run dir 0700 and its files (state, events, lock, checkpoints) 0600 whatever
the umask, or the `file_mode` a team sets."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from chaos_util import rtrain_cmd, write_config
from harness import child_env, events, launch

DUMP_ENV = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


def _key_file(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / f"key-{mode:o}"
    path.write_bytes(b"a team secret\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_key_file_others_can_read_is_refused(tmp_path, rtrain, make_ckpt, mode):
    make_ckpt(tmp_path / "ckpts", 10)
    key = _key_file(tmp_path, mode)
    r = rtrain("inspect", str(tmp_path / "ckpts"), env={"RTRAIN_SIGNING_KEY_FILE": str(key)})
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert f"is accessible by group or others (mode {mode:04o}): chmod 600 it, or set " \
           "RTRAIN_ALLOW_SHARED_KEY=1" in r.stderr
    # The same file, said to be meant: accepted (the checkpoint is unsigned, so quick fails).
    r = rtrain("inspect", str(tmp_path / "ckpts"), "--verify", "quick",
               env={"RTRAIN_SIGNING_KEY_FILE": str(key), "RTRAIN_ALLOW_SHARED_KEY": "1"})
    assert r.returncode == 1 and "unsigned, but a signing key is configured" in r.stdout


def test_private_key_file_is_used(tmp_path, rtrain, make_ckpt):
    from rtrain.checkpoint import hashing

    key = _key_file(tmp_path, 0o600)
    make_ckpt(tmp_path / "ckpts", 10, key=hashing.derive_key(b"a team secret"))
    r = rtrain("inspect", str(tmp_path / "ckpts"), "--verify", "full",
               env={"RTRAIN_SIGNING_KEY_FILE": str(key)})
    assert r.returncode == 0, r.stdout + r.stderr


def test_launch_refuses_a_shared_key_before_running(tmp_path, rtrain):
    key = _key_file(tmp_path, 0o644)
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w')\n")
    r = rtrain("launch", "--run-dir", str(tmp_path / "run"), str(script), cwd=tmp_path,
               env={"RTRAIN_SIGNING_KEY_FILE": str(key)})
    assert r.returncode == 2 and "RTRAIN_ALLOW_SHARED_KEY=1" in r.stderr, r.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_key_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path, rtrain):
    fifo = tmp_path / "key"
    os.mkfifo(fifo, 0o600)
    r = rtrain("inspect", str(tmp_path), env={"RTRAIN_SIGNING_KEY_FILE": str(fifo)})
    assert r.returncode == 2 and "is not a regular file" in r.stderr


@pytest.mark.slow
def test_hooks_do_not_see_the_keys_but_the_child_does(tmp_path):
    child_dump, hook_env = tmp_path / "child-env.json", tmp_path / "hook-env.json"
    script = tmp_path / "train.py"
    script.write_text(DUMP_ENV + "\n")
    hook = json.dumps([sys.executable, "-c", DUMP_ENV, str(hook_env)])
    (tmp_path / "rtrain.toml").write_text(f'[[hooks]]\non = ["finished"]\ncommand = {hook}\n')
    r = launch(tmp_path / "run", str(script), str(child_dump),
               env={"RTRAIN_SIGNING_KEY": "hunter2", "RTRAIN_ENCRYPTION_KEY": "hunter3"},
               timeout=120)
    assert r.returncode == 0, r.stderr
    child = json.loads(child_dump.read_text())
    assert child["RTRAIN_SIGNING_KEY"] == "hunter2" and child["RTRAIN_ENCRYPTION_KEY"] == "hunter3"
    hook = json.loads(hook_env.read_text())
    assert "RTRAIN_SIGNING_KEY" not in hook and "RTRAIN_ENCRYPTION_KEY" not in hook
    assert hook["RTRAIN_EVENT"] == "finished" and hook["RTRAIN_RUN_DIR"]
    assert "hunter2" not in json.dumps(hook) and "hunter3" not in json.dumps(hook)
    assert not events(tmp_path / "run", "hook_failed")


# ------------------------------------------------------------------ file modes


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _launch_chaos(tmp_path: Path, ckpts: Path | None = None, **config) -> Path:
    write_config(tmp_path / "rtrain.toml", {"steps": 6, "save_every": 2}, **config)
    run = tmp_path / "run"
    args = ["--ckpt-dir", str(ckpts)] if ckpts else []
    r = subprocess.run(rtrain_cmd(run, *args), env=child_env(), cwd=tmp_path,
                       capture_output=True, text=True, timeout=150,
                       umask=0o022)  # a permissive umask, as often
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def _checkpoint_modes(ckpts: Path) -> set[tuple[str, int]]:
    out = set()
    for ckpt in ckpts.glob("checkpoint-*"):
        out.add(("dir", _mode(ckpt)))
        out |= {("file", _mode(f)) for f in ckpt.rglob("*") if f.is_file()}
    return out


@pytest.mark.slow
def test_a_real_launch_keeps_its_files_private(tmp_path):
    ckpts = tmp_path / "elsewhere" / "ckpts"  # a --ckpt-dir outside the run dir
    run = _launch_chaos(tmp_path, ckpts)
    assert _mode(run) == 0o700
    for name in ("state.json", "events.jsonl", ".rtrain.lock"):
        assert _mode(run / name) == 0o600, name
    assert _mode(ckpts) == 0o700 and _mode(ckpts.parent) == 0o700
    assert len(list(ckpts.glob("checkpoint-*"))) == 3
    assert _checkpoint_modes(ckpts) == {("dir", 0o700), ("file", 0o600)}


@pytest.mark.slow
def test_file_mode_shares_a_run_with_a_group(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)  # made by a person: keeps its mode
    (run / "events.jsonl").touch(mode=0o644)  # written by an older rtrain: brought in line
    os.chmod(run / "events.jsonl", 0o644)
    _launch_chaos(tmp_path, file_mode="0640")
    assert _mode(run) == 0o755
    for name in ("state.json", "events.jsonl", ".rtrain.lock"):
        assert _mode(run / name) == 0o640, name
    assert _mode(run / "checkpoints") == 0o750
    assert _checkpoint_modes(run / "checkpoints") == {("dir", 0o750), ("file", 0o640)}
