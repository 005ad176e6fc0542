"""4 ranks on CPU (gloo) under `rtrain launch --nproc-per-node 4`: one rank made slower by a
sleep after its optimizer step is named a straggler (event, status, metrics) with its node; ranks
that differ only by noise are not.

Real torchrun, real gloo, real heartbeats: a tiny model, a few dozen short steps, and a short
window in the run's config so that the whole run stays well under a minute.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from harness import CHILDREN, events, launch, read_metrics_text, run_rtrain

CONFIG = "[straggler]\nfactor = 1.2\nwindow_steps = 10\nmin_samples = 3\n"
STEPS = "30"
BASE_SLEEP = "0.1"  # every rank's step: a few ms of compute and this sleep


def _launch_4_ranks(tmp_path: Path, *args: str):
    (tmp_path / "rtrain.toml").write_text(CONFIG)
    run = tmp_path / "run"
    r = launch(run, "--nproc-per-node", "4", "--metrics-file", str(tmp_path / "metrics.prom"),
               str(CHILDREN / "dist_train.py"), str(tmp_path / "out"), STEPS, "--every", "10",
               "--step-sleep", BASE_SLEEP, *args, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.mark.slow
def test_a_rank_30_percent_slower_is_named_within_the_window(tmp_path):
    # Rank 2 sleeps 0.14 s where the others sleep 0.1 s: its step is ~30-40% longer, and the
    # others wait for it at each step boundary.
    run = _launch_4_ranks(tmp_path, "--slow-rank", "2", "--slow-sleep", "0.14")
    found = events(run, "straggler")
    assert [e["rank"] for e in found] == [2], found
    (e,) = found
    assert e["host"] == socket.gethostname()
    assert e["ranks"] == 4 and e["window_steps"] == 10
    assert 1.2 <= e["ratio"] < 2.0, e
    assert e["step"] <= 20, e  # named within the window's reach of the first judgeable steps
    assert "rank 2" in e["detail"] and socket.gethostname() in e["detail"]
    status = run_rtrain("status", str(run))
    assert status.returncode == 0, status.stderr
    assert "straggler" in status.stdout and "rank 2" in status.stdout, status.stdout
    report = run_rtrain("report", str(run), "-o", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "report.html").read_text()
    assert 'class="stragglers"' in page and 'data-rank="2"' in page
    metrics = read_metrics_text((tmp_path / "metrics.prom").read_text())
    assert [v for (name, _), v in metrics.items() if name == "rtrain_stragglers_total"] == [1]
    ((labels, ratio),) = [(dict(lb), v) for (name, lb), v in metrics.items()
                          if name == "rtrain_straggler_ratio"]
    assert labels["rank"] == "2" and labels["host"] == socket.gethostname()
    assert ratio == e["ratio"]


@pytest.mark.slow
def test_ranks_that_differ_by_noise_are_not_reported(tmp_path):
    # Every rank's sleep varies by up to +-30% at random, step by step.
    run = _launch_4_ranks(tmp_path, "--jitter", "0.3")
    assert events(run, "straggler") == []
    assert events(run, "finished")
