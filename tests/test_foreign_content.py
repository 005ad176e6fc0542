"""The pure and in-process parts of progress from content: the pickle walk (step, unsafe
globals), torchzip's size guards, `progress.advanced`, the decisions given `progressed`, and
the kept copy's keep / torn / restore on real files. No process is started."""

from __future__ import annotations

import io
import os
import pickle
import posix
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from observed import observed

from rtrain.checkpoint.verify import Level
from rtrain.supervisor.ckpt import foreign, keepcopy, pickle_scan, progress, torchzip
from rtrain.supervisor.config import Config
from rtrain.supervisor.decide import budgets
from rtrain.supervisor.decide.failures import Failure, FailureKind
from rtrain.supervisor.decide.policy import Action, Decision, History, decide


class Evil:
    # posix.system, os.system's own: conftest's guard replaces os.system in fast tests.
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (posix.system, (f"touch '{self.marker}'",))


class Sneaky:
    """builtins.eval through STACK_GLOBAL (protocol 4) with memoized strings."""

    def __reduce__(self):
        return (eval, ("1",))


# ------------------------------------------------------------ the pickle walk


@pytest.mark.parametrize("obj, step, key", [
    ({"model": {"w": 1}, "iter_num": 300, "config": {"step": 9}}, 300, "iter_num"),
    ({"epoch": 3, "global_step": 400}, 400, "global_step"),  # the order: global_step first
    ({"epoch": 3}, 3, "epoch"),
    (OrderedDict(step=7), 7, "step"),
    ({"iter_num": True}, None, None),  # a bool is no step
    ({"iter_num": -1}, None, None),
    ({"state": {"step": 5}}, None, None),  # nested: an optimizer's per-parameter step
    ([1, 2, 3], None, None),
])
@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_step_from_the_top_level_of_the_pickle(obj, step, key, protocol):
    s = pickle_scan.scan(pickle.dumps(obj, protocol=protocol))
    assert (s.step, s.step_key) == (step, key)


def test_step_of_a_real_torch_save():
    buf = io.BytesIO()
    torch.save({"model": torch.nn.Linear(3, 3).state_dict(), "iter_num": 42}, buf)
    with zipfile.ZipFile(buf) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert pickle_scan.scan(data).step == 42


@pytest.mark.parametrize("protocol", [0, 1, 2, 4, 5])
def test_a_reduce_to_os_system_is_refused_never_run(tmp_path, protocol):
    marker = tmp_path / "pwned"
    with pytest.raises(pickle_scan.PickleRefused, match=r"calls (posix|os)\.system"):
        pickle_scan.scan(pickle.dumps({"step": 1, "x": Evil(str(marker))}, protocol=protocol))
    assert not marker.exists()


def test_eval_through_stack_global_is_refused():
    with pytest.raises(pickle_scan.PickleRefused, match=r"builtins\.eval"):
        pickle_scan.scan(pickle.dumps([Sneaky(), Sneaky()], protocol=4))


@pytest.mark.parametrize("data, why", [
    (pickle.dumps({"a": 1})[:-4], "not a readable pickle"),
    (b"\x80\x02h\x05.", "memo 5 read before"),
    (b"\x80\x02\x8c\x02os\x94\x8c\x06system\x94\x93\x94(K\x01\x8c\x01a\x93.", "calls os.system"),
    (b"\x80\x04K\x01K\x02\x93.", "not a plain string"),
    (b"\x80\x02\x82\x01.", "extension registry"),
])
def test_malformed_or_hidden_names_are_refused(data, why):
    with pytest.raises(pickle_scan.PickleRefused, match=why):
        pickle_scan.scan(data)


def test_allowed_globals_are_counted():
    data = (b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01"
            b"X\x04\x00\x00\x00stepq\x03K\x07s.")
    s = pickle_scan.scan(data)
    assert (s.globals_named, s.step) == (1, 7)


# ------------------------------------------------------------ torchzip's guards


def evil_torch_file(path: Path, marker: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"x": Evil(str(marker))}, protocol=2))
    return path


def test_a_torch_file_whose_pickle_calls_os_system_does_not_verify(tmp_path):
    path = evil_torch_file(tmp_path / "ckpt.pt", tmp_path / "pwned")
    v = foreign.verify_path(path, Level.QUICK)
    assert not v.ok and "the pickle calls posix.system" in v.reason
    assert not (tmp_path / "pwned").exists()


def test_a_legacy_pickle_with_a_reduce_does_not_verify(tmp_path):
    # A bare pickle starts like the legacy torch.save format; it is walked, not trusted.
    path = tmp_path / "ckpt.pt"
    path.write_bytes(pickle.dumps(Evil(str(tmp_path / "pwned")), protocol=2))
    v = foreign.verify_path(path, Level.FULL)
    assert not v.ok and "system" in v.reason


def test_legacy_torch_save_still_passes_with_its_step(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2), "iter_num": 9}, path, _use_new_zipfile_serialization=False)
    v = foreign.verify_path(path, Level.FULL)
    assert v.ok and v.step == 9 and "legacy" in v.info["note"]


def test_a_zip_bomb_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(torchzip, "_BOMB_FLOOR", 1 << 20)  # 64 MiB by default: a smaller bomb
    path = tmp_path / "ckpt.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"step": 1}))
        z.writestr("archive/data/0", bytes(16 << 20))  # 16 MiB of zeros in about 16 KiB
    assert path.stat().st_size < 1 << 20
    with pytest.raises(torchzip.TorchFileError, match="zip bomb"):
        torchzip.check(path, full=True)


def test_a_huge_data_pkl_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(torchzip, "MAX_PICKLE", 1 << 10)
    path = tmp_path / "ckpt.pt"
    torch.save({"names": [f"name {i}" for i in range(200)], "step": 3}, path)
    with pytest.raises(torchzip.TorchFileError, match="more than rtrain reads"):
        torchzip.check(path, full=False)


def test_a_stepless_file_lists_with_the_step_inside(tmp_path):
    torch.save({"iter_num": 120}, tmp_path / "ckpt.pt")
    (c,) = foreign.list_candidates(tmp_path)
    assert c.step == 120
    v = foreign.verify_candidate(c, Level.FULL)
    assert v.ok and v.step == 120 and v.info["step_from"] == "iter_num in the pickle"


def test_content_steps_order_stepless_files_only_among_themselves(tmp_path):
    torch.save({"iter_num": 5}, tmp_path / "b.pt")
    torch.save({"iter_num": 50}, tmp_path / "a.pt")
    os.utime(tmp_path / "a.pt", (1000, 1000))  # older on disk, but further along
    torch.save({"epoch": 1}, tmp_path / "step_400.pt")
    os.utime(tmp_path / "step_400.pt", (500, 500))
    names = [c.path.name for c in foreign.list_candidates(tmp_path)]
    # Both stepless files are newer on disk than step_400.pt: above it, as before; between
    # them the step inside decides.
    assert names == ["a.pt", "b.pt", "step_400.pt"]


# ------------------------------------------------------------ progress.advanced


def M(path: str, fp: str | None, step: int | None = None, ok: bool = True) -> progress.Mark:
    return progress.Mark(path, fp, step, ok)


@pytest.mark.parametrize("before, after, expected", [
    ({}, [M("ckpt.pt", "a", None)], "ckpt.pt"),  # a new file that verifies
    ({"ckpt.pt": M("ckpt.pt", "a")}, [M("ckpt.pt", "a")], None),  # unchanged
    ({"ckpt.pt": M("ckpt.pt", "a")}, [M("ckpt.pt", "b")], "ckpt.pt"),  # new content, no step
    ({"ckpt.pt": M("ckpt.pt", "a", 10)}, [M("ckpt.pt", "b", 10)], None),  # re-saved, same step
    ({"ckpt.pt": M("ckpt.pt", "a", 10)}, [M("ckpt.pt", "b", 15)], "ckpt.pt"),
    ({"ckpt.pt": M("ckpt.pt", "a")}, [M("ckpt.pt", "b", ok=False)], None),  # torn
    ({"ckpt.pt": M("ckpt.pt", "a")}, [M("ckpt.pt", None)], None),  # gone
    ({}, [M("x.pt", "b", ok=False), M("last.ckpt", "c", 4)], "last.ckpt"),
])
def test_advanced(before, after, expected):
    got = progress.advanced(before, after)
    assert (got.path if got else None) == expected


def test_fingerprint_is_the_content_not_the_mtime(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.zeros(3), "iter_num": 1}, path)
    fp = progress.fingerprint(path)
    os.utime(path, (1, 1))
    assert progress.fingerprint(path) == fp
    torch.save({"w": torch.ones(3), "iter_num": 1}, path)
    assert progress.fingerprint(path) != fp
    assert progress.fingerprint(tmp_path / "missing.pt") is None


# ------------------------------------------------------------ decisions given `progressed`


def crash(last_step: int | None = None) -> Failure:
    ev = observed(returncode=-9, signal="SIGKILL", last_step=last_step)
    return Failure(kind=FailureKind.CRASH, reason="killed by SIGKILL", seen=ev)


def run_kills(n: int, *, progressed: bool) -> Decision:
    cfg, history, d = Config(), History(), None
    for _ in range(n):
        d = decide(crash(), history, cfg, rand=0.0, newest_step=None, progressed=progressed)
        if d.action is not Action.RELAUNCH:
            return d
        history = d.history
    return d


def test_kills_without_readable_progress_end_in_a_crash_loop():
    d = run_kills(3, progressed=False)
    assert d.action is Action.GIVE_UP and "crash loop" in d.reason


def test_kills_each_after_new_content_never_give_up():
    d = run_kills(25, progressed=True)
    assert d.action is Action.RELAUNCH
    assert d.history.total_restarts == 0  # each left new content: progress, never charged


def test_content_progress_forgives_only_a_script_that_reports_no_steps():
    cfg = Config()
    charged = History(total_restarts=2, budgets_used={"crash": 2}, charge_step=None,
                      progress_steps=3)  # it reports steps: 3 of the 20 forgive_after_steps
    assert not budgets.made_progress(charged, cfg, None, progressed=True)
    assert budgets.made_progress(History(total_restarts=2), cfg, None, progressed=True)


# ------------------------------------------------------------ the kept copy, in process


def good(path: Path, it: int) -> Path:
    torch.save({"w": torch.full((64,), float(it)), "iter_num": it}, path)
    return path


def test_keep_then_restore_a_torn_file(tmp_path):
    run, ck = tmp_path / "run", tmp_path / "out"
    ck.mkdir()
    live = good(ck / "ckpt.pt", 10)
    v = foreign.verify_path(live, Level.FULL)
    assert keepcopy.wants_copy(v)
    kept = keepcopy.keep(run, v, now=1000.0)
    assert kept is not None and kept.step == 10 and kept.bytes == live.stat().st_size
    assert kept.how in ("reflink", "copy_file_range", "copy")
    assert keepcopy.keep(run, v) is None  # same content: no second copy
    assert keepcopy.load(run) == kept
    assert keepcopy.torn(live, Level.FULL) is None  # never restored over a good file

    live.write_bytes(live.read_bytes()[: live.stat().st_size // 2])
    assert "truncated" in keepcopy.torn(live, Level.QUICK)
    keepcopy.restore(run, kept)
    v = foreign.verify_path(live, Level.FULL)
    assert v.ok and v.step == 10
    assert not list(ck.glob(".*"))  # no temp file left


def test_restore_moves_a_directory_aside(tmp_path):
    run, ck = tmp_path / "run", tmp_path / "out"
    ck.mkdir()
    live = good(ck / "ckpt.pt", 3)
    kept = keepcopy.keep(run, foreign.verify_path(live, Level.FULL))
    live.unlink()
    live.mkdir()
    assert keepcopy.torn(live, Level.FULL) == "a directory where a file was expected"
    keepcopy.restore(run, kept)
    assert foreign.verify_path(live, Level.FULL).ok
    assert [p.name.split("-")[0] for p in ck.iterdir() if p.is_dir()] == [".ckpt.pt.refused"]


def test_a_gone_file_is_not_restored(tmp_path):
    assert keepcopy.torn(tmp_path / "ckpt.pt", Level.FULL) is None


def test_step_named_files_get_no_copy(tmp_path):
    v = foreign.verify_path(good(tmp_path / "step_10.pt", 10), Level.FULL)
    assert v.ok and not keepcopy.wants_copy(v)
