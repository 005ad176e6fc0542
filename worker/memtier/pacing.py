"""How often the memory tier snapshots under `every="auto"`, and what a snapshot costs: pure.

The cost. A snapshot costs the training what it adds to the steps it runs beside: the capture
at the boundary, the writer's copy competing with the step for the cores and the memory
bandwidth, and the optimizer step's wait for the copy. None of these is the writer's CPU time
alone (a writer that yields to the step costs it less than its CPU time; one that fights the
step for memory bandwidth costs it more), so the cost is measured where it is paid: the
median time of the steps a snapshot ran beside, less the median of the steps without one, over
a moving window (`Costs`), never above what the snapshots took of the CPU (their stall and the
writer's CPU time: the most a copy can take from a step whose cores it competes for; on a
loaded machine the steps' noise is larger than a 3% cost and would otherwise pick the
interval; memory_tier.py), and never below the share of that CPU time which the training's
own CPU use left no room for (`bounded_cost`). Until both have MIN_SAMPLES (the first
snapshots), snapshots come every MEASURE_EVERY steps, so that both kinds of step are measured
at once; an attempt after the first starts from what the one before measured (memory_tier.py,
PACE_FILE); the steps that paid for something else beside their own work are measured as
neither kind (`Costs.hold`).

The interval, in order:
1. `by_ceiling`: the fewest steps between snapshots that keep their cost within COST_CEILING
   of the step time. A SIGKILL loses the steps since the newest snapshot, so the tier spends
   its whole budget on snapshotting often: the ceiling is the price, not a target to undercut.
2. `by_write`: a snapshot's write finishes before the next one is due (the next would wait
   for it on the training thread).
3. The run's failure rate, once observed (RTRAIN_FAILURES, worker/saving/cadence.py's rule
   1): Young/Daly's optimum sqrt(2 * cost * MTBF). Only ever longer than the ceiling's
   interval (the ceiling is hard): a run that fails every few hours is better served by a
   snapshot every hundred steps at a tenth of the cost. Before any failure there is no
   evidence that the run fails rarely, and a prior of a day would leave the first kill to
   lose hundreds of steps; the ceiling's interval holds.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

COST_CEILING = 0.03
"""A snapshot's cost, spread over the steps between snapshots, at most this share of the step
time under `every="auto"` (the issue's budget: a few percent of a step)."""
WINDOW = 24  # steps of each kind in the moving estimate: medians over ~2 dozen hold at +-30 %
MIN_SAMPLES = 4  # of each kind before the measured cost chooses the interval
MEASURE_EVERY = 2  # the interval until then: a step beside a snapshot, then a plain one


def bounded_cost(measured_s: float, cpu_s: float | None, busy: float) -> float:
    """A snapshot's cost from the steps' measured difference, within what its CPU time can
    take from them: at most all of it (the noise of a loaded machine can push the difference far
    above), at least the share of it the training's own CPU use says the cores had no room for
    (`busy`: the process's CPU time over the wall time of all its cores, 0-1). The difference
    alone came out 0 in a noisy stretch (medians of 4 steps each, at an attempt's start) and
    snapshotted every step at a real cost of 14%."""
    if cpu_s is None:
        return max(measured_s, 0.0)
    return max(min(max(busy, 0.0), 1.0) * cpu_s, min(measured_s, cpu_s))


def interval(*, cost_s: float, write_s: float, step_s: float, mtbf_s: float | None,
             ceiling: float = COST_CEILING) -> int:
    """Steps between snapshots (the module's rules). `mtbf_s`: the run's observed mean time
    between failures (None: no failure seen)."""
    if not step_s > 0:
        return 1
    cost = max(cost_s, 0.0)
    by_ceiling = math.ceil(cost / (ceiling * step_s) - 1e-9)
    by_write = math.ceil(write_s / step_s - 1e-9)
    by_failures = 0
    if mtbf_s is not None and mtbf_s > 0:
        by_failures = math.floor(math.sqrt(2 * cost * mtbf_s) / step_s)
    return max(1, by_ceiling, by_write, by_failures)


class Costs:
    """The moving estimate: the durations of recent steps with a snapshot beside them and
    without one. It spans attempts (`state`, `from_state`): an attempt killed within a few
    steps adds what it measured to what the ones before it did."""

    def __init__(self) -> None:
        self.beside: deque[float] = deque(maxlen=WINDOW)
        self.clean: deque[float] = deque(maxlen=WINDOW)
        self._held = 0  # steps still to pass unmeasured (`hold`)

    def state(self) -> dict[str, list[float]]:
        return {"beside": list(self.beside), "clean": list(self.clean)}

    @classmethod
    def from_state(cls, state: object) -> Costs:
        """What `state` returned (read back from a file): lists of step durations; anything
        else (a missing or damaged file) is an empty estimate."""
        out = cls()
        if isinstance(state, dict):
            for name in ("beside", "clean"):
                got = state.get(name)
                if isinstance(got, list):
                    getattr(out, name).extend(
                        float(x) for x in got[-WINDOW:]
                        if isinstance(x, (int, float)) and not isinstance(x, bool)
                        and 0 < x < 86400)
        return out

    def hold(self, steps: int) -> None:
        """The next `steps` steps paid for something else beside their own work (a snapshot
        that made its files new, the live state's adoption, rtrain's copy of a disk save):
        measured as neither kind. Counted, they made a snapshot look 2-4 times its cost after
        each relaunch, and the interval 2-4 times too long."""
        self._held = max(self._held, steps)

    def step(self, seconds: float | None, snapshot: bool) -> None:
        """One step's duration, beside a snapshot or not; None: not measured (an attempt's
        first steps), though it passes a held step all the same."""
        if self._held:
            self._held -= 1
        elif seconds is not None:
            (self.beside if snapshot else self.clean).append(seconds)

    def step_s(self) -> float | None:
        """The step time without a snapshot (median), None before any."""
        return statistics.median(self.clean) if self.clean else None

    def cost_s(self) -> float | None:
        """What a snapshot adds to the step it runs beside; None until both kinds have
        MIN_SAMPLES."""
        if len(self.beside) < MIN_SAMPLES or len(self.clean) < MIN_SAMPLES:
            return None
        return max(0.0, statistics.median(self.beside) - statistics.median(self.clean))
