from __future__ import annotations

import signal

import pytest
from harness import child_spec, gone, wait_for

from rtrain.supervisor.proc.proctree import ProcTree
from rtrain.supervisor.proc.spawn import spawn
from rtrain.supervisor.proc.stop import stop_group


def _ready(child):
    """Block until the child printed its first line (its handlers are installed by then)."""
    import select

    select.select([child.stdout.fd], [], [], 10)
    child.stdout.pump()


@pytest.mark.slow
def test_polite_signal_is_enough_for_a_normal_child(tmp_path):
    child = spawn(child_spec(tmp_path, "hang.py"))
    _ready(child)
    result = stop_group(child, signal.SIGTERM, grace_s=10)
    child.close()
    assert result.returncode == -signal.SIGTERM
    assert result.signal_sent == "SIGTERM"
    assert not result.killed_after_grace and result.leftovers == []


@pytest.mark.slow
def test_sigkill_after_grace_when_sigterm_is_ignored(tmp_path):
    child = spawn(child_spec(tmp_path, "ignore_sigterm.py"))
    _ready(child)
    result = stop_group(child, signal.SIGTERM, grace_s=0.3)
    child.close()
    assert result.killed_after_grace
    assert result.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_already_exited_child_reports_its_code(tmp_path):
    child = spawn(child_spec(tmp_path, "crash_with_code.py", "5"))
    child.popen.wait(10)
    result = stop_group(child, signal.SIGTERM, grace_s=5)
    child.close()
    assert result.returncode == 5 and result.signal_sent is None


@pytest.mark.slow
def test_no_grandchild_survives_even_after_setsid(tmp_path):
    pids_file = tmp_path / "pids"
    child = spawn(child_spec(tmp_path, "leave_grandchildren.py", str(pids_file), "stay"))
    inside, escaped = map(int, wait_for(pids_file).split())
    tree = ProcTree()
    tree.sample(0)  # the watcher samples during the attempt; one sample is enough here
    result = stop_group(child, signal.SIGTERM, grace_s=5, tree=tree)
    child.close()
    assert result.leftovers == []
    assert {inside, escaped} <= set(result.swept) | {child.pid}
    assert gone(inside, 0.5) and gone(escaped, 0.5)


@pytest.mark.slow
def test_escapee_found_without_a_sample_via_subreaper(tmp_path):
    """The child exits at once; its setsid grandchild was never sampled but is re-parented to us."""
    pids_file = tmp_path / "pids"
    child = spawn(child_spec(tmp_path, "leave_grandchildren.py", str(pids_file)))
    inside, escaped = map(int, wait_for(pids_file).split())
    child.popen.wait(10)
    result = stop_group(child, signal.SIGTERM, grace_s=5)
    child.close()
    assert result.returncode == 0
    assert result.leftovers == []
    assert gone(inside, 0.5) and gone(escaped, 0.5)
