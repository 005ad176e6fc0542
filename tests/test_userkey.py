"""The user's own key (supervisor/proc/userkey.py) and the signed procs.json it makes possible:
made private on first use, refused where others could read or swap it, and a record that was
changed, copied or written without it proves nothing (no process is started here; the tests
that end real processes are in test_leftovers.py)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from rtrain.supervisor.proc import leftovers, userkey


@pytest.fixture
def state(tmp_path, monkeypatch):
    home = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
    return home / "rtrain"


def test_made_on_first_use_private_and_the_same_afterwards(state):
    assert userkey.load(create=False) == (None, f"no key at {state / userkey.KEY_NAME}")
    key, why = userkey.load(create=True)
    assert key is not None and len(key) == userkey.KEY_BYTES and why == ""
    path = state / userkey.KEY_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert userkey.load(create=True) == (key, "")
    assert [p.name for p in state.iterdir()] == [userkey.KEY_NAME]  # no temp file left


def test_a_key_others_may_read_is_refused_with_the_fix(state):
    userkey.load(create=True)
    (state / userkey.KEY_NAME).chmod(0o644)
    key, why = userkey.load(create=True)
    assert key is None
    assert "mode 0644 lets others read or write it (chmod 600 it" in why


def test_a_symlink_or_a_short_file_is_refused(state, tmp_path):
    state.mkdir(parents=True)
    target = tmp_path / "elsewhere"
    target.write_bytes(os.urandom(userkey.KEY_BYTES))
    target.chmod(0o600)
    (state / userkey.KEY_NAME).symlink_to(target)
    assert userkey.load(create=False)[0] is None
    (state / userkey.KEY_NAME).unlink()
    (state / userkey.KEY_NAME).write_bytes(b"short")
    (state / userkey.KEY_NAME).chmod(0o600)
    key, why = userkey.load(create=False)
    assert key is None and "holds 5 bytes" in why


def test_without_a_home_there_is_no_key(monkeypatch):
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr("pathlib.Path.home", lambda: (_ for _ in ()).throw(RuntimeError("no")))
    assert userkey.load(create=True) == (None, "no home directory to keep rtrain's key in")


def _record(run, pids):
    leftovers.ProcRecord(run).update(pids)
    return json.loads((run / leftovers.PROCS_FILE).read_text())


def test_the_record_verifies_only_unchanged_and_for_its_own_run_dir(state, tmp_path):
    me = os.getpid()
    run = tmp_path / "run"
    body = _record(run, [me])
    assert body["procs"] == [[me, leftovers.start_time(me)]] and len(body["mac"]) == 64
    assert leftovers._recorded(run.resolve()).distrust is None

    body["procs"].append([1, leftovers.start_time(1)])  # a process added by someone else
    (run / leftovers.PROCS_FILE).write_text(json.dumps(body))
    assert "does not match" in leftovers._recorded(run.resolve()).distrust

    other = tmp_path / "other"
    other.mkdir()
    (other / leftovers.PROCS_FILE).write_text(json.dumps(_record(run, [me])))
    assert "does not match" in leftovers._recorded(other.resolve()).distrust


def test_without_the_key_a_record_is_not_believed(state, tmp_path):
    run = tmp_path / "run"
    _record(run, [os.getpid()])
    (state / userkey.KEY_NAME).unlink()
    distrust = leftovers._recorded(run.resolve()).distrust
    assert distrust.startswith("procs.json's signature cannot be checked (no key at ")


def test_a_record_naming_this_process_is_reported_not_ended(state, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    body = {"v": 1, "host": __import__("socket").gethostname(), "supervisor": [1, 1],
            "procs": [[os.getpid(), leftovers.start_time(os.getpid())]]}
    (run / leftovers.PROCS_FILE).write_text(json.dumps(body))
    swept = leftovers.end_leftovers(run)
    assert swept.ended == []
    assert [(s.pid, s.reason) for s in swept.skipped] == [
        (os.getpid(), "it is this rtrain or one of the processes that started it")]
