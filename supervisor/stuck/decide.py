"""Which rank is stuck: one pure function from what each rank said and where its stack is, to
the sentence a person reads at a hang ("rank 3 is in step 42 at `model(x)` ...; ranks 0-2 wait
in `loss.backward()` in step 42").

Inputs per rank (`RankState`): the last step boundary it reached (`Checkpointer.maybe_save`,
`rtrain.heartbeat(step=...)`), the unix times it reached that boundary (`left_at`: it left the
step) and began the next step (`entered_at`: the boundary returned), and the text of its stack
dump (faulthandler's or py-spy's; the main thread is read).

Rule: ranks are ordered by how far they got, and the ones no other rank is behind, while some
rank is ahead of them, are "behind" (the stuck ones: the others wait for them).
1. Step first: the last boundary reached, and whether the next step had begun (from the
   boards only: a step heard in a throttled heartbeat may be older than the rank's).
2. Same step: program order. The two main-thread stacks are compared from the outermost frame
   inward; at the first frame that differs, if both are in the same function of the same file,
   the lower line is behind (the training loop runs the forward before the backward). Frames
   in different functions called from the same line are not ordered.
3. A rank that waits in a torch.distributed collective is ahead of one at the same place
   that does not: the collective waits for the other.
Nobody behind (every rank at the same place): "no rank is behind: ranks 0-3 wait in <where>",
and when the group has ranks this supervisor does not hear (other nodes), the one holding them
up is there. A process alone in its group is the stuck one: it is said where it is.

Where a rank is: its innermost frame in the user's code (not the standard library, not
site-packages, not rtrain's), with the source line when it could be read, and the innermost
frame of all when that is elsewhere (`time.sleep` in a library, `all_reduce`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePath

# torch.distributed's blocking calls (and Work.wait): a rank inside one waits for the others.
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier",
    "monitored_barrier", "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
    "scatter_object_list", "reduce", "send", "recv", "batch_isend_irecv", "wait",
})
_LIBRARY_PARTS = ("site-packages", "dist-packages")


@dataclass(frozen=True)
class Frame:
    """One Python frame: file, line and function, as a stack dump names them."""

    file: str
    line: int
    func: str
    source: str = ""  # the line's text, when the process side could read it

    def place(self) -> str:
        return f"{self.func} ({PurePath(self.file).name}:{self.line})"


@dataclass(frozen=True, kw_only=True)
class RankState:
    """What is known of one rank at the hang."""

    rank: int
    step: int | None = None  # the last step boundary it reached
    left_at: float | None = None  # unix time it reached that boundary
    entered_at: float | None = None  # unix time it began the next step (after left_at)
    frames: tuple[Frame, ...] = ()  # its main thread, innermost first; () without a dump

    @property
    def exact(self) -> bool:
        """From a progress board: the step is the last boundary reached. A step from the
        heartbeats alone may be older (they are throttled), so it orders nothing."""
        return self.step is not None and self.left_at is not None

    @property
    def in_next_step(self) -> bool:
        return (self.entered_at is not None and self.left_at is not None
                and self.entered_at >= self.left_at)

    @property
    def current_step(self) -> int | None:
        """The step it is running (the one after its last boundary, once begun)."""
        if self.step is None:
            return None
        return self.step + 1 if self.in_next_step else self.step


@dataclass(frozen=True, kw_only=True)
class RankPlace:
    """One rank in the report."""

    rank: int
    step: int | None
    # "step": running `step`; "boundary": at the end of `step`; "heard": past `step` (its last
    # heartbeat's, no board); "unknown": before its first step
    phase: str
    where: str  # in words; "" without a stack
    collective: str | None  # the torch.distributed call it waits in, if any
    since_s: float | None  # seconds in its phase before the hang was found
    behind: bool

    def to_dict(self) -> dict[str, object]:
        return {"rank": self.rank, "step": self.step, "phase": self.phase, "where": self.where,
                "collective": self.collective, "since_s": self.since_s, "behind": self.behind}


@dataclass(frozen=True, kw_only=True)
class StuckReport:
    """The answer: the ranks behind, the sentence, and every rank's place."""

    behind: tuple[int, ...]
    summary: str
    ranks: tuple[RankPlace, ...] = field(default=())

    def to_dict(self) -> dict[str, object]:
        return {"behind": list(self.behind), "summary": self.summary,
                "ranks": [r.to_dict() for r in self.ranks]}


def is_library(path: str, library_roots: Sequence[str] = ()) -> bool:
    """Code that is not the user's: installed packages, the standard library, rtrain."""
    if path.startswith("<") or any(part in _LIBRARY_PARTS for part in PurePath(path).parts):
        return True
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in library_roots)


def collective_of(frames: Sequence[Frame]) -> str | None:
    """The innermost torch.distributed collective the stack is inside, if any."""
    for f in frames:
        if f.func in COLLECTIVES and "distributed" in PurePath(f.file).parts:
            return f.func
    return None


def describe_where(frames: Sequence[Frame], library_roots: Sequence[str] = ()) -> str:
    """Where the stack is, for a person: the user's innermost frame (with its source line),
    then the innermost frame of all when that is elsewhere."""
    if not frames:
        return ""
    user = next((f for f in frames if not is_library(f.file, library_roots)), None)
    inner = frames[0]
    head = user or inner
    text = f"`{head.source}` in {head.place()}" if head.source else head.place()
    coll = collective_of(frames)
    if coll is not None and head is not inner:
        return f"{text}, waiting in {coll}"
    if head is not inner:
        return f"{text}, inside {inner.place()}"
    return text


def _order(a: RankState, b: RankState) -> int:
    """-1: `a` is behind `b`; 1: ahead; 0: the same place or not ordered."""
    if a.exact and b.exact:
        ka, kb = (a.step, a.in_next_step), (b.step, b.in_next_step)
        if ka != kb:
            return -1 if ka < kb else 1
    if not a.frames or not b.frames:
        return 0
    for fa, fb in zip(reversed(a.frames), reversed(b.frames), strict=False):
        if (fa.file, fa.func, fa.line) == (fb.file, fb.func, fb.line):
            continue
        if (fa.file, fa.func) == (fb.file, fb.func):
            return -1 if fa.line < fb.line else 1
        break
    ca, cb = collective_of(a.frames), collective_of(b.frames)
    if (ca is None) != (cb is None):
        return -1 if ca is None else 1
    return 0


def ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(parts)


def _phase(s: RankState) -> tuple[str, float | None]:
    if s.step is None:
        return "unknown", None
    if not s.exact:
        return "heard", None
    if s.in_next_step:
        return "step", s.entered_at
    return "boundary", s.left_at


def _at(place: RankPlace) -> str:
    if place.phase == "step":
        return f"in step {place.step}"
    if place.phase == "boundary":
        return f"at the end of step {place.step}"
    if place.phase == "heard":
        return f"past step {place.step}"
    return "before its first step"


def summarise(states: Sequence[RankState], *, now: float, world: int | None = None,
              library_roots: Sequence[str] = ()) -> StuckReport | None:
    """The report for the ranks this supervisor hears (`states`), at unix time `now` (the hang
    found); `world`: the group's size, when ranks elsewhere belong to it. None without ranks."""
    if not states:
        return None
    states = sorted(states, key=lambda s: s.rank)
    behind = [s for s in states
              if any(_order(s, o) < 0 for o in states)
              and not any(_order(s, o) > 0 for o in states)]
    behind_ranks = {s.rank for s in behind}
    if len(states) == 1 and (world or 1) == 1:
        behind_ranks = {states[0].rank}  # alone in its group: nothing else to wait for
    places = []
    for s in states:
        phase, since = _phase(s)
        places.append(RankPlace(
            rank=s.rank, step=s.current_step, phase=phase,
            where=describe_where(s.frames, library_roots), collective=collective_of(s.frames),
            since_s=None if since is None else round(max(0.0, now - since), 1),
            behind=s.rank in behind_ranks))
    return StuckReport(behind=tuple(sorted(behind_ranks)),
                       summary=_sentence(places, world, len(states)), ranks=tuple(places))


def _sentence(places: Sequence[RankPlace], world: int | None, heard: int) -> str:
    def group_text(group: list[RankPlace], verb: str) -> str:
        p = group[0]
        where = f" at {p.where}" if p.where else ""
        since = f" (for {p.since_s:g} s)" if p.since_s is not None and verb == "is" else ""
        if len(group) > 1:
            verb = "are" if verb == "is" else verb
        elif verb == "wait":
            verb = "waits"
        return f"{ranges([g.rank for g in group])} {verb} {_at(p)}{since}{where}"

    groups: dict[tuple[bool, int | None, str, str], list[RankPlace]] = {}
    for p in places:
        groups.setdefault((p.behind, p.step, p.phase, p.where), []).append(p)
    behind = [g for k, g in groups.items() if k[0]]
    others = [g for k, g in groups.items() if not k[0]]
    if behind:
        parts = [group_text(g, "is") for g in behind] + [group_text(g, "wait") for g in others]
        return "; ".join(parts)
    text = "; ".join(group_text(g, "wait") for g in others)
    if len(others) == 1:
        text = f"no rank is behind: {text}"
        if world is not None and world > heard:
            text += f" (the group has {world} ranks: the one holding them up is on another node)"
    else:
        text = f"no rank could be named as behind: {text}"
    return text


# Stack dumps --------------------------------------------------------------------------------

_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)[^\n]*\(most recent call first\):",
                        re.M)
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (\S+)\s*$')
_SPY_THREAD = re.compile(r'^Thread (\S+) \((\w+)\)(?:: "(.*)")?\s*$')
_SPY_FRAME = re.compile(r"^\s+(\S.*?) \((.*):(\d+)\)\s*$")


def parse_stacks(text: str) -> tuple[Frame, ...]:
    """The main thread's frames (innermost first) of the newest dump in `text`: faulthandler's
    (`File "x.py", line 3 in f`) or py-spy's (`f (x.py:3)` under `Thread N (...): "MainThread"`).
    () when nothing is recognised."""
    threads = _spy_threads(text) or _faulthandler_threads(text)
    if not threads:
        return ()
    named = [frames for name, frames in threads if name == "MainThread" and frames]
    if named:
        return named[-1]
    # faulthandler names no thread: the main one is the one whose outermost frame is a module
    # (the script), not a thread's bootstrap.
    mains = [frames for _, frames in threads if frames and frames[-1].func == "<module>"]
    if mains:
        return mains[-1]
    return next((frames for _, frames in threads if frames), ())


def _faulthandler_threads(text: str) -> list[tuple[str, tuple[Frame, ...]]]:
    threads: list[tuple[str, list[Frame]]] = []
    for line in text.splitlines():
        if _FH_THREAD.match(line):
            threads.append(("", []))
            continue
        m = _FH_FRAME.match(line)
        if m and threads:
            threads[-1][1].append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    return [(name, tuple(frames)) for name, frames in threads]


def _spy_threads(text: str) -> list[tuple[str, tuple[Frame, ...]]]:
    threads: list[tuple[str, list[Frame]]] = []
    for line in text.splitlines():
        t = _SPY_THREAD.match(line)
        if t:
            threads.append((t.group(3) or "", []))
            continue
        m = _SPY_FRAME.match(line)
        if m and threads:
            threads[-1][1].append(Frame(m.group(2), int(m.group(3)), m.group(1)))
    return [(name, tuple(frames)) for name, frames in threads]
