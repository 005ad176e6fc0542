"""`--metrics-file`: Prometheus text written atomically, read back after and during real runs."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest
import tuned
from harness import CHILDREN, child_env, launch, launch_cmd, read_metrics_text

from rtrain.supervisor.metrics.file import MetricsFile, escape_label


def _with_metrics(base: Path, *args: str) -> list[str]:
    """`rtrain launch` of BASE/run writing BASE/prom/rtrain.prom, as an argv."""
    return launch_cmd(base / "run", "--metrics-file", str(base / "prom" / "rtrain.prom"), *args)


def _values(path: Path, run: Path) -> dict[str, float]:
    """{name or name:kind: value} for this run's series."""
    out = {}
    for (name, labels), value in read_metrics_text(path.read_text()).items():
        labels = dict(labels)
        assert labels.pop("run_dir") == str(run.resolve())
        out[name + (f":{labels['kind']}" if "kind" in labels else "")] = value
    return out


@pytest.mark.slow
def test_after_a_crash_and_a_finish(tmp_path):
    r = launch(tmp_path / "run", "--metrics-file", str(tmp_path / "prom" / "rtrain.prom"),
               str(CHILDREN / "fail_first_attempts.py"), "1", "7")
    assert r.returncode == 0, r.stderr
    prom = tmp_path / "prom" / "rtrain.prom"
    assert _values(prom, tmp_path / "run") == {
        "rtrain_up": 0, "rtrain_attempts_total": 2, "rtrain_failures_total:crash": 1,
        "rtrain_rung": 0, "rtrain_skipped_saves_total": 0, "rtrain_failure_saves_total": 0,
        "rtrain_stragglers_total": 0}
    text = prom.read_text()
    assert "# TYPE rtrain_failures_total counter" in text and text.endswith("\n")
    assert [p.name for p in prom.parent.iterdir()] == ["rtrain.prom"]  # no temp file left


@pytest.mark.slow
def test_live_values_and_no_reader_ever_sees_a_partial_file(tmp_path):
    """Readers poll the file through a whole run (each write is a rename): every read is a
    complete file. While the child runs: up 1, steps move, heartbeat age small."""
    tuned.write(tmp_path, {"summary_every_s": 0.05})
    prom = tmp_path / "prom" / "rtrain.prom"
    proc = subprocess.Popen(_with_metrics(tmp_path, str(CHILDREN / "heartbeat_steps.py"), "150"),
                            cwd=tmp_path, env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    reads, bad, live = [0], [], []

    def reader() -> None:
        while proc.poll() is None:
            try:
                text = prom.read_text()
            except FileNotFoundError:
                continue
            reads[0] += 1
            if not (text.startswith("# HELP rtrain_up") and text.endswith("\n")
                    and "rtrain_rung{" in text):
                bad.append(text)
            else:
                values = _values(prom, tmp_path / "run") if 'up{' in text else {}
                if values.get("rtrain_up") == 1 and "rtrain_last_step" in values:
                    live.append(values)

    thread = threading.Thread(target=reader)
    thread.start()
    _, err = proc.communicate(timeout=60)
    thread.join()
    assert proc.returncode == 0, err
    assert reads[0] > 20 and bad == []
    assert live, "never saw the run live"
    assert max(v["rtrain_last_step"] for v in live) > min(v["rtrain_last_step"] for v in live)
    assert all(v["rtrain_seconds_since_heartbeat"] < 5 for v in live)
    final = _values(prom, tmp_path / "run")
    assert final["rtrain_up"] == 0 and final["rtrain_last_step"] == 150


def test_each_write_is_a_new_file_renamed_into_place(tmp_path):
    now = [1000.0]
    m = MetricsFile(tmp_path / "m.prom", run_dir=tmp_path, ckpt_dir=tmp_path / "ck",
                    wall=lambda: now[0])
    m({"kind": "launch", "attempt": 0, "level": 0, "time": 1000.0})
    first = (tmp_path / "m.prom").stat().st_ino
    m({"kind": "heartbeat_summary", "attempt": 0, "step": 5, "time": 1000.0})
    assert (tmp_path / "m.prom").stat().st_ino != first  # replaced, never rewritten in place
    assert oct((tmp_path / "m.prom").stat().st_mode & 0o777) == "0o644"


def test_ticks_are_throttled_and_ages_move(tmp_path, make_ckpt):
    now = [1000.0]
    ck = tmp_path / "ck"
    m = MetricsFile(tmp_path / "m.prom", run_dir=tmp_path, ckpt_dir=ck, wall=lambda: now[0],
                    every_s=5.0)
    make_ckpt(ck, 20)
    created = float(json.loads((ck / "checkpoint-20" / "manifest.json").read_text())["created"])
    now[0] = created + 10
    m.heartbeat(step=21)
    v = _values(tmp_path / "m.prom", tmp_path)
    assert v["rtrain_last_step"] == 21 and v["rtrain_seconds_since_heartbeat"] == 0
    assert abs(v["rtrain_last_checkpoint_age_seconds"] - 10) < 1e-6
    now[0] += 3
    m.tick()  # under 5 s since the last write: nothing written
    assert _values(tmp_path / "m.prom", tmp_path)["rtrain_seconds_since_heartbeat"] == 0
    now[0] += 3
    m.tick()
    v = _values(tmp_path / "m.prom", tmp_path)
    assert v["rtrain_seconds_since_heartbeat"] == 6
    assert abs(v["rtrain_last_checkpoint_age_seconds"] - 16) < 1e-6


def test_a_failed_write_never_raises(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    m = MetricsFile(blocker / "m.prom", run_dir=tmp_path, ckpt_dir=tmp_path)
    m({"kind": "launch", "attempt": 0, "level": 0})
    assert "cannot write metrics file" in caplog.text


def test_label_values_with_quotes_backslashes_and_newlines_round_trip(tmp_path):
    odd = tmp_path / 'a "run"\\with\nnewline'
    m = MetricsFile(tmp_path / "m.prom", run_dir=odd, ckpt_dir=odd)
    m({"kind": "classification", "attempt": 0, "failure": "oom_gpu"})
    text = (tmp_path / "m.prom").read_text()
    assert escape_label(str(odd.resolve())) in text
    assert all(line.startswith(("# ", "rtrain_")) for line in text.splitlines())
    parsed = read_metrics_text(text)
    assert parsed[("rtrain_failures_total", frozenset({("run_dir", str(odd.resolve())),
                                                      ("kind", "oom_gpu")}))] == 1


@pytest.mark.slow
def test_counters_continue_the_runs_history(tmp_path):
    """A requeued supervisor seeds its counters from events.jsonl before writing."""
    r = launch(tmp_path / "run", "--metrics-file", str(tmp_path / "prom" / "rtrain.prom"),
               str(CHILDREN / "fail_first_attempts.py"), "1", "7")
    assert r.returncode == 0, r.stderr
    r = launch(tmp_path / "run", "--metrics-file", str(tmp_path / "prom" / "rtrain.prom"),
               "--fresh", str(CHILDREN / "fail_first_attempts.py"), "0", "7")
    assert r.returncode == 0, r.stderr
    v = _values(tmp_path / "prom" / "rtrain.prom", tmp_path / "run")
    assert v["rtrain_attempts_total"] == 3 and v["rtrain_failures_total:crash"] == 1
