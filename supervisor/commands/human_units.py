"""Bytes, rates and durations as a person reads them: the status line, `rtrain status`,
`report` and `inspect` print them alike."""

from __future__ import annotations


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    size, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"


def human_rate(per_s: float) -> str:
    """812 -> "812", 12345 -> "12.3k": a rate to about three figures."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            return f"{per_s / scale:.3g}{suffix}"
    return f"{per_s:.3g}"


def human_duration(seconds: float) -> str:
    """45 -> "45s", 200 -> "3m20s", 7500 -> "2h05m", 97200 -> "1d03h"."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
