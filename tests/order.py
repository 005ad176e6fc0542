"""A pytest plugin (tests/conftest.py loads it): the tests that start processes run first.

pytest-xdist hands tests to its workers in collection order, a few at a time as each worker
finishes its last ones. In file order, some of the longest tests (a torchrun group relaunched,
a tracker run killed three times) come near the end, and the suite then ends with one worker
still in a minute-long test while the others have nothing left. Handed out first, the tests
marked slow (seconds to a minute each) overlap one another, and the in-process tests (a fraction
of a second each) fill the workers up to the end. Within each kind the order is the files'.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)  # after the tiers have deselected what this run leaves out
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
