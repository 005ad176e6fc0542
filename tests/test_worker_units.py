"""The Checkpointer's units on their own: the save clock. Which module may import which is the
import contracts' (tests/test_layers.py)."""

from rtrain.worker.saving import save_clock
from rtrain.worker.saving.schedule import SaveSchedule


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_save_clock_counts_time_from_the_last_save_and_serves_a_request(monkeypatch):
    beats = []
    monkeypatch.setattr(save_clock.runtime, "heartbeat", lambda **kw: beats.append(kw))
    t = FakeClock()
    c = save_clock.SaveClock(SaveSchedule(every_steps=10, every_seconds=60.0), clock=t)
    assert not c.tick(1, loss=None, samples=8, epoch_end=False)
    t.now += 59.0
    assert not c.tick(2, loss=0.5, samples=16, epoch_end=False)
    t.now += 1.0
    assert c.tick(3, loss=None, samples=24, epoch_end=False)  # 60 s since the start
    c.save_begins()
    c.last_step = 3
    assert not c.tick(4, loss=None, samples=32, epoch_end=False)  # the timer restarted
    c.requested = True
    assert c.tick(5, loss=None, samples=40, epoch_end=False)
    c.save_begins()
    assert not c.requested
    assert c.tick(10, loss=None, samples=None, epoch_end=False)  # every_steps
    assert [b["samples"] for b in beats] == [8, 8, 8, 8, 8, None]
    assert [b["next_save_step"] for b in beats] == [10, 10, 10, 10, 10, 20]
    assert beats[1]["loss"] == 0.5


def test_save_clock_after_resume_counts_samples_from_the_checkpoint(monkeypatch):
    beats = []
    monkeypatch.setattr(save_clock.runtime, "heartbeat", lambda **kw: beats.append(kw))
    c = save_clock.SaveClock(SaveSchedule(every_steps=5), clock=FakeClock())
    c.resumed(5, 40)
    assert not c.tick(5, loss=None, samples=44, epoch_end=False)  # saved there already
    assert beats[0]["samples"] == 4
