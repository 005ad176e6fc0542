"""A run that gave up stays down for wrappers: the same `rtrain launch` exits 5 at once without
launching; `--retry` relaunches it with fresh budgets; `--fresh` starts it over. Real rtrain
processes and children."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import CHILDREN, events, launch

from supervisor.records.runstate import load_state

pytestmark = pytest.mark.slow


def gave_up_run(tmp_path: Path) -> Path:
    """A run whose first two attempts crash before any checkpoint: the crash loop (k=2)."""
    (tmp_path / "rtrain.toml").write_text("[restart]\ncrash_loop_k = 2\n")
    run = tmp_path / "run"
    r = launch(run, str(CHILDREN / "fail_first_attempts.py"), "2", "7", "0")
    assert r.returncode == 1, r.stderr
    assert "crash loop" in events(run, "give_up")[0]["reason"]
    return run


def test_the_same_command_again_launches_nothing_and_exits_5(tmp_path):
    run = gave_up_run(tmp_path)
    for _ in range(2):  # a cron entry repeating the command
        r = launch(run, str(CHILDREN / "fail_first_attempts.py"), "2", "7", "0")
        assert r.returncode == 5, r.stderr
        assert len(events(run, "launch")) == 2
        line = r.stderr.strip().splitlines()[-1]
        assert all(w in line for w in ("gave up", "crash loop", "--retry", "--fresh"))
    assert load_state(run).status.value == "gave_up"


def test_retry_relaunches_with_fresh_budgets(tmp_path):
    run = gave_up_run(tmp_path)
    assert load_state(run).history.budgets_used == {"crash": 1}
    r = launch(run, "--retry", str(CHILDREN / "fail_first_attempts.py"), "2", "7", "0")
    assert r.returncode == 0, r.stderr  # attempt 2 succeeds
    assert [e["attempt"] for e in events(run, "launch")] == [0, 1, 2]
    assert load_state(run).status.value == "finished"


def test_fresh_starts_over_and_retry_with_fresh_is_refused(tmp_path):
    run = gave_up_run(tmp_path)
    r = launch(run, "--retry", "--fresh", str(CHILDREN / "fail_first_attempts.py"), "2", "7", "0")
    assert r.returncode == 2 and "pass one" in r.stderr
    r = launch(run, "--fresh", str(CHILDREN / "fail_first_attempts.py"), "2", "7", "0")
    assert r.returncode == 1  # attempts 0 and 1 again: it gave up again, by its own rules
    assert [e["attempt"] for e in events(run, "launch")] == [0, 1, 0, 1]
