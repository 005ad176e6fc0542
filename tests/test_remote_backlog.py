"""The uploader's choice of what to send next (supervisor/mirror/backlog.py), by table."""

import pytest

from rtrain.supervisor.mirror.backlog import Plan, next_upload
from rtrain.supervisor.mirror.uploader import retry_after

CASES = [
    # local, remote, milestone_every, given_up -> plan
    ([], [], 0, (), Plan(None, ())),
    ([10], [], 0, (), Plan(10, ())),
    ([10], [10], 0, (), Plan(None, ())),
    # fell behind: the newest goes first, the ones it overtook never go
    ([10, 20, 30], [], 0, (), Plan(30, (20, 10))),
    ([10, 20, 30], [10], 0, (), Plan(30, (20,))),
    # a milestone is kept forever: sent after the newest, never superseded
    ([100, 150, 200, 250], [], 100, (), Plan(250, (150,))),
    ([100, 150, 200, 250], [250], 100, (), Plan(200, (150,))),
    ([100, 150, 200, 250], [200, 250], 100, (), Plan(100, (150,))),
    ([100, 150, 200, 250], [100, 200, 250], 100, (), Plan(None, (150,))),
    # step 0 is not a milestone (it is the untrained model)
    ([0, 5], [5], 5, (), Plan(None, (0,))),
    # the mirror is ahead (a fresh machine resumed from it): older local ones are not sent
    ([40], [60], 0, (), Plan(None, (40,))),
    # a local checkpoint that failed its upload for good is passed over, not retried
    ([10, 20], [], 0, (20,), Plan(10, ())),
]


@pytest.mark.parametrize("local,remote,every,given_up,plan", CASES)
def test_next_upload(local, remote, every, given_up, plan):
    assert next_upload(local, remote, milestone_every=every, given_up=given_up) == plan


def test_failed_uploads_are_retried_after_a_growing_wait_with_a_cap():
    assert [retry_after(n) for n in (1, 2, 3, 4, 5, 6, 9)] == [1, 2, 4, 8, 16, 30, 30]
