"""The mirror and the checkpoints saved at a failure in the run's records: `rtrain status`, the
report, the metrics file and the timeline fold read the `mirror_*` and `checkpoint_at_failure`
events (supervisor/records/timeline.py)."""

from __future__ import annotations

from harness import T0, read_metrics_text, write_events

from rtrain.supervisor.commands.status import render_text, summarize, to_json
from rtrain.supervisor.metrics.file import MetricsFile

LAUNCH = {"attempt": 0, "argv": ["python", "train.py"], "settings": {}, "level": 0,
          "resume_from": None, "pid": 1, "ckpt_dir": "checkpoints"}


def _run(tmp_path, make_ckpt, mirror_events):
    run_dir = tmp_path / "run"
    write_events(run_dir, [("launch", LAUNCH), *mirror_events])
    for step in (10, 20, 30):
        make_ckpt(run_dir / "checkpoints", step, created=T0 + step)
    return run_dir


def test_status_shows_lag_the_outage_and_the_final_upload(tmp_path, make_ckpt):
    run_dir = _run(tmp_path, make_ckpt, [
        ("mirror_uploaded", {"step": 10, "bytes": 1, "seconds": 0.1, "files": 2}),
        ("mirror_failed", {"reason": "mirror s3://b/p: cannot write (connection refused)",
                           "step": 20, "retry_in_s": 4.0, "given_up": False}),
    ])
    s = summarize(run_dir, now=T0 + 100)
    assert s.mirror["uploaded_step"] == 10 and s.mirror["behind_steps"] == 20
    text = render_text(s)
    assert "mirror:" in text and "step 10 uploaded" in text and "20 steps behind" in text
    assert "failing: mirror s3://b/p: cannot write (connection refused)" in text

    write_events(run_dir, [
        ("mirror_uploaded", {"step": 30, "bytes": 1, "seconds": 0.1, "files": 2}),
        ("mirror_final", {"step": 30, "made_it": True, "reason": "uploaded"}),
    ])
    s = summarize(run_dir, now=T0 + 100)
    data = to_json(s)["mirror"]
    assert data["behind_steps"] == 0 and data["failing"] is None
    assert data["final"] == {"made_it": True, "step": 30, "reason": "uploaded"}
    assert "up to date" in render_text(s) and "step 30 made it to the mirror" in render_text(s)


def test_status_says_when_the_final_checkpoint_did_not_make_it(tmp_path, make_ckpt):
    run_dir = _run(tmp_path, make_ckpt, [
        ("mirror_final", {"step": 30, "made_it": False,
                          "reason": "not finished after 60 s"}),
    ])
    text = render_text(summarize(run_dir, now=T0 + 100))
    assert "nothing uploaded yet" in text
    assert "step 30 did NOT make it (not finished after 60 s" in text


def test_a_run_without_a_mirror_shows_no_mirror_row(tmp_path, make_ckpt):
    run_dir = _run(tmp_path, make_ckpt, [])
    s = summarize(run_dir, now=T0 + 100)
    assert s.mirror is None and "mirror:" not in render_text(s)


def test_metrics_carry_the_mirror_lag(tmp_path, make_ckpt):
    run_dir = _run(tmp_path, make_ckpt, [])
    now = [T0 + 100]
    m = MetricsFile(tmp_path / "m.prom", run_dir=run_dir, ckpt_dir=run_dir / "checkpoints",
                    wall=lambda: now[0])
    m.write()
    assert "rtrain_mirror" not in (tmp_path / "m.prom").read_text()
    m({"kind": "mirror_uploaded", "time": T0 + 90, "step": 20, "bytes": 1, "seconds": 0.1,
       "files": 2})
    m({"kind": "mirror_failed", "time": T0 + 95, "reason": "x", "step": 30, "retry_in_s": 1.0,
       "given_up": False})
    values = {name: v for (name, _), v in
              read_metrics_text((tmp_path / "m.prom").read_text()).items()}
    assert values["rtrain_mirror_uploaded_step"] == 20
    assert values["rtrain_mirror_lag_steps"] == 10
    assert values["rtrain_mirror_seconds_since_upload"] == 10
    assert values["rtrain_mirror_failures_total"] == 1


def test_the_report_shows_the_mirror(tmp_path, make_ckpt):
    from rtrain.supervisor.commands.report import gather
    from rtrain.supervisor.commands.report_html import render

    run_dir = _run(tmp_path, make_ckpt, [
        ("mirror_uploaded", {"step": 20, "bytes": 1, "seconds": 0.1, "files": 2}),
        ("mirror_final", {"step": 30, "made_it": False, "reason": "not finished after 60 s"}),
    ])
    rep = gather(run_dir, now=T0 + 100)
    assert rep.to_json()["mirror"]["behind_steps"] == 10
    assert ('mirror <b class="mirror">step 20, 10 behind; the final step 30 did not make it'
            in render(rep))


def test_status_and_metrics_count_checkpoints_saved_at_a_failure(tmp_path, make_ckpt):
    run_dir = _run(tmp_path, make_ckpt, [
        ("checkpoint_at_failure", {"attempt": 0, "step": 12, "rank": 0,
                                   "exception": "RuntimeError"}),
    ])
    s = summarize(run_dir, now=T0 + 100)
    assert s.failure_saves == 1 and s.last_failure_save["step"] == 12
    assert ("1 checkpoint(s) saved as the worker failed; the last of step 12 (attempt 0, "
            "RuntimeError)") in render_text(s)
    m = MetricsFile(tmp_path / "m.prom", run_dir=run_dir, ckpt_dir=run_dir / "checkpoints",
                    wall=lambda: T0 + 100)
    m({"kind": "checkpoint_at_failure", "time": T0 + 99, "attempt": 1, "step": 20, "rank": 0,
       "exception": "OutOfMemoryError"})
    values = {name: v for (name, _), v in
              read_metrics_text((tmp_path / "m.prom").read_text()).items()}
    assert values["rtrain_failure_saves_total"] == 1
