"""Bad configuration values through the real CLI: nan and infinity anywhere, stop signals that
cannot be caught or that arrive for other reasons, sample intervals too short to watch, a
read-only run dir. Each is one `rtrain: error:` line and exit 2, before anything runs. And run
dirs written before such values were refused still report."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import remount_read_only
from harness import CHILDREN

SCRIPT = str(CHILDREN / "heartbeat_steps.py")


def _one_line_usage_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rtrain: error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("toml, needle", [
    ("grace_s = nan", "grace_s must be a finite number (got nan)"),
    ("grace_s = inf", "grace_s must be a finite number (got inf)"),
    ("[hang]\ntimeout_s = nan", "[hang] timeout_s must be a finite number"),
    ("[settings]\nlr = nan", "[settings] lr must be a finite number"),
    ("[settings]\nsizes = [1, inf]", "[settings] sizes[1] must be a finite number"),
    ('[[ladder]]\nknob = "batch_size"\nfloor = nan', "floor must be a finite number"),
    ('[[hooks]]\non = ["give_up"]\ncommand = ["true"]\ntimeout_s = nan',
     "timeout_s must be a number of seconds above 0 (finite)"),
    ('stop_signal = "SIGKILL"', "stop_signal SIGKILL cannot be caught"),
    ('stop_signal = "stop"', "stop_signal SIGSTOP cannot be caught"),
    ('stop_signal = "SIGCHLD"', "stop_signal SIGCHLD is not a request to end"),
    ('stop_signal = "cont"', "stop_signal SIGCONT is not a request to end"),
    ('stop_signal = "SIGWINCH"', "stop_signal SIGWINCH is not a request to end"),
    ('stop_signal = "SIGURG"', "stop_signal SIGURG is the signal with which rtrain asks"),
    ('stop_signal = "SIGUSR2"', "stop_signal SIGUSR2 is the signal on which rtrain has the "
                                "worker dump its stacks"),
    ('stop_signal = "SIGSEGV"', "use one of SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1"),
    ("sample_interval_s = 0.1", "sample_interval_s is not a setting: rtrain holds it at 1.0"),
    ('file_mode = "0606"', "lets every user write"),
    ('file_mode = "0755"', "read/write bits only"),
    ('file_mode = "rw"', "octal mode"),
])
def test_bad_value_in_the_config_file(tmp_path, rtrain, toml, needle):
    (tmp_path / "rtrain.toml").write_text(toml + "\n")
    r = rtrain("launch", SCRIPT, cwd=tmp_path)
    _one_line_usage_error(r, "rtrain.toml: ", needle)
    assert not (tmp_path / "rtrain-run").exists(), "something ran"


@pytest.mark.parametrize("args, needle", [
    (["--set", "batch_size=1e400"], "[settings] batch_size must be a finite number (got inf)"),
    (["--set", "lr=NaN"], "[settings] lr must be a finite number (got nan)"),
    (["--set", "lr=-Infinity"], "[settings] lr must be a finite number (got -inf)"),
    (["--grace", "nan"], "grace_s must be a finite number"),
    (["--hang-timeout", "inf"], "[hang] timeout_s must be a finite number"),
    (["--stop-signal", "KILL"], "stop_signal SIGKILL cannot be caught"),
    (["--stop-signal", "SIGCHLD"], "stop_signal SIGCHLD is not a request to end"),
])
def test_bad_value_on_the_command_line(tmp_path, rtrain, args, needle):
    r = rtrain("launch", *args, SCRIPT, cwd=tmp_path)
    _one_line_usage_error(r, "command line: ", needle)
    assert not (tmp_path / "rtrain-run").exists(), "something ran"


def test_good_values_still_pass(tmp_path):
    from rtrain.supervisor.config import load_config

    (tmp_path / "rtrain.toml").write_text(
        'grace_s = 0\nstop_signal = "usr1"\nfile_mode = 0o640\n'
        '[settings]\nlr = 1e-300\n')
    cfg = load_config({"settings": {"batch_size": 1e300}, "sample_interval_s": 0.01}, None,
                      tmp_path)
    assert (cfg.grace_s, cfg.stop_signal, cfg.file_mode) == (0, "SIGUSR1", 0o640)
    assert cfg.sample_interval_s == 0.01
    assert cfg.settings == {"lr": 1e-300, "batch_size": 1e300}
    for name in ("SIGTERM", "INT", "sighup", "SIGQUIT", "SIGUSR1", "SIGXCPU", "SIGPWR"):
        assert load_config({"stop_signal": name}, None, tmp_path).stop_signal.startswith("SIG")


@pytest.fixture
def read_only(small_tmpfs):
    """A tmpfs holding `existing/`, remounted read-only: writes fail with EROFS, even as root."""
    mnt = small_tmpfs("1m")
    (mnt / "existing").mkdir()
    remount_read_only(mnt)
    return mnt


@pytest.mark.parametrize("sub", ["existing", "new/run"])
def test_read_only_run_dir_is_a_usage_error(tmp_path, rtrain, read_only, sub):
    r = rtrain("launch", "--run-dir", str(read_only / sub), SCRIPT, cwd=tmp_path)
    _one_line_usage_error(r, f"cannot write to {read_only / sub}", "Read-only file system",
                          "--run-dir")


def test_read_only_report_dir_is_a_usage_error(tmp_path, rtrain, small_tmpfs):
    mnt = small_tmpfs("1m")
    _old_run(mnt / "run")
    remount_read_only(mnt)
    r = rtrain("report", str(mnt / "run"), cwd=tmp_path)
    _one_line_usage_error(r, "cannot write the report", "-o FILE")
    assert rtrain("report", str(mnt / "run"), "-o", str(tmp_path / "r.html")).returncode == 0


# ------------------------------------------------------------------ old run dirs


def _old_run(run: Path) -> None:
    """events.jsonl and state.json as an rtrain that accepted `--set batch_size=1e400` wrote
    them (Python's json writes Infinity and NaN)."""
    run.mkdir(parents=True)
    t = time.time() - 60
    inf, nan = float("inf"), float("nan")
    evs = [
        {"kind": "launch", "attempt": 0, "argv": ["python", "train.py"], "pid": 1,
         "settings": {"batch_size": inf}, "level": 0, "resume_from": None},
        {"kind": "heartbeat_summary", "attempt": 0, "step": 3, "loss": nan,
         "samples_per_s": inf},
        {"kind": "exit", "attempt": 0, "returncode": 0, "signal": None, "duration_s": inf,
         "last_step": 3},
        {"kind": "decision", "attempt": 0, "action": "finished", "reason": "done",
         "backoff_s": nan, "level": nan, "settings": {"batch_size": inf}, "exit_code": 0},
        {"kind": "finished", "reason": "done"},
    ]
    lines = [json.dumps({"v": 1, "seq": i + 1, "time": t + i, **e}) for i, e in enumerate(evs)]
    (run / "events.jsonl").write_text("\n".join(lines) + "\n")
    state = {"v": 1, "status": "finished", "command": ["python", "train.py"], "cwd": "/",
             "reason": "done", "created": t, "updated": t,
             "history": {"attempt": 1, "settings": {"batch_size": inf}}}
    (run / "state.json").write_text(json.dumps(state))
    assert "Infinity" in (run / "events.jsonl").read_text()


def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text, parse_constant=refuse)


def test_old_run_dir_with_infinity_reports_and_shows_status(tmp_path, rtrain):
    run = tmp_path / "run"
    _old_run(run)
    r = rtrain("report", str(run))
    assert r.returncode == 0, r.stderr
    html = (run / "report.html").read_text()
    data = re.search(r'<script type="application/json" id="rtrain-data">(.*?)</script>', html,
                     re.S).group(1)
    parsed = _strict(data)
    assert parsed["attempts"][0]["settings"] == {"batch_size": None}
    assert parsed["points"][0]["loss"] is None
    s = rtrain("status", str(run), "--json")
    assert s.returncode == 0, s.stderr
    assert _strict(s.stdout)["settings"] == {"batch_size": None}
    text = rtrain("status", str(run))
    assert text.returncode == 0 and "backoff nan" not in text.stdout, text.stdout
