"""`[[hooks]]`, EventLog listeners and the config keys that go with them: real hook commands
(one writes its stdin to a file, one sleeps past its timeout, one fails)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from harness import CHILDREN, launch

from rtrain.supervisor.config import load_config
from rtrain.supervisor.core.errors import ConfigError
from rtrain.supervisor.hooks.hook_spec import HookSpec, parse_hooks
from rtrain.supervisor.hooks.runner import HookRunner
from rtrain.supervisor.proc.proctree import ProcTree
from rtrain.supervisor.records.events import EventLog, read_events

PY = sys.executable
SAVE_STDIN = "import sys; open(sys.argv[1], 'a').write(sys.stdin.read())"


def _wait(runner: HookRunner, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while runner.running and time.monotonic() < deadline:
        runner.poll()
        time.sleep(0.01)
    runner.poll()


# ------------------------------------------------------------------ listeners


def test_listeners_see_each_event_after_it_is_written_and_cannot_break_the_log(tmp_path,
                                                                            caplog):
    seen = []

    def broken(event):
        raise RuntimeError("listener bug")

    def record(event):  # the line is on disk when a listener runs
        seen.append((event["kind"], len(read_events(tmp_path / "events.jsonl"))))

    with EventLog(tmp_path / "events.jsonl", listeners=[broken, record]) as log:
        log.emit("launch", attempt=0)
        log.emit("give_up", reason="r", exit_code=1)
    assert seen == [("launch", 1), ("give_up", 2)]
    assert "listener bug" in caplog.text and "give_up" in caplog.text


# ------------------------------------------------------------------ config


def test_config_keys_parse_and_validate(tmp_path):
    (tmp_path / "rtrain.toml").write_text(
        'metrics_file = "prom/rtrain.prom"\n'
        '[[hooks]]\non = ["give_up", "hang"]\ncommand = ["notify-send", "rtrain"]\n'
        'timeout_s = 3\n')
    cfg = load_config({}, None, tmp_path)
    assert cfg.metrics_file == tmp_path / "prom" / "rtrain.prom"
    assert cfg.hooks == (HookSpec(on=("give_up", "hang"), command=("notify-send", "rtrain"),
                                  timeout_s=3.0),)
    assert load_config({"metrics_file": Path("m.prom")}, None, tmp_path).metrics_file == \
        tmp_path / "m.prom"
    default = load_config({}, None, tmp_path / "nowhere")
    assert default.metrics_file is None and default.hooks == () and default.summary_every_s == 5


@pytest.mark.parametrize("table, message", [
    ({"on": ["give_upp"], "command": ["x"]}, "'give_upp' is not an event or failure kind "
                                             "(did you mean 'give_up'?)"),
    ({"on": [], "command": ["x"]}, "on must list event kinds"),
    ({"on": ["hang"], "command": "notify-send rtrain"}, "command must be a non-empty list"),
    ({"on": ["hang"], "command": ["x"], "timeout_s": 0}, "timeout_s must be a number"),
    ({"on": ["hang"], "command": ["x"], "timeout": 5}, "unknown key 'timeout' in [[hooks]] #1 "
                                                       "(did you mean 'timeout_s'?)"),
    ({"on": ["hook_failed"], "command": ["x"]}, "'hook_failed' is not an event"),
])
def test_bad_hook_tables_say_what_to_change(table, message):
    with pytest.raises(ConfigError) as err:
        parse_hooks([table])
    assert message in str(err.value)


# ------------------------------------------------------------------ the runner


@pytest.mark.slow
def test_matching_events_reach_the_command_on_stdin(tmp_path):
    out = tmp_path / "out.jsonl"
    runner = HookRunner((HookSpec(on=("give_up", "hang"), command=(PY, "-c", SAVE_STDIN,
                                                                   str(out))),), cwd=tmp_path,
                        env={"RTRAIN_RUN_DIR": "/r"})
    runner({"kind": "classification", "failure": "crash", "seq": 1})
    runner({"kind": "degrade", "seq": 2})
    assert runner.running == []
    runner({"kind": "classification", "failure": "hang", "reason": "no heartbeat", "seq": 3})
    runner({"kind": "give_up", "reason": "budget", "seq": 4})
    _wait(runner)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(e["seq"] for e in got) == [3, 4]
    assert {e["kind"] for e in got} == {"classification", "give_up"}


@pytest.mark.slow
def test_timeouts_failures_and_missing_commands_become_hook_failed(tmp_path):
    reported = []
    hooks = (HookSpec(on=("give_up",), command=(PY, "-c", "import time; time.sleep(30)"),
                      timeout_s=0.3),
             HookSpec(on=("give_up",), command=(PY, "-c", "import sys; sys.stderr.write("
                                                "'no display'); sys.exit(3)")),
             HookSpec(on=("give_up",), command=("/nonexistent/notify",)))
    runner = HookRunner(hooks, cwd=tmp_path, report=lambda kind, **f: reported.append(f))
    t0 = time.monotonic()
    runner({"kind": "give_up", "seq": 9})  # never waits for the commands
    assert time.monotonic() - t0 < 0.5
    sleeper = runner.running[0].proc
    _wait(runner)
    assert time.monotonic() - t0 < 5
    by_reason = {f["reason"].split(" ")[0]: f for f in reported}
    assert by_reason["timed"]["reason"] == "timed out after 0.3 s; killed"
    assert by_reason["exited"]["returncode"] == 3 and by_reason["exited"]["stderr"] == \
        "no display"
    assert by_reason["cannot"]["command"] == ["/nonexistent/notify"]
    assert all(f["event"] == "give_up" and f["event_seq"] == 9 for f in reported)
    assert sleeper.returncode == -9


@pytest.mark.slow
def test_hook_processes_are_not_part_of_the_attempts_tree(tmp_path):
    runner = HookRunner((HookSpec(on=("launch",), command=("sleep", "5")),), cwd=tmp_path)
    runner({"kind": "launch"})
    pid = runner.pids()[0]
    assert pid in [p.pid for p in ProcTree().live()]
    assert pid not in [p.pid for p in ProcTree(exclude=runner.pids).live()]
    runner.running[0].deadline = 0
    runner.poll()
    assert runner.pids() == []


# ------------------------------------------------------------------ in rtrain launch


@pytest.mark.slow
def test_launch_runs_hooks_and_records_a_broken_one(tmp_path):
    """give_up and degrade reach a hook; a hook that sleeps past its timeout is killed and
    recorded as hook_failed; neither slows supervision down."""
    out = tmp_path / "hook.jsonl"
    (tmp_path / "rtrain.toml").write_text(
        "[restart.budgets]\ncrash = 1\n"
        "[[hooks]]\non = [\"give_up\", \"degrade\", \"crash\"]\n"
        f"command = {json.dumps([PY, '-c', SAVE_STDIN, str(out)])}\n"
        "[[hooks]]\non = [\"launch\"]\n"
        "command = [\"sleep\", \"30\"]\ntimeout_s = 0.5\n")
    run = tmp_path / "run"
    t0 = time.monotonic()
    r = launch(run, str(CHILDREN / "fail_first_attempts.py"), "9", "5", "1")
    assert r.returncode == 1, r.stderr
    assert time.monotonic() - t0 < 20
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(e["kind"] for e in got) == ["classification", "classification", "give_up"]
    assert all(e["v"] == 1 and "seq" in e for e in got)
    events = read_events(run / "events.jsonl")
    failed = [e for e in events if e["kind"] == "hook_failed"]
    assert len(failed) == 2  # one per launch
    assert all(f["command"] == ["sleep", "30"] and "timed out after 0.5 s" in f["reason"]
               for f in failed)
    # The sleeping hooks were never counted as the attempts' processes nor swept with them.
    assert all(not e.get("leftovers") for e in events if e["kind"] == "exit")
