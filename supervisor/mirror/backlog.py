"""Which local checkpoint the uploader sends next: a pure function of what is where.

The mirror must never build a growing backlog: when it falls behind (a slow link, an outage),
the newest committed checkpoint goes first and the intermediate ones it overtook are never
sent, since a resume only ever wants the newest. Milestones are the exception: they are kept
on the mirror forever, so one still on local disk is sent once the newest is across.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    upload: int | None
    """The step to send now, or None: the mirror is current."""
    superseded: tuple[int, ...]
    """Local steps that will never be sent: a newer one is (or goes) across first."""


def is_milestone(step: int, milestone_every: int) -> bool:
    return milestone_every > 0 and step > 0 and step % milestone_every == 0


def next_upload(local: Sequence[int], remote: Collection[int], *, milestone_every: int = 0,
                given_up: Collection[int] = ()) -> Plan:
    """`local`: committed local steps; `remote`: steps committed on the mirror; `given_up`:
    local steps the uploader will not try again (their files do not match their manifest)."""
    waiting = sorted((s for s in set(local) if s not in remote and s not in given_up),
                     reverse=True)
    if not waiting:
        return Plan(None, ())
    newest_remote = max(remote, default=-1)
    newest = waiting[0]
    if newest > newest_remote:
        first = newest
    else:
        first = next((s for s in waiting if is_milestone(s, milestone_every)), None)
    ahead = max(newest, newest_remote)
    superseded = tuple(s for s in waiting
                       if s != first and s < ahead and not is_milestone(s, milestone_every))
    return Plan(first, superseded)
