"""A pytest plugin (tests/conftest.py loads it): the suite's two tiers.

The default tier is every fast test and at least one end-to-end test of every behaviour
(docs/test-coverage.md says which). The soak tier (`@pytest.mark.soak`, `pytest --soak`,
`scripts/test.sh --soak`) is the long matrices and loops: every configuration of a split run,
chaos with many kills, every Slurm and multi-node sequence. `--soak` runs that tier alone, with
a longer timeout per test; without it, soak tests are deselected.
"""

from __future__ import annotations

import pytest

SOAK_TIMEOUT_S = 900  # a soak test's own limit, where it sets none: a matrix may take minutes


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true",
                     help="run the soak tier (tests marked soak) instead of the default tier")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    soak = config.getoption("soak")
    keep, drop = [], []
    for item in items:
        if item.get_closest_marker("soak") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)  # a soak test starts processes
        (keep if bool(item.get_closest_marker("soak")) == soak else drop).append(item)
        if soak and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SOAK_TIMEOUT_S))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    # The files that start processes first, the process-free ones (a few ms a test) last: xdist
    # hands tests out in this order, so the quick ones fill the workers' ends instead of a
    # launch of tens of seconds starting when the others are done (the tier's wall time is its
    # slowest worker's). Whole files, in their own order: a file's module fixtures (a Slurm
    # cluster) end with its last test, as they were written to.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: 0 if item.path in slow_files else 1)
