"""The straggler rule's live side: fed each step heartbeat of an attempt (through the watch's
`on_heartbeat`), it keeps every rank's recent timings and the node each rank runs on, applies
`decide.stragglers`, and hands back the ranks newly found slow. A rank is reported once while it
stays slow; one that recovers and turns slow again is reported again."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from supervisor.core.protocol import Heartbeat
from supervisor.straggler.decide import StepSample, Straggler, StragglerRule, stragglers


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """A straggler and the node it is on (`host`: None from a worker that does not say)."""

    straggler: Straggler
    host: str | None
    ranks: int
    """Ranks compared."""


class StragglerTracker:
    """One attempt's ranks; a new attempt gets a new tracker."""

    def __init__(self, rule: StragglerRule) -> None:
        self.rule = rule
        self.samples: dict[int, deque[StepSample]] = {}
        self.hosts: dict[int, str] = {}
        self.slow: set[int] = set()  # ranks reported and still slow

    def heartbeat(self, hb: Heartbeat) -> list[Found]:
        """The ranks this heartbeat shows newly slow (most heartbeats: none)."""
        if isinstance(hb.host, str):
            self.hosts[hb.rank] = hb.host
        if hb.event != "step" or hb.step is None or not (_seconds(hb.step_s) and hb.step_s > 0):
            return []
        wait = hb.wait_s if _seconds(hb.wait_s) else 0.0
        seq = self.samples.setdefault(hb.rank, deque())
        seq.append(StepSample(step=hb.step, step_s=hb.step_s, wait_s=wait))
        low = hb.step - self.rule.window_steps
        while seq and seq[0].step <= low:
            seq.popleft()
        found = {s.rank: s for s in stragglers(self.samples, self.rule)}
        new = [Found(straggler=s, host=self.hosts.get(rank), ranks=len(self.samples))
               for rank, s in found.items() if rank not in self.slow]
        self.slow = set(found)
        return new


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e9
