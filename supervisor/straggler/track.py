"""The straggler rule's live side: fed each step heartbeat of an attempt (through the watch's
`on_heartbeat`), it keeps every rank's recent timings and the node each rank runs on, applies
`decide.stragglers`, and hands back the ranks newly found slow. A rank is reported once while it
stays slow; one that recovers and turns slow again is reported again. Recovered means below half
the factor's margin (1.1 for a factor of 1.2), so a rank hovering at the factor is not reported
at every other heartbeat."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.straggler.decide import Pace, StepSample, StragglerRule, paces


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """A straggler and the node it is on (`host`: None from a worker that does not say)."""

    straggler: Pace
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
        # Below this ratio a reported rank counts as recovered.
        self._recovered = 1 + (rule.factor - 1) / 2

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
        now = paces(self.samples, self.rule)
        found = {rank for rank, p in now.items() if p.slower_by(self.rule.factor)}
        new = [Found(straggler=now[rank], host=self.hosts.get(rank), ranks=len(self.samples))
               for rank in sorted(found - self.slow)]
        # Recovered: judged, and below the looser factor. A rank not judged at this moment
        # (the others' heartbeats of the newest steps still on their way) stays as it was.
        recovered = {rank for rank in self.slow
                     if rank in now and not now[rank].slower_by(self._recovered)}
        self.slow = (self.slow - recovered) | found
        return new


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e9
