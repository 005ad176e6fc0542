"""Saves that fail are not invisible: the worker reports each skipped save, the supervisor
records it (`save_skipped`), counts it in `rtrain status`, the report and the metrics file, and
warns (a final line and a `final_state_unsaved` event) when the run ends with its final state in
no checkpoint. Real runs of children/chaos_train.py with the checkpoint dir on a small
tmpfs that fills up, and on a tmpfs remounted read-only (which fails even for root)."""

from __future__ import annotations

import os
import time

import pytest
from chaos_util import launch_chaos, write_config
from conftest import remount_read_only
from harness import CHILDREN, events, launch, read_metrics_text

from rtrain.supervisor.proc.heartbeat import HeartbeatReceiver

TRAIN = {"steps": 16, "save_every": 2}


def _status(rtrain, run):
    return rtrain("status", str(run))


def _skipped_metric(prom):
    return {name: v for (name, _), v in read_metrics_text(prom.read_text()).items()}[
        "rtrain_skipped_saves_total"]


@pytest.mark.slow
def test_full_disk_skips_are_recorded_counted_and_warned(tmp_path, small_tmpfs, rtrain):
    disk = small_tmpfs("8m")
    ckpts = disk / "checkpoints"
    # Saves at steps 2, 4, 6 fit; the script fills the disk at step 7, so 8..16 cannot.
    settings = {**TRAIN, "fill_at": 7, "fill_path": str(disk / "filler")}
    prom = tmp_path / "rtrain.prom"
    write_config(tmp_path / "rtrain.toml", settings, metrics_file=str(prom))
    run = tmp_path / "run"
    r = launch_chaos(run, "--ckpt-dir", str(ckpts))
    assert r.returncode == 0, r.stderr[-3000:]

    skipped = events(run, "save_skipped")
    assert [e["step"] for e in skipped][:5] == [8, 10, 12, 14, 16]
    assert all("MiB free" in e["reason"] and e["attempt"] == 0 for e in skipped)
    [unsaved] = events(run, "final_state_unsaved")
    assert unsaved["last_step"] == 16 and unsaved["checkpoint_step"] == 6
    assert unsaved["skipped_saves"] == len(skipped)
    kinds = [e["kind"] for e in events(run)]
    assert kinds.index("final_state_unsaved") < kinds.index("finished")
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("rtrain: warning: the final state (step 16) was not saved: the "
                           "newest checkpoint is at step 6"), r.stderr[-2000:]

    status = _status(rtrain, run)
    assert status.returncode == 0, status.stderr
    assert "saves:" in status.stdout and f"{len(skipped)} skipped; the last at step 16" \
        in status.stdout, status.stdout
    assert "checkpoint-6 (verified quick), committed" in status.stdout
    assert "warning:" in status.stdout and "final state (step 16) was not saved" \
        in status.stdout
    as_json = rtrain("status", str(run), "--json")
    assert f'"skipped_saves": {len(skipped)}' in as_json.stdout
    assert '"checkpoint_age_s": ' in as_json.stdout and '"checkpoint_age_s": null' \
        not in as_json.stdout

    report = rtrain("report", str(run))
    assert report.returncode == 0, report.stderr
    html = (run / "report.html").read_text()
    assert f'<b class="skipped-saves">{len(skipped)}</b>' in html
    assert 'class="warning">warning: the final state (step 16) was not saved' in html
    assert _skipped_metric(prom) == len(skipped)


@pytest.fixture
def read_only_dir(small_tmpfs):
    """A checkpoint dir on a tmpfs remounted read-only: writing fails with EROFS, for root too."""
    disk = small_tmpfs("4m")
    (disk / "checkpoints").mkdir()
    remount_read_only(disk)
    return disk / "checkpoints"


@pytest.mark.slow
def test_read_only_checkpoint_dir_every_save_recorded_and_no_checkpoint_warned(
        tmp_path, read_only_dir, rtrain):
    prom = tmp_path / "rtrain.prom"
    write_config(tmp_path / "rtrain.toml", TRAIN, metrics_file=str(prom))
    run = tmp_path / "run"
    r = launch_chaos(run, "--ckpt-dir", str(read_only_dir))
    assert r.returncode == 0, r.stderr[-3000:]

    skipped = events(run, "save_skipped")
    assert [e["step"] for e in skipped][:8] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert all("Read-only file system" in e["reason"] for e in skipped), skipped[0]
    [unsaved] = events(run, "final_state_unsaved")
    assert unsaved["checkpoint_step"] is None and unsaved["last_step"] == 16
    assert "there is no checkpoint" in r.stderr.strip().splitlines()[-1]
    status = _status(rtrain, run)
    assert f"{len(skipped)} skipped" in status.stdout and "none verified" in status.stdout
    assert _skipped_metric(prom) == len(skipped)


@pytest.mark.slow
def test_saves_that_succeed_give_no_warning(tmp_path, rtrain):
    write_config(tmp_path / "rtrain.toml", TRAIN)
    run = tmp_path / "run"
    r = launch_chaos(run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not events(run, "save_skipped") and not events(run, "final_state_unsaved")
    assert "warning" not in r.stderr
    status = _status(rtrain, run)
    assert "saves:" not in status.stdout and "warning" not in status.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "fork", "thread"])
def test_worker_reports_each_skipped_save_to_the_supervisor(read_only_dir, monkeypatch, mode):
    """The heartbeat the launch loop turns into `save_skipped`, from each writer: in the
    training process, in a forked writer process, in a writer thread."""
    import torch

    import rtrain

    with HeartbeatReceiver() as receiver:
        monkeypatch.setenv("RTRAIN_HEARTBEAT", receiver.name)
        # As under rtrain: the attempt's token proves the forked writer the attempt's own,
        # though it exited before its heartbeat was read.
        monkeypatch.setenv("RTRAIN_CONTROL_TOKEN", "7" * 32)
        receiver.attempt(os.getpid(), "7" * 32)
        ck = rtrain.Checkpointer(model=torch.nn.Linear(4, 4), ckpt_dir=read_only_dir,
                                 saving=rtrain.Saving(async_mode="off" if mode == "sync"
                                                      else mode))
        ck.save(3)
        ck.close()
        assert ck.skipped_saves == 1
        deadline, got = time.monotonic() + 5, []
        while time.monotonic() < deadline and not got:
            got = [hb for hb in receiver.drain() if hb.event == "save_skipped"]
            time.sleep(0.02)
        time.sleep(0.3)  # a second report (one per writer, say) would be here by now
        got += [hb for hb in receiver.drain() if hb.event == "save_skipped"]
    assert len(got) == 1, got
    assert got[0].step == 3 and got[0].reason == "Read-only file system"


@pytest.mark.slow
@pytest.mark.soak  # skipped saves reported end to end: the one-process tests of this file
def test_distributed_skipped_saves_are_reported_once_by_rank_0(tmp_path, read_only_dir):
    """Two ranks (gloo) saving collectively into a read-only dir: one event per save."""
    run = tmp_path / "run"
    r = launch(run, "--nproc-per-node", "2", "--ckpt-dir", str(read_only_dir),
                       str(CHILDREN / "dist_train.py"), str(tmp_path / "out"), "6", timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    skipped = events(run, "save_skipped")
    assert [(e["step"], e["rank"]) for e in skipped] == [(3, 0), (6, 0)], skipped
    assert all(e["reason"] == "Read-only file system" for e in skipped)
    [unsaved] = events(run, "final_state_unsaved")
    assert unsaved["checkpoint_step"] is None and unsaved["skipped_saves"] == 2
