"""The live status line of `rtrain launch`: one line redrawn in place on a terminal, plain log
lines elsewhere.

On a TTY the line is redrawn with "\\r\\x1b[2K" at most every `TTY_INTERVAL_S`, and cleared
before anything else reaches the terminal: the child's echoed output goes through
`write_through`, the supervisor's own messages inside `with line.suspend():`. Off a TTY (a log
file, a Slurm output file) a carriage return would only litter the file, so a plain line is
printed at most every `LOG_INTERVAL_S`. Plain ANSI, no rich: it costs ~100 ms of start-up.
Single-threaded by design: the launch loop calls it from its select loop only.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO, TextIO

from rtrain.supervisor.commands.human_units import human_bytes, human_duration, human_rate

TTY_INTERVAL_S = 0.25
LOG_INTERVAL_S = 30.0
RATE_WINDOW_S = 60.0  # steps/s is measured over this much recent history
PARTIAL_QUIET_S = 2.0  # how long a child's unfinished line is left alone before we draw below it
CLEAR = "\r\x1b[2K"  # to column 0, erase the whole line


def checkpoint_eta(step: int | None, next_save_step: int | None,
                   steps_per_s: float | None) -> float | None:
    """Seconds to the next checkpoint at the current step rate; None when it cannot be told."""
    if step is None or next_save_step is None or not steps_per_s or steps_per_s <= 0:
        return None
    return max(0, next_save_step - step) / steps_per_s


def format_line(fields: Mapping[str, Any]) -> str:
    """The status as one line; fields that are missing or None are left out.

    Fields: attempt, step, loss, samples_per_s, rss_bytes, gpu_used, gpu_total, level,
    next_save_step, steps_per_s.
    """
    f = {k: v for k, v in fields.items() if v is not None}
    parts = []
    if "attempt" in f:
        parts.append(f"attempt {f['attempt']}")
    if "step" in f:
        parts.append(f"step {f['step']:,}")
    if "loss" in f:
        loss = f["loss"]
        parts.append(f"loss {loss:.4g}" if isinstance(loss, (int, float)) else f"loss {loss}")
    if f.get("samples_per_s"):
        parts.append(f"{human_rate(f['samples_per_s'])} samples/s")
    if "rss_bytes" in f:
        parts.append(f"rss {human_bytes(f['rss_bytes'])}")
    if "gpu_used" in f:
        total = f" / {human_bytes(f['gpu_total'])}" if "gpu_total" in f else ""
        parts.append(f"gpu {human_bytes(f['gpu_used'])}{total}")
    if "level" in f:
        parts.append(f"rung {f['level']}")
    if "next_save_step" in f:
        eta = checkpoint_eta(f.get("step"), f["next_save_step"], f.get("steps_per_s"))
        when = f" in ~{human_duration(eta)}" if eta is not None else ""
        parts.append(f"ckpt @{f['next_save_step']:,}{when}")
    return " | ".join(parts)


class StatusLine:
    """`update(**fields)` as readings arrive; `write_through(data, to)` for the child's output;
    `with line.suspend():` around anything else printed to the same terminal; `clear()` at the
    end. `stream` is a text stream (normally sys.stderr)."""

    def __init__(self, stream: TextIO, *, is_tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, width: int | None = None) -> None:
        self.stream = stream
        self.is_tty = _isatty(stream) if is_tty is None else is_tty
        self.clock = clock
        self._width = width
        self.fields: dict[str, Any] = {}
        self._steps: deque[tuple[float, int]] = deque()
        self._shown = False  # our line is on the terminal now
        self._last_draw = -math.inf
        self._suspended = 0
        self._partial_since: float | None = None  # the child left an unfinished line

    def update(self, **fields: Any) -> None:
        """Merge new readings (None forgets one) and draw if the throttle allows."""
        now = self.clock()
        if "attempt" in fields and fields["attempt"] != self.fields.get("attempt"):
            # A relaunch resumes from a checkpoint, maybe on another rung: the old rate is moot.
            self._steps.clear()
            self.fields.pop("steps_per_s", None)
        self.fields.update(fields)
        self.fields = {k: v for k, v in self.fields.items() if v is not None}
        if "step" in fields and "steps_per_s" not in fields:
            self._track_rate(now)
        interval = TTY_INTERVAL_S if self.is_tty else LOG_INTERVAL_S
        if now - self._last_draw >= interval:
            self._draw(now)

    def _track_rate(self, now: float) -> None:
        step = self.fields.get("step")
        if not isinstance(step, int):
            return
        if self._steps and step < self._steps[-1][1]:
            self._steps.clear()  # went backwards: a rollback
        self._steps.append((now, step))
        while len(self._steps) > 2 and now - self._steps[0][0] > RATE_WINDOW_S:
            self._steps.popleft()
        (t0, s0), (t1, s1) = self._steps[0], self._steps[-1]
        if t1 > t0 and s1 > s0:
            self.fields["steps_per_s"] = (s1 - s0) / (t1 - t0)

    def line(self) -> str:
        return format_line(self.fields)

    def _draw(self, now: float) -> None:
        text = self.line()
        if not text or self._suspended:
            return
        if not self.is_tty and "step" not in self.fields:
            return  # a log line without progress says nothing the launch message did not
        if self._partial_since is not None:
            if now - self._partial_since < PARTIAL_QUIET_S:
                return  # drawing now would overwrite the child's half-written line
            self.stream.write("\n")  # keep that line; ours goes below it
            self._partial_since = None
        if self.is_tty:
            width = self._width or _terminal_width(self.stream)
            # A wrapped line cannot be erased by CLEAR, which only reaches the last row.
            self.stream.write(CLEAR + text[:max(width - 1, 10)])
            self._shown = True
        else:
            self.stream.write(f"rtrain: {text}\n")
        self.stream.flush()
        self._last_draw = now

    def clear(self) -> None:
        """Erase the line (TTY only), so that the next output starts on a clean line."""
        if self._shown:
            self.stream.write(CLEAR)
            self.stream.flush()
            self._shown = False

    @contextlib.contextmanager
    def suspend(self) -> Iterator[None]:
        """Hide the line while other output is written; redraw it afterwards."""
        self.clear()
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1
            if self.is_tty and not self._suspended:
                self._draw(self.clock())

    def write_through(self, data: bytes, to: BinaryIO) -> None:
        """Write the child's output bytes to `to` (e.g. sys.stdout.buffer) around the line."""
        if not data:
            return
        self.clear()
        to.write(data)
        to.flush()
        now = self.clock()
        self._partial_since = None if data.endswith(b"\n") else now
        if self.is_tty:
            self._draw(now)

    def __enter__(self) -> StatusLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _terminal_width(stream: Any) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 80
