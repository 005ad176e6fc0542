"""`rtrain status`: a run dir built by hand (EventLog, save_state, real checkpoints), read back
by summarize / render_text / to_json, and through the CLI as a user runs it."""

from __future__ import annotations

import json
import os

import pytest
from harness import T0, run_rtrain, write_events

from rtrain.supervisor.commands.status import render_text, summarize, to_json
from rtrain.supervisor.core.errors import ConfigError, UsageError
from rtrain.supervisor.decide.policy import History
from rtrain.supervisor.records.lock import LOCK_NAME
from rtrain.supervisor.records.paths import default_ckpt_dir, default_run_dir
from rtrain.supervisor.records.runstate import RunState, save_state

GIB = 1024**3

@pytest.fixture
def run(tmp_path, make_ckpt):
    """Attempt 0 ran out of GPU memory, attempt 1 crashed, attempt 2 is running on rung 1."""
    run_dir = tmp_path / "run"
    small = {"batch_size": 16, "grad_accum": 2}
    launch = {"argv": ["python", "train.py"], "resume_from": None, "pid": 100}
    beat = {"samples_per_s": 812.5, "rss_bytes": 3 * GIB,
            "gpu_used": 20 * GIB, "gpu_total": 80 * GIB}
    write_events(run_dir, [
        ("launch", {**launch, "attempt": 0, "settings": {"batch_size": 32, "grad_accum": 1},
                    "level": 0}),
        ("heartbeat_summary", {**beat, "attempt": 0, "step": 50, "loss": 2.5}),
        ("exit", {"attempt": 0, "returncode": 1, "signal": None, "duration_s": 60.0,
                  "last_step": 60}),
        ("classification", {"attempt": 0, "failure": "oom_gpu", "reason": "CUDA out of memory"}),
        ("decision", {"attempt": 0, "action": "relaunch", "reason": "one rung down",
                      "backoff_s": 1.0, "level": 1, "settings": small, "exit_code": None}),
        ("degrade", {"attempt": 0, "change": "batch_size 32 -> 16", "level": 1,
                     "settings": small}),
        ("launch", {**launch, "attempt": 1, "settings": small, "level": 1}),
        ("exit", {"attempt": 1, "returncode": 139, "signal": "SIGSEGV", "duration_s": 5.0,
                  "last_step": None}),
        ("classification", {"attempt": 1, "failure": "crash", "reason": "segfault"}),
        ("decision", {"attempt": 1, "action": "relaunch", "reason": "crash budget 1/3",
                      "backoff_s": 2.0, "level": 1, "settings": small, "exit_code": None}),
        ("launch", {**launch, "attempt": 2, "settings": small, "level": 1}),
        ("heartbeat_summary", {**beat, "attempt": 2, "step": 250, "loss": 0.4321}),
    ])
    history = History(attempt=3, total_restarts=2, budgets_used={"oom": 1, "crash": 1},
                      level=1, settings=small)
    save_state(run_dir, RunState(command=["python", "train.py"], history=history,
                                 reason="crash budget 1/3"))
    for step in (100, 200, 300):
        make_ckpt(run_dir / "checkpoints", step)
    (run_dir / "checkpoints" / "checkpoint-300" / "state.json").unlink()
    return run_dir


def test_summary_reads_every_file(run):
    s = summarize(run, now=T0 + 21)
    assert (s.status, s.attempts, s.attempt) == ("running", 3, 2)
    assert s.failures == {"oom_gpu": 1, "crash": 1}
    assert s.budgets_used == {"oom": 1, "crash": 1}
    assert (s.level, s.settings) == (1, {"batch_size": 16, "grad_accum": 2})
    assert (s.checkpoint_step, s.checkpoint.name) == (200, "checkpoint-200")
    assert s.bad_checkpoints == [("checkpoint-300", "corrupt: file 'state.json' is missing")]
    assert (s.step, s.loss, s.samples_per_s) == (250, 0.4321, 812.5)
    assert s.heartbeat_age_s == pytest.approx(10.0)  # the summary was event 12, at T0 + 11
    assert s.last_failure == {"attempt": 1, "kind": "crash", "reason": "segfault"}
    assert s.last_decision["action"] == "relaunch" and s.last_decision["backoff_s"] == 2.0


def test_text_names_what_a_person_asks_first(run):
    text = render_text(summarize(run, now=T0 + 21))
    first = text.splitlines()[0]
    assert first == f"run {run}: running, attempt 2"
    assert "no rtrain holds it; run the same rtrain launch again" in text
    assert "step 250, loss 0.4321, 812 samples/s, as of 10s ago" in text
    assert "rss 3.0 GiB, gpu 20.0 GiB / 80.0 GiB" in text
    assert "1 (batch_size=16 grad_accum=2)" in text
    assert "checkpoint-200 (verified quick)" in text
    assert "checkpoint-300 skipped: corrupt: file 'state.json' is missing" in text
    assert "3 launched; failures: oom_gpu 1, crash 1" in text
    assert "attempt 1: relaunch: crash budget 1/3 (backoff 2 s)" in text


def test_json_is_plain_data(run):
    out = json.loads(json.dumps(to_json(summarize(run, now=T0 + 21))))
    assert out["checkpoint"].endswith("checkpoint-200") and out["checkpoint_step"] == 200
    assert out["bad_checkpoints"][0]["name"] == "checkpoint-300"
    assert out["failures"] == {"oom_gpu": 1, "crash": 1}
    assert out["stale"].startswith("no rtrain holds it")


def test_live_and_dead_supervisor(run):
    (run / LOCK_NAME).write_text(json.dumps({"pid": os.getpid()}))
    s = summarize(run)
    assert (s.supervisor_pid, s.supervisor_alive) == (os.getpid(), True)
    assert "warning" not in render_text(s) and f"(rtrain pid {os.getpid()})" in render_text(s)
    (run / LOCK_NAME).write_text(json.dumps({"pid": 999_999_999}))
    assert "its rtrain (pid 999999999) is gone" in render_text(summarize(run))


def test_last_step_from_exit_when_newer_and_torn_line(tmp_path):
    write_events(tmp_path, [
        ("launch", {"attempt": 0, "settings": {}, "level": 0}),
        ("heartbeat_summary", {"attempt": 0, "step": 10, "loss": 1.0}),
        ("exit", {"attempt": 0, "returncode": 0, "signal": None, "last_step": 17}),
        ("finished", {"reason": "training finished (exit 0)"}),
    ])
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write('{"v":1,"seq":5,"kind":"heartbeat_su')  # killed mid-write
    s = summarize(tmp_path)  # no state.json: status from the events
    assert (s.status, s.reason, s.step) == ("finished", "training finished (exit 0)", 17)
    assert s.checkpoint is None and "none verified in" in render_text(s)


def test_ckpt_dir_from_the_first_launch(tmp_path, make_ckpt):
    write_events(tmp_path, [("launch", {"attempt": 0, "ckpt_dir": "elsewhere"}),
                            ("give_up", {"reason": "ladder floor", "exit_code": 1})])
    make_ckpt(tmp_path / "elsewhere", 5)
    s = summarize(tmp_path)
    assert (s.status, s.checkpoint_step) == ("gave_up", 5)


def test_missing_run_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match=r"no rtrain run in .*: pass the --run-dir"):
        summarize(tmp_path / "nope")
    with pytest.raises(UsageError):
        summarize(tmp_path)  # a directory, but nothing rtrain wrote


# --- the CLI --------------------------------------------------------------------------------

def test_cli_text_and_json(rtrain, run):
    r = rtrain("status", str(run))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"run {run}: running") and "checkpoint-200" in r.stdout
    r = rtrain("status", str(run), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["attempts"] == 3


def test_cli_default_run_dir_from_rtrain_toml(rtrain, run, tmp_path):
    (tmp_path / "rtrain.toml").write_text('run_dir = "run"\n')
    r = rtrain("status", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["run_dir"] == str(run)


def test_cli_missing_run_exits_2(rtrain, tmp_path):
    r = rtrain("status", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == (f"rtrain: error: no rtrain run in {tmp_path / 'rtrain-run'}: "
                                "pass the --run-dir used with rtrain launch")


@pytest.mark.slow
def test_status_imports_no_torch_or_rich(run):
    r = run_rtrain("status", str(run), env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert r.returncode == 0
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines() if "|" in ln}
    assert "rtrain.supervisor.commands.status" in imported  # the trace works
    assert not {m for m in imported if m.split(".")[0] in ("torch", "pydantic", "rich")}


def test_default_run_dir_lookup(tmp_path):
    assert default_run_dir(tmp_path) == tmp_path / "rtrain-run"
    (tmp_path / "pyproject.toml").write_text('[tool.rtrain]\nrun_dir = "runs/b"\n')
    assert default_run_dir(tmp_path) == tmp_path / "runs/b"
    (tmp_path / "rtrain.toml").write_text('[rtrain]\nrun_dir = "runs/a"\n')
    assert default_run_dir(tmp_path) == tmp_path / "runs/a"  # rtrain.toml first
    assert default_ckpt_dir(tmp_path) == tmp_path / "runs/a/checkpoints"
    (tmp_path / "rtrain.toml").write_text("run_dir = 3\n")
    with pytest.raises(ConfigError, match=r"rtrain\.toml: run_dir must be a non-empty string"):
        default_run_dir(tmp_path)


def test_status_shows_the_standby_and_its_memory(tmp_path):
    run_dir = tmp_path / "run"
    launch = {"argv": ["python", "train.py"], "resume_from": None, "settings": {}, "level": 0}
    write_events(run_dir, [
        ("launch", {**launch, "attempt": 0, "pid": 100, "standby": False}),
        ("standby_ready", {"attempt": 0, "pid": 101, "rss_bytes": 300 * 2**20,
                           "modules": ["torch", "torch._dynamo"], "import_s": 3.1}),
        ("launch", {**launch, "attempt": 1, "pid": 101, "standby": True}),
        ("standby_ready", {"attempt": 1, "pid": 102, "rss_bytes": 310 * 2**20,
                           "modules": ["torch"], "import_s": 3.0}),
    ])
    s = summarize(run_dir, now=T0 + 10)
    assert s.standby == {"state": "ready", "warm_starts": 1, "pid": 102,
                         "rss_bytes": 310 * 2**20, "modules": ["torch"]}
    [row] = [line for line in render_text(s).splitlines() if "standby:" in line]
    assert row.split(None, 1)[1] == ("ready (pid 102, rss 310.0 MiB; imported torch); "
                                     "1 attempt(s) started warm")
    write_events(run_dir, [("standby_discarded", {"attempt": 1, "pid": 102,
                                                  "reason": "host memory is tight"})])
    text = render_text(summarize(run_dir, now=T0 + 10))
    assert "discarded: host memory is tight; 1 attempt(s) started warm" in text
