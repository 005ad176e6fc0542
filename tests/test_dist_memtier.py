"""The memory tier under torchrun: each rank snapshots its part of the step, and a relaunched
group resumes from the newest step whole on every node, bitwise, without a disk checkpoint."""

from __future__ import annotations

import pytest
from bitwise import assert_bitwise_equal
from harness import events, launch_2_ranks
from references import rank_state, two_ranks


@pytest.mark.slow
def test_a_killed_rank_resumes_from_the_groups_memory_snapshot_bitwise(tmp_path):
    ref = two_ranks("12")
    run = tmp_path / "split"
    # No disk save before the end (every 100): only memory can hold the steps before the kill.
    r = launch_2_ranks(run, str(run), "12", "--every", "100", "--memory", "1", "--die-at", "7",
                       "--die-rank", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    launches = events(run, "launch")
    assert len(launches) == 2 and launches[1]["resume_from"] is None, launches
    (rec,) = events(run, "recovery")
    # Rank 1 died right after step 7's snapshot began: the group resumes from 6 or 7, whichever
    # every rank committed (never one rank's 7 with another's 6).
    assert rec["resumed_step"] in (6, 7), rec
    (resumed,) = events(run, "snapshot_resumed")
    assert resumed["step"] == rec["resumed_step"] and resumed["origin"] == "node", resumed
    assert "resumed from the memory snapshot of step" in r.stderr
    for rank in (0, 1):
        a, b = rank_state(ref, rank), rank_state(run, rank)
        assert a["step"] == b["step"] == 12
        assert_bitwise_equal(a, b, f"rank{rank}")
