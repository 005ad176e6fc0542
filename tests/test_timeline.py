"""timeline.Timeline: events.jsonl folded once; status, report and metrics read the same fold."""

from __future__ import annotations

from harness import read_metrics_text

from rtrain.supervisor.commands.report import gather
from rtrain.supervisor.commands.status import summarize
from rtrain.supervisor.core.event_schema import Kind
from rtrain.supervisor.metrics.file import MetricsFile
from rtrain.supervisor.records.events import EventLog, read_events
from rtrain.supervisor.records.timeline import Timeline, read_timeline

SMALL = {"batch_size": 16}


def write(run_dir, events):
    clock = iter(1000.0 + i for i in range(1000))
    with EventLog(run_dir / "events.jsonl", clock=lambda: next(clock)) as log:
        for kind, fields in events:
            log.emit(kind, **fields)


RUN = [
    ("launch", {"attempt": 0, "settings": {"batch_size": 32}, "level": 0, "resume_from": None}),
    ("heartbeat_summary", {"attempt": 0, "step": 40, "loss": 1.0}),
    ("save_skipped", {"attempt": 0, "step": 40, "rank": 0, "reason": "no space"}),
    ("exit", {"attempt": 0, "returncode": 1, "last_step": 45}),
    ("classification", {"attempt": 0, "failure": "oom_gpu", "reason": "CUDA out of memory"}),
    ("decision", {"attempt": 0, "action": "relaunch", "level": 1, "settings": SMALL}),
    ("degrade", {"attempt": 0, "change": "batch_size 32 -> 16", "level": 1, "settings": SMALL}),
    ("launch", {"attempt": 1, "settings": SMALL, "level": 1, "resume_from": None}),
    ("heartbeat_summary", {"attempt": 1, "step": 10, "loss": 0.5}),
    ("exit", {"attempt": 1, "returncode": 0, "last_step": 12}),
    ("decision", {"attempt": 1, "action": "finished", "level": 1, "settings": SMALL}),
    ("final_state_unsaved", {"last_step": 12, "checkpoint_step": None, "skipped_saves": 1,
                             "reason": "the final state (step 12) was not saved"}),
    ("finished", {"reason": "exit 0"}),
]


def test_fold_rules(tmp_path):
    write(tmp_path, RUN)
    t = read_timeline(tmp_path / "events.jsonl", keep_curve=True)
    assert t.launches == 2 and sorted(t.attempts) == [0, 1]
    assert t.attempts[0].failure == "oom_gpu" and t.attempts[0].last_step == 45
    assert t.attempts[1].failure is None and t.attempts[1].decision["action"] == "finished"
    assert dict(t.failures) == {"oom_gpu": 1}
    assert (t.level, t.settings) == (1, SMALL)
    assert t.step == 12 and t.step_event["kind"] == "exit"
    assert t.saves.count == 1 and t.saves.last_step == 40
    assert t.saves.unsaved == "the final state (step 12) was not saved"
    assert t.last(Kind.GIVE_UP, Kind.FINISHED)["kind"] == "finished"
    assert [(n.event["kind"], n.attempt, n.step) for n in t.notes] == \
        [("classification", 0, 45), ("degrade", 0, 45)]
    assert [p["step"] for p in t.points] == [40, 10]


def test_a_later_launch_clears_the_unsaved_warning_and_restarts_its_number():
    t = Timeline()
    for event in [{"kind": "launch", "attempt": 0},
                  {"kind": "exit", "attempt": 0, "last_step": 5},
                  {"kind": "final_state_unsaved", "reason": "lost"},
                  {"kind": "launch", "attempt": 0}]:  # --fresh numbers from 0 again
        t.add(event)
    assert t.saves.unsaved is None
    assert t.launches == 2 and t.attempts[0].exit is None and t.attempts[0].last_step is None
    assert t.step == 5  # the run's newest step stays


def test_status_report_and_metrics_agree(tmp_path):
    run = tmp_path / "run"
    write(run, RUN)
    status = summarize(run, now=2000.0)
    report = gather(run, now=2000.0)
    metrics = MetricsFile(tmp_path / "m.prom", run_dir=run, ckpt_dir=run / "checkpoints",
                          wall=lambda: 2000.0)
    for event in read_events(run / "events.jsonl"):
        metrics.seed(event)
    metrics.write()
    parsed = read_metrics_text((tmp_path / "m.prom").read_text())
    prom = {name: v for (name, labels), v in parsed.items() if name != "rtrain_failures_total"}
    fails = {dict(labels)["kind"]: v for (name, labels), v in parsed.items()
             if name == "rtrain_failures_total"}
    assert status.attempts == len(report.attempts) == prom["rtrain_attempts_total"] == 2
    assert status.failures == report.failures == fails == {"oom_gpu": 1}
    assert status.level == prom["rtrain_rung"] == 1
    assert status.step == prom["rtrain_last_step"] == 12
    assert status.skipped_saves == report.skipped_saves == prom["rtrain_skipped_saves_total"]
    assert status.unsaved == report.warning != ""
    assert [r.outcome for r in report.attempts] == ["oom_gpu", "finished"]
