"""events.jsonl on a real full tmpfs: emitting never raises, the events wait in memory and go
out in order, with their seq, once there is room."""

from __future__ import annotations

from harness import fill_disk

from rtrain.supervisor.records.events import EventLog, read_events


def test_events_wait_for_room_and_keep_their_order(small_tmpfs):
    disk = small_tmpfs("1m")
    path = disk / "events.jsonl"
    with EventLog(path) as log:
        log.emit("launch", attempt=0)
        ballast = fill_disk(disk)
        for i in range(50):  # a full disk: nothing raises, nothing is lost
            log.emit("save_skipped", attempt=0, step=i, rank=0, reason="z" * 300)
        log.emit("finished", reason="done")  # a durable kind: its fsync waits too
        assert log.pending > 0
        ballast.unlink()
        assert log.retry() and log.pending == 0
        log.emit("exit", attempt=0)
    events = read_events(path)
    assert [e["seq"] for e in events] == list(range(1, 54))
    assert [e["kind"] for e in events] == ["launch"] + ["save_skipped"] * 50 + \
        ["finished", "exit"]
    assert [e["step"] for e in events[1:51]] == list(range(50))
