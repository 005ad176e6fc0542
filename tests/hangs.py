"""A pytest plugin (tests/conftest.py loads it): a test that hangs fails alone and says where
every process of it was, and no process a test started outlives it.

pytest-timeout fails a test at its timeout (`timeout` in pyproject.toml, or a
`@pytest.mark.timeout(S)`) with the stacks of the test's own threads. A test of rtrain mostly
waits on processes, so shortly before that, the stacks of every process the test started are
written to its captured stderr: the Python stacks by py-spy, and the kernel's wait channel of
each. After a test that started processes, any of them still running is killed and named there
too, so a hung child cannot hold a pipe, a lock or a core for the tests after it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import psutil
import pytest
from harness import process_stacks

STACKS_LEAD_S = 20.0  # how long before its timeout a test's processes have their stacks dumped


def timeout_of(item: pytest.Item) -> float | None:
    """The timeout pytest-timeout applies to `item`, in seconds (None: none)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    if marker is not None and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    value = item.config.getoption("timeout", None) or item.config.getini("timeout")
    return float(value) if value else None


def descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _identity(p: psutil.Process) -> tuple[int, float] | None:
    try:
        return p.pid, p.create_time()
    except psutil.Error:
        return None


def _dump_before_timeout(item: pytest.Item) -> threading.Timer | None:
    timeout = timeout_of(item)
    if not timeout:
        return None

    at = max(timeout - STACKS_LEAD_S, timeout * 0.8)

    def dump() -> None:
        procs = descendants()
        sys.stderr.write(f"\n==== {item.nodeid}: still running after {at:.0f} s (timeout "
                         f"{timeout:.0f} s); its {len(procs)} processes:\n"
                         f"{process_stacks(procs)}\n")
        sys.stderr.flush()

    timer = threading.Timer(at, dump)
    timer.daemon = True
    timer.start()
    return timer


def kill_leftovers(before: set[tuple[int, float]]) -> list[str]:
    """Kill the descendants of this process not in `before`; their descriptions."""
    left = [p for p in descendants() if _identity(p) not in before]
    said = []
    for p in left:
        try:
            said.append(f"pid {p.pid}: {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=5)
    return said


# trylast: inside the capture plugin's wrapper, so what is written here is the test's output.
@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    if not item.get_closest_marker("slow"):
        yield
        return
    # Processes that fixtures started (a module's S3 server) belong to the fixtures.
    before = {i for i in map(_identity, descendants()) if i is not None}
    timer = _dump_before_timeout(item)
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        said = kill_leftovers(before)
        if said:
            sys.stderr.write("killed, still running when the test ended:\n  "
                             + "\n  ".join(said) + "\n")
