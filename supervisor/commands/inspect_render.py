"""Plain-text and JSON renderings of `inspect` results.

Plain text, not rich: rich costs ~100 ms to import, and `rtrain inspect` has 300 ms in all.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from rtrain.checkpoint.verify import Verdict
from rtrain.supervisor.commands.human_units import human_bytes
from rtrain.supervisor.commands.inspecting import Detail, DirReport, Entry, Leftover
from rtrain.supervisor.core.untrusted_text import safe


def human_size(n: int) -> str:
    return human_bytes(n)


def local_time(created: Any, sep: str = "T", offset: bool = True) -> str:
    """ISO 8601 local time; the table leaves out the UTC offset to stay narrow."""
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        return "-"
    try:
        when = dt.datetime.fromtimestamp(created)
    except (OverflowError, OSError, ValueError):  # a hand-made manifest: year 10**9, ...
        return "-"
    return (when.astimezone() if offset else when).isoformat(sep, "seconds")


def pairs(obj: Any) -> str:
    """`{"loss": 0.25, "bs": 16}` as `loss=0.25 bs=16`; names and values escaped (`safe`)."""
    if not isinstance(obj, dict) or not obj:
        return "-"
    return " ".join(f"{safe(k)}={v:.6g}" if isinstance(v, float) else f"{safe(k)}={safe(v)}"
                    for k, v in obj.items())


def table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Left-aligned columns; the last one is not padded (it holds the long reasons). Every
    cell is escaped (`safe`): a control character in any of them never reaches the terminal."""
    rows = [[safe(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return [(indent + "  ".join([c.ljust(w) for c, w in zip(r, widths, strict=False)]
                                + [r[-1]])).rstrip() for r in rows]


def _leftover_state(lo: Leftover) -> str:
    if lo.kind == "trash":
        return "interrupted deletion: prune removes it"
    if lo.pid is None:
        return "temp dir with an unrecognised name: prune removes it"
    who = f"pid {lo.pid} on {lo.host}"
    if lo.remote:
        return f"written from another host ({who}): cannot tell if it is alive, left alone"
    if lo.writer_alive:
        return f"save in progress ({who})"
    return f"abandoned ({who} is gone): prune removes it"


def _status(v: Verdict) -> str:
    """The verdict, and for a foreign checkpoint its format and any note (`ok (hf-trainer)`)."""
    if v.format == "rtrain":
        return v.describe()
    note = (v.info or {}).get("note")
    return f"{v.describe()} ({v.format}{'; ' + note if note else ''})"


_NAMED = {"accelerate", "deepspeed", "dcp"}


def _step(v: Verdict) -> str:
    return str(v.step) if v.step >= 0 else "-"  # a file whose name states no step


def _row(e: Entry) -> list[str]:
    epoch = e.meta("epoch")
    # A file's name says more than its step (last.ckpt beside epoch=3-step=400.ckpt), and so
    # does a save dir's of another library (epoch_3/ or step_3/, DeepSpeed's latest refused).
    label = e.verdict.path.name if e.verdict.path.suffix or e.verdict.format in _NAMED else ""
    return ["*" if e.resume else "", _step(e.verdict), "-" if epoch is None else str(epoch),
            local_time(e.meta("created"), " ", offset=False), human_size(e.size),
            pairs(e.meta("metrics")), pairs(e.meta("settings")),
            f"{_status(e.verdict)}{'  ' + label if label else ''}"]


def render_dir(report: DirReport) -> str:
    n = len(report.entries)
    lines = [f"{safe(report.where)}: {n} checkpoint{'s' if n != 1 else ''}, "
             f"verified {report.level.value}"]
    if report.entries:
        head = ["", "STEP", "EPOCH", "TIME", "SIZE", "METRICS", "SETTINGS", "STATUS"]
        lines += table([head] + [_row(e) for e in report.entries])
    pick = report.resume
    if pick is not None:
        lines.append(f"* resume would pick {safe(pick.verdict.path.name)} (the newest that "
                     f"verifies at level {report.level.value})")
    elif report.entries:
        lines.append(f"resume would start fresh: no checkpoint verifies at level "
                     f"{report.level.value}")
    if report.leftovers:
        lines.append("leftovers:")
        lines += table([[lo.path.name, human_size(lo.size), _leftover_state(lo)]
                        for lo in report.leftovers])
    return "\n".join(lines)


def _tensor_lines(tensors: dict[str, Any]) -> list[str]:
    lines = []
    for fname, table_ in tensors.items():
        if isinstance(table_, str):
            lines.append(f"  {safe(fname)}: {safe(table_)}")
            continue
        lines.append(f"  {safe(fname)} ({len(table_)} tensors)")
        if table_:
            lines += table([["NAME", "DTYPE", "SHAPE"]] + [
                [t, dtype, str(list(shape) if isinstance(shape, (list, tuple)) else shape)]
                for t, (dtype, shape) in table_.items()], "    ")
    return lines


def _encrypted(entry: Any) -> str:
    if entry is None:
        return "no"
    if not isinstance(entry, dict):
        return "yes (unreadable encryption field)"
    return f"yes ({entry.get('scheme')}, key fingerprint {entry.get('key_fingerprint')})"


def _world(info: Any) -> list[tuple[str, str]]:
    """How many ranks wrote the checkpoint, and how (a resume at another size reads this)."""
    size = info.get("world_size") if isinstance(info, dict) else None
    if not isinstance(size, int) or isinstance(size, bool):
        return []
    layout = info.get("layout")
    return [("world size", f"{size} rank{'s' * (size != 1)}"
             + (f", {layout}" if isinstance(layout, str) else ""))]


# info.compile_cache (worker/compilecache/compile_cache.py): torch's compile artifacts and kernels
# saved beside the checkpoint; shown on a line of its own rather than inside `info`.
COMPILE_CACHE = "compile_cache"


def _compile_cache(info: Any) -> list[tuple[str, str]]:
    """The compile cache's size and what it was built with (a fresh node loads it only from
    the same torch and device kind)."""
    cc = info.get(COMPILE_CACHE) if isinstance(info, dict) else None
    if not isinstance(cc, dict):
        return []
    size = cc.get("bytes")
    arts = cc.get("artifacts") if isinstance(cc.get("artifacts"), dict) else {}
    graphs = sum(n for n in arts.values() if isinstance(n, int) and not isinstance(n, bool))
    return [("compile cache",
             f"{human_size(size) if isinstance(size, int) else '?'} (torch {cc.get('torch')}, "
             f"{cc.get('device')}, {graphs} artifacts, {cc.get('kernels', 0)} kernels)")]


def _info_rest(info: Any) -> Any:
    return {k: v for k, v in info.items() if k != COMPILE_CACHE} if isinstance(info, dict) \
        else info


def render_one(d: Detail) -> str:
    v = d.verdict
    sig = d.meta("signature")
    step = d.meta("step", v.step) if v.format == "rtrain" else _step(v)
    if v.format != "rtrain" and (v.info or {}).get("step_from"):
        step = f"{step} ({v.info['step_from']})"  # the name states none: said where it came from
    fields = [
        ("status", f"{v.status.value} (verified {d.level.value})"
                   + (f": {v.reason}" if v.reason else "")),
        *([("format", v.format + (f" ({d.meta('note')})" if d.meta("note") else ""))]
          if v.format != "rtrain" else []),
        ("step", f"{step}   epoch {d.meta('epoch', '-')}   "
                 f"samples seen {d.meta('samples_seen', '-')}"),
        ("created", local_time(d.meta("created"))),
        ("size", f"{human_size(d.size)} in {len(d.files)} files"
                 + (" (+ manifest)" if v.format == "rtrain" else "")),
        *_world(d.meta("info")),
        *_compile_cache(d.meta("info")),
        ("fingerprint", str(d.meta("fingerprint", "-"))),
        ("signed", f"yes ({sig.get('alg')})" if isinstance(sig, dict) else "no"),
        *([("encrypted", _encrypted(d.meta("encryption")))] if v.format == "rtrain" else []),
        ("metrics", pairs(d.meta("metrics"))),
        ("settings", pairs(d.meta("settings"))),
        ("environment", pairs(d.meta("environment"))),
        ("info", pairs(_info_rest(d.meta("info")))),
    ]
    lines = [safe(d.where)] + [f"  {k:<12}{safe(val)}" for k, val in fields]
    if d.files:
        lines.append("files:")
        lines += table([["NAME", "SIZE", "HASH", "STATUS"]] + [
            [f.name, "-" if f.size is None else human_size(f.size), f.hash or "-", f.status]
            for f in d.files])
    if d.tensors:
        lines.append("tensors:")
        lines += _tensor_lines(d.tensors)
    return "\n".join(lines)


def _entry_json(e: Entry, path: str) -> dict[str, Any]:
    return {
        "name": e.verdict.path.name, "path": path, "step": e.verdict.step,
        "status": e.verdict.status.value, "reason": e.verdict.reason, "resume": e.resume,
        "format": e.verdict.format,
        "epoch": e.meta("epoch"), "samples_seen": e.meta("samples_seen"),
        "created": e.meta("created"), "time": local_time(e.meta("created")),
        "size": e.size, "metrics": e.meta("metrics", {}), "settings": e.meta("settings", {}),
    }


def dir_json(report: DirReport) -> dict[str, Any]:
    pick = report.resume
    return {
        "ckpt_dir": report.where, "verify": report.level.value,
        "resume": None if pick is None else report.path_of(pick),
        "checkpoints": [_entry_json(e, report.path_of(e)) for e in report.entries],
        "leftovers": [{"name": lo.path.name, "path": str(lo.path), "kind": lo.kind,
                       "size": lo.size, "step": lo.step, "host": lo.host, "pid": lo.pid,
                       "writer_alive": lo.writer_alive} for lo in report.leftovers],
    }


def one_json(d: Detail) -> dict[str, Any]:
    v = d.verdict
    m = v.manifest or v.info or {}
    return {
        "name": v.path.name, "path": d.where, "step": v.step, "verify": d.level.value,
        "format": v.format,
        "status": v.status.value, "reason": v.reason, "size": d.size,
        "time": local_time(m.get("created")),
        **{k: m.get(k) for k in ("epoch", "samples_seen", "created", "fingerprint",
                                 "environment", "settings", "metrics", "info", "hash_alg")},
        "signed": isinstance(m.get("signature"), dict),
        "encryption": m.get("encryption"),
        "files": [{"name": f.name, "size": f.size, "hash": f.hash, "status": f.status}
                  for f in d.files],
        "tensors": {fname: t if isinstance(t, str) else
                    {name: {"dtype": dtype,
                            "shape": list(shape) if isinstance(shape, (list, tuple)) else shape}
                     for name, (dtype, shape) in t.items()}
                    for fname, t in d.tensors.items()},
    }
