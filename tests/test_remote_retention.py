"""Mirror retention (supervisor/mirror/prune_remote.py): the local policy applied to a listing.
Pure planning by table; `prune_remote` against a plain-directory mirror."""

from __future__ import annotations

import pytest
from conftest import build_checkpoint

from rtrain.checkpoint.verify import Status, Verdict
from rtrain.supervisor.mirror.prune_remote import UNFINISHED, plan_remote, prune_remote
from rtrain.supervisor.mirror.store import RemoteCheckpoint, open_mirror


def listing(spec: str) -> list[RemoteCheckpoint]:
    """"500? 400 300? 200 100": steps newest first, `?` an unfinished upload."""
    out = []
    for word in spec.split():
        step = int(word.rstrip("?"))
        out.append(RemoteCheckpoint(step, f"checkpoint-{step}", not word.endswith("?")))
    return out


def steps(rs) -> str:
    return " ".join(str(r.step) + ("" if r.committed else "?") for r in rs)


@pytest.mark.parametrize("spec, keep, milestone, protect, kept, deleted", [
    # the newest `keep` committed ones stay
    ("400 300 200 100", 2, 0, (), "400 300", "200 100"),
    # an unfinished upload older than the newest committed one goes; a newer one stays
    ("500? 400 300? 200", 1, 0, (), "500? 400", "300? 200"),
    # ... unless it is protected (the upload in flight)
    ("400 300? 200", 1, 0, (300,), "400 300?", "200"),
    # milestones stay whatever keep says
    ("400 300 200 100", 1, 200, (), "400 200", "300 100"),
    # nothing committed: nothing is deleted (no newer good one to fall back on)
    ("300? 200?", 1, 0, (), "300? 200?", ""),
    # the newest committed one is never deleted
    ("100", 1, 0, (), "100", ""),
    ("", 3, 0, (), "", ""),
])
def test_plan_table(spec, keep, milestone, protect, kept, deleted):
    keep_, delete = plan_remote(listing(spec), keep, milestone, set(protect))
    assert steps(keep_) == kept
    assert steps(r for r, _ in delete) == deleted


def test_reasons():
    _, delete = plan_remote(listing("400 300? 200"), 1, 0, set())
    assert dict((r.step, why) for r, why in delete) == {
        300: UNFINISHED, 200: "beyond the retention policy"}


def test_a_bad_checkpoint_is_not_counted_as_kept():
    keep, delete = plan_remote(listing("400 300 200"), 1, 0, set(), bad=frozenset({400}))
    # 400 is newer than every good one: left for a person; 300 is now the newest good one.
    assert steps(keep) == "400 300" and steps(r for r, _ in delete) == "200"


def test_keep_below_one_is_refused():
    with pytest.raises(ValueError, match="keep must be at least 1"):
        plan_remote(listing("100"), 0, 0, set())


def test_prune_checks_what_it_relies_on_before_deleting(tmp_path):
    mirror = open_mirror(str(tmp_path / "mirror"))
    for step in (100, 200, 300):
        mirror.upload(build_checkpoint(tmp_path / "local", step))
    mirror.fs.pipe_file(mirror.path("checkpoint-50", "state.json"), b"{}")
    checked = []

    def check(rc, sizes):
        checked.append(rc.step)
        return Verdict(tmp_path, rc.step, Status.CORRUPT if rc.step == 300 else Status.OK)

    dry = prune_remote(mirror, keep_remote=1, dry_run=True, check=check)
    assert checked == [300, 200]  # 300 failed, so 200 became the one relied on
    assert steps(dry.kept) == "300 200" and steps(r for r, _ in dry.deleted) == "100 50?"
    assert len(mirror.list()) == 4  # a dry run deletes nothing
    done = prune_remote(mirror, keep_remote=1, check=check)
    assert done.bytes > 0
    assert steps(mirror.list()) == "300 200"
