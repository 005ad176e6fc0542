"""The retention policy (pure) and prune (applying it on disk)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from harness import checkpoint_steps

from rtrain.checkpoint import commit
from rtrain.checkpoint.layout import host_name, list_checkpoints, list_leftovers
from rtrain.supervisor.retention import prune_dir as prune_mod
from rtrain.supervisor.retention.decide import Candidate, RetentionPolicy, plan


def cands(*specs) -> list[Candidate]:
    """`(step, ok, metrics)` tuples, or bare steps for good checkpoints without metrics."""
    out = []
    for s in specs:
        step, ok, metrics = (s, True, {}) if isinstance(s, int) else s
        out.append(Candidate(step, ok, metrics, f"checkpoint-{step}"))
    return out


def kept(p) -> list[int]:
    return sorted(c.step for c in p.keep)


def test_keeps_newest_n():
    assert kept(plan(cands(1, 2, 3, 4, 5), RetentionPolicy(keep=2))) == [4, 5]


@pytest.mark.parametrize("mode, best", [("min", 2), ("max", 4)])
def test_best_k_ignores_nan_and_non_numbers(mode, best):
    c = cands((1, True, {"loss": float("nan")}), (2, True, {"loss": 0.1}),
              (3, True, {"loss": "nan"}), (4, True, {"loss": 0.9}), (5, True, {"loss": True}),
              (6, True, {}), (7, True, {"loss": 0.5}))
    p = plan(c, RetentionPolicy(keep=1, keep_best=1, metric="loss", mode=mode))
    assert kept(p) == [best, 7]


def test_milestones():
    p = plan(cands(*range(100, 1100, 100)), RetentionPolicy(keep=1, milestone_every=500))
    assert kept(p) == [500, 1000]


def test_newest_verified_is_never_deleted_even_when_an_older_one_is_better():
    c = cands((1, True, {"loss": 0.1}), (2, True, {"loss": 0.9}))
    p = plan(c, RetentionPolicy(keep=1, keep_best=1, metric="loss"))
    assert kept(p) == [1, 2]


def test_protect_set_is_kept():
    assert kept(plan(cands(1, 2, 3), RetentionPolicy(keep=1), frozenset({1}))) == [1, 3]


def test_failed_checkpoints_older_than_newest_good_go_newer_ones_stay():
    c = cands(1, (2, False, {}), 3, (4, False, {}))
    p = plan(c, RetentionPolicy(keep=5))
    assert kept(p) == [1, 3, 4]
    assert [(d.step, why) for d, why in p.delete] == [
        (2, "failed verification and a newer checkpoint verifies")]


def test_only_failed_checkpoints_are_all_kept():
    assert kept(plan(cands((1, False, {}), (2, False, {})), RetentionPolicy(keep=1))) == [1, 2]


@pytest.mark.parametrize("kwargs", [{"keep": 0}, {"keep_best": 2}, {"mode": "median"},
                                    {"milestone_every": -1}])
def test_bad_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        RetentionPolicy(**kwargs)


# --- prune on disk ------------------------------------------------------------------------



def test_prune_removes_by_renaming_out_of_the_way(tmp_path, make_ckpt, monkeypatch):
    for s in (1, 2, 3):
        make_ckpt(tmp_path, s)
    seen_during_delete = []
    real_rmtree = shutil.rmtree

    def spy_rmtree(path, *a, **kw):
        # At the moment the bytes are deleted, no checkpoint-N dir is half there.
        seen_during_delete.append((os.path.basename(path), checkpoint_steps(tmp_path)))
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr(commit.shutil, "rmtree", spy_rmtree)
    report = prune_mod.prune(tmp_path, RetentionPolicy(keep=1))
    assert checkpoint_steps(tmp_path) == [3]
    assert [r.path.name for r in report.removed] == ["checkpoint-2", "checkpoint-1"]
    assert all(r.bytes > 0 for r in report.removed)
    assert [name.startswith(".trash-checkpoint-") for name, _ in seen_during_delete] == [True] * 2
    assert [s for _, s in seen_during_delete] == [[1, 3], [3]]
    assert not list_leftovers(tmp_path)


def test_dry_run_removes_nothing(tmp_path, make_ckpt):
    for s in (1, 2, 3):
        make_ckpt(tmp_path, s)
    dead = tmp_path / f".tmp-checkpoint-4-{host_name()}-{dead_pid()}-abcd1234"
    dead.mkdir()
    before = sorted(os.listdir(tmp_path))
    report = prune_mod.prune(tmp_path, RetentionPolicy(keep=1), dry_run=True)
    assert sorted(os.listdir(tmp_path)) == before
    assert {r.path.name for r in report.removed} == {"checkpoint-1", "checkpoint-2", dead.name}


def dead_pid() -> int:
    """A pid no process has: pids stay below pid_max."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())


def test_prune_removes_abandoned_temp_dir_but_not_a_live_writers(tmp_path, make_ckpt):
    make_ckpt(tmp_path, 1)
    dead = tmp_path / f".tmp-checkpoint-2-{host_name()}-{dead_pid()}-abcd1234"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x" * 10)
    live = tmp_path / f".tmp-checkpoint-3-{host_name()}-{os.getppid()}-abcd1234"
    live.mkdir()
    remote = tmp_path / ".tmp-checkpoint-4-elsewhere-1-abcd1234"
    remote.mkdir()
    trash = tmp_path / ".trash-checkpoint-0-abcd1234"
    trash.mkdir()
    report = prune_mod.prune(tmp_path, RetentionPolicy(keep=1))
    assert {r.path.name: r.reason for r in report.removed} == {
        dead.name: "abandoned temp dir of a save that died",
        trash.name: "interrupted deletion"}
    assert live.exists() and remote.exists() and not dead.exists() and not trash.exists()
    assert checkpoint_steps(tmp_path) == [1]


def test_zero_padded_names_are_not_checkpoints(tmp_path, make_ckpt):
    make_ckpt(tmp_path, 100)
    os.rename(tmp_path / "checkpoint-100", tmp_path / "checkpoint-0100")
    make_ckpt(tmp_path, 100)
    assert [p.name for _, p in list_checkpoints(tmp_path)] == ["checkpoint-100"]


def test_prune_survives_metrics_that_are_not_a_table(tmp_path, make_ckpt):
    make_ckpt(tmp_path, 1, metrics=[1, 2])
    make_ckpt(tmp_path, 2, metrics={"loss": 0.1})
    report = prune_mod.prune(tmp_path, RetentionPolicy(keep=1, keep_best=1, metric="loss"))
    assert [r.path.name for r in report.removed] == ["checkpoint-1"]
