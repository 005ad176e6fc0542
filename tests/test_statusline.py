"""The live status line: formatting by table, TTY redraw vs plain log lines, throttling, and
child output written through it, with a fake stream and a fake clock."""

from __future__ import annotations

import io

import pytest

from rtrain.supervisor.commands.human_units import human_bytes, human_duration, human_rate
from rtrain.supervisor.launch.statusline import (
    CLEAR,
    LOG_INTERVAL_S,
    PARTIAL_QUIET_S,
    TTY_INTERVAL_S,
    StatusLine,
    checkpoint_eta,
    format_line,
)

GIB = 1024**3


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def tick(self, s: float) -> None:
        self.now += s


@pytest.mark.parametrize(("n", "text"), [
    (None, "?"), (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 * GIB, "3.0 GiB"),
    (80 * GIB + GIB // 2, "80.5 GiB"), (2 * 1024**4, "2.0 TiB"),
])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


@pytest.mark.parametrize(("rate", "text"), [
    (0.5, "0.5"), (812.4, "812"), (12_345, "12.3k"), (2_500_000, "2.5M"),
])
def test_human_rate(rate, text):
    assert human_rate(rate) == text


@pytest.mark.parametrize(("s", "text"), [
    (0, "0s"), (-3, "0s"), (44.6, "45s"), (200, "3m20s"), (7500, "2h05m"), (97200, "1d03h"),
])
def test_human_duration(s, text):
    assert human_duration(s) == text


@pytest.mark.parametrize(("step", "next_save", "rate", "eta"), [
    (100, 200, 2.0, 50.0), (200, 200, 2.0, 0.0), (250, 200, 2.0, 0.0),
    (100, 200, None, None), (100, 200, 0.0, None), (None, 200, 1.0, None), (100, None, 1.0, None),
])
def test_checkpoint_eta(step, next_save, rate, eta):
    assert checkpoint_eta(step, next_save, rate) == eta


@pytest.mark.parametrize(("fields", "line"), [
    ({}, ""),
    ({"attempt": 0, "step": 1234, "loss": 0.123456}, "attempt 0 | step 1,234 | loss 0.1235"),
    ({"loss": float("nan"), "samples_per_s": 12_345.0}, "loss nan | 12.3k samples/s"),
    ({"rss_bytes": 3 * GIB, "gpu_used": 20 * GIB, "gpu_total": 80 * GIB, "level": 2},
     "rss 3.0 GiB | gpu 20.0 GiB / 80.0 GiB | rung 2"),
    ({"gpu_used": GIB}, "gpu 1.0 GiB"),
    ({"step": 1000, "next_save_step": 1500, "steps_per_s": 2.5},
     "step 1,000 | ckpt @1,500 in ~3m20s"),
    ({"step": 1000, "next_save_step": 1500}, "step 1,000 | ckpt @1,500"),
    ({"attempt": 1, "step": None, "samples_per_s": 0}, "attempt 1"),
])
def test_format_line(fields, line):
    assert format_line(fields) == line


def tty(clock, width=200):
    out = io.StringIO()
    return out, StatusLine(out, is_tty=True, clock=clock, width=width)


def test_tty_redraws_in_place_and_throttles():
    clock = Clock()
    out, line = tty(clock)
    line.update(attempt=0, step=1)
    assert out.getvalue() == CLEAR + "attempt 0 | step 1"
    clock.tick(TTY_INTERVAL_S / 2)
    line.update(step=2)  # too soon: remembered, not drawn
    assert out.getvalue().count(CLEAR) == 1
    clock.tick(TTY_INTERVAL_S / 2)
    line.update(loss=0.5)
    assert out.getvalue().endswith(CLEAR + "attempt 0 | step 2 | loss 0.5")
    assert "\n" not in out.getvalue()
    line.clear()
    assert out.getvalue().endswith(CLEAR)
    line.clear()  # nothing shown: writes nothing
    assert out.getvalue().count(CLEAR) == 3


def test_tty_line_is_cut_to_the_terminal_width():
    out, line = tty(Clock(), width=20)
    line.update(attempt=3, step=123456, loss=1.0)
    assert out.getvalue() == CLEAR + "attempt 3 | step 12"


def test_step_rate_gives_the_checkpoint_eta():
    clock = Clock()
    out, line = tty(clock)
    line.update(attempt=0, step=100, next_save_step=200)
    clock.tick(10)
    line.update(step=120)  # 2 steps/s -> 80 steps to go = 40 s
    assert out.getvalue().endswith("ckpt @200 in ~40s")
    clock.tick(10)
    line.update(attempt=1, step=50)  # relaunched from a checkpoint: the old rate is dropped
    assert out.getvalue().endswith("ckpt @200")


def test_not_a_tty_prints_plain_lines_every_30s():
    clock = Clock()
    out = io.StringIO()
    line = StatusLine(out, is_tty=False, clock=clock)
    line.update(attempt=0, step=1)
    clock.tick(LOG_INTERVAL_S - 1)
    line.update(step=2)
    clock.tick(1)
    line.update(step=3)
    assert out.getvalue() == "rtrain: attempt 0 | step 1\nrtrain: attempt 0 | step 3\n"
    line.clear()
    with line.suspend():
        pass
    sink = io.BytesIO()
    line.write_through(b"child says hi\n", sink)
    assert sink.getvalue() == b"child says hi\n" and "\x1b" not in out.getvalue()


def test_isatty_is_asked_when_not_given():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert StatusLine(Tty()).is_tty and not StatusLine(io.StringIO()).is_tty


class Terminal:
    """A text stream and a byte stream that land in one transcript, like stderr and stdout."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.text = self.Text(self.log)
        self.bytes = self.Bytes(self.log)

    class Text(io.StringIO):
        def __init__(self, log):
            super().__init__()
            self.log = log

        def write(self, s):
            self.log.append(s)
            return len(s)

    class Bytes(io.BytesIO):
        def __init__(self, log):
            super().__init__()
            self.log = log

        def write(self, b):
            self.log.append(b.decode())
            return len(b)

    def transcript(self) -> str:
        return "".join(self.log)


def test_write_through_clears_writes_and_redraws():
    clock = Clock()
    term = Terminal()
    line = StatusLine(term.text, is_tty=True, clock=clock, width=200)
    line.update(attempt=0, step=7)
    line.write_through(b"epoch 1 done\n", term.bytes)
    assert term.log == [CLEAR + "attempt 0 | step 7", CLEAR, "epoch 1 done\n",
                        CLEAR + "attempt 0 | step 7"]
    line.write_through(b"", term.bytes)  # nothing to write, nothing redrawn
    assert len(term.log) == 4


def test_a_half_written_child_line_is_not_overwritten():
    clock = Clock()
    term = Terminal()
    line = StatusLine(term.text, is_tty=True, clock=clock, width=200)
    line.update(step=1)
    line.write_through(b"loading data...", term.bytes)  # no newline: the child is mid-line
    clock.tick(1)
    line.update(step=2)
    assert term.transcript().endswith("loading data...")
    clock.tick(PARTIAL_QUIET_S)
    line.update(step=3)  # quiet long enough: ours goes on the next line, theirs stays
    assert term.transcript().endswith("loading data...\n" + CLEAR + "step 3")
    line.write_through(b"done\n", term.bytes)
    assert term.transcript().endswith(CLEAR + "done\n" + CLEAR + "step 3")


def test_suspend_hides_the_line_for_other_output():
    clock = Clock()
    term = Terminal()
    line = StatusLine(term.text, is_tty=True, clock=clock, width=200)
    line.update(attempt=1)
    with line.suspend():
        term.text.write("rtrain: relaunching\n")
        clock.tick(1)
        line.update(step=5)  # arrives while suspended: not drawn over the message
        assert term.transcript().endswith(CLEAR + "rtrain: relaunching\n")
    assert term.transcript().endswith("rtrain: relaunching\n" + CLEAR + "attempt 1 | step 5")
    with line:
        pass
    assert term.transcript().endswith(CLEAR)
