"""`rtrain report`: a real supervised run (a crash, an out-of-memory with a degradation, real
checkpoints) rendered to HTML and opened in headless Chromium."""

from __future__ import annotations

import html.parser
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tuned
from harness import CHILDREN, launch

from rtrain.supervisor.commands.report import gather
from rtrain.supervisor.commands.report_html import write_report
from rtrain.supervisor.records.events import EventLog

DEMO = CHILDREN / "report_demo.py"
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium"
                                        if os.path.exists("/usr/bin/chromium") else None)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """120 steps, checkpoint every 20; attempt 0 crashes at 50, attempt 1 runs out of memory
    at 90 (degrade), attempt 2 finishes."""
    base = tmp_path_factory.mktemp("report")
    (base / "rtrain.toml").write_text("[settings]\nbatch_size = 32\ngrad_accum = 1\n")
    tuned.write(base, {"summary_every_s": 0.1})
    run = base / "run"
    r = launch(run, str(DEMO), "120", "0.02", "20", "50", "90", timeout=90)
    assert r.returncode == 0, r.stderr
    return run


@pytest.mark.slow
def test_gather_reads_attempts_failures_degrade_and_checkpoints(demo_run):
    rep = gather(demo_run)
    assert rep.status == "finished"
    assert [a.outcome for a in rep.attempts] == ["crash", "oom_gpu", "finished"]
    assert [a.resume_from for a in rep.attempts] == [None, "checkpoint-40", "checkpoint-80"]
    assert rep.attempts[2].settings == {"batch_size": 16, "grad_accum": 2}
    assert all(a.duration_s and a.duration_s > 0 for a in rep.attempts)
    # A failure is marked at the last step a heartbeat reported; heartbeats are throttled to
    # one per 0.2 s, so on a busy machine that can be a few steps before the failure itself.
    failures = [(m.label, m.step) for m in rep.markers if m.kind == "failure"]
    assert [label for label, _ in failures] == ["crash", "oom_gpu"]
    assert 40 < failures[0][1] <= 50 and 80 < failures[1][1] <= 90
    degrade = [m for m in rep.markers if m.kind == "degrade"]
    assert len(degrade) == 1 and degrade[0].step == failures[1][1]
    assert "batch_size 32 -> 16" in degrade[0].detail
    ckpts = sorted(m.step for m in rep.markers if m.kind == "checkpoint")
    assert ckpts == [20, 40, 60, 80, 100, 120]
    assert all(m.time for m in rep.markers if m.kind == "checkpoint")
    # Each failure's cost: a script without Checkpointer.restore measures no restore; the
    # steps since checkpoint-40 and checkpoint-80 were run again.
    costs = {c.kind: c for c in rep.failure_costs}
    assert sorted(costs) == ["crash", "oom_gpu"] and all(c.count == 1 for c in costs.values())
    for c, failed_at in ((costs["crash"], failures[0][1]), (costs["oom_gpu"], failures[1][1])):
        assert c.phases["restore"] is None and c.phases["imports"][0] > 0
        assert c.steps_lost == failed_at - failed_at // 20 * 20 and c.lost_s > 0
    for attempt in (0, 1, 2):
        pts = [p for p in rep.points if p.attempt == attempt]
        assert len(pts) >= 2, attempt
        assert all(p.loss is not None for p in pts)
        assert any(p.samples_per_s for p in pts)


class _Dom(html.parser.HTMLParser):
    """Collects the attributes of every element, by tag."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def find(self, tag: str, cls: str) -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == tag and cls in a.get("class", "").split()]


def _chromium(page: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
         *args, page.as_uri()],
        capture_output=True, text=True, timeout=90)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y "
                                             "chromium; scripts/test.sh does it as root)")
def test_report_renders_curves_and_markers_in_chromium(demo_run, tmp_path):
    page = write_report(demo_run, tmp_path / "report.html")
    r = _chromium(page, tmp_path, "--dump-dom", "--window-size=1200,900")
    assert r.returncode == 0, r.stderr[-2000:]
    dom = _Dom()
    dom.feed(r.stdout)
    charts = dom.find("svg", "chart")
    assert [c["data-field"] for c in charts] == ["loss", "samples_per_s"]
    curves = dom.find("path", "curve")
    # Three attempts, drawn in both charts, each a line through several points.
    assert sorted(c["data-attempt"] for c in curves) == ["0", "0", "1", "1", "2", "2"]
    assert all(int(c["data-points"]) >= 2 and c["d"].count("L") >= 1 for c in curves)
    failures = dom.find("g", "marker-failure")
    assert sorted(m["data-failure"] for m in failures) == ["crash", "crash", "oom_gpu",
                                                          "oom_gpu"]
    assert len(dom.find("g", "marker-degrade")) == 2
    assert len(dom.find("g", "marker-checkpoint")) == 12
    # Attempts: header + 3; time lost to failures: header + one row per kind.
    costs = [a["data-failure"] for t, a in dom.tags if t == "tr" and "data-failure" in a]
    assert sorted(costs) == ["crash", "oom_gpu"]
    assert len([t for t, a in dom.tags if t == "tr"]) == 1 + 3 + 1 + 2

    png = tmp_path / "report.png"
    r = _chromium(page, tmp_path, f"--screenshot={png}", "--window-size=1200,900")
    assert r.returncode == 0, r.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


@pytest.mark.slow
def test_report_is_self_contained(demo_run, tmp_path):
    text = write_report(demo_run, tmp_path / "r.html").read_text()
    assert "<link" not in text and " src=" not in text and "@import" not in text
    assert "url(" not in text
    # The only URL is the SVG namespace, which is a name, never fetched.
    assert set(re.findall(r"https?://[^\s\"']+", text)) == {"http://www.w3.org/2000/svg"}


def test_hand_built_run_escapes_text_and_says_what_is_missing(tmp_path):
    run = tmp_path / "run"
    with EventLog(run / "events.jsonl") as log:
        log.emit("launch", attempt=0, argv=["x"], settings={}, level=0, resume_from=None,
                 pid=1)
        log.emit("exit", attempt=0, returncode=1, signal=None, duration_s=2.5, last_step=None)
        log.emit("classification", attempt=0, failure="startup",
                 reason="</script><b>SyntaxError</b>")
        log.emit("skipped_checkpoint", path=str(run / "checkpoints" / "checkpoint-7"),
                 reason="model.safetensors: size 3, manifest says 9")
        log.emit("give_up", reason="start-up failure", exit_code=3)
    rep = gather(run)
    assert [m.kind for m in rep.markers] == ["failure", "bad_checkpoint"]
    assert rep.markers[1].step == 7
    text = write_report(run, tmp_path / "r.html").read_text()
    assert "</script><b>" not in text  # neither in the table nor in the embedded JSON
    assert "&lt;/script&gt;&lt;b&gt;SyntaxError" in text
    assert "no loss reported" in text  # the chart explains an empty plot


@pytest.mark.slow
def test_cli_report_writes_the_file_and_refuses_a_non_run(rtrain, demo_run, tmp_path):
    out = tmp_path / "x" / "page.html"
    r = rtrain("report", str(demo_run), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote {out}" and out.read_text().startswith("<!DOCTYPE html>")
    r = rtrain("report", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "no rtrain run" in r.stderr
