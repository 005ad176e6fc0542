"""The straggler rule by table (supervisor/straggler/decide.py), the tracker fed heartbeats
(track.py), its config, and what status, report, metrics and the worker's heartbeats make of it.
"""

from __future__ import annotations

import random

import pytest
from harness import read_metrics_text, write_events

from rtrain.supervisor.commands.report import gather
from rtrain.supervisor.commands.report_html import render
from rtrain.supervisor.commands.status import render_text, summarize
from rtrain.supervisor.config import Config, StragglerConfig
from rtrain.supervisor.core.errors import ConfigError
from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.metrics.file import MetricsFile
from rtrain.supervisor.straggler.decide import StepSample, StragglerRule, stragglers
from rtrain.supervisor.straggler.track import StragglerTracker

RULE = StragglerRule(factor=1.2, window_steps=20, min_samples=5)


def ranks(n: int, steps: int, busy, *, wait_for_slowest: bool = True, every: int = 2):
    """Samples of `n` ranks in lockstep: `busy(rank, step)` seconds of work per step; with
    `wait_for_slowest` every rank's interval is the slowest's (a per-step collective) and each
    waits the difference."""
    out: dict[int, list[StepSample]] = {r: [] for r in range(n)}
    for step in range(every, steps + 1, every):
        work = {r: busy(r, step) for r in range(n)}
        longest = max(work.values())
        for r in range(n):
            step_s = longest if wait_for_slowest else work[r]
            out[r].append(StepSample(step=step, step_s=step_s, wait_s=step_s - work[r]))
    return out


def noise(seed: int, spread: float):
    rng = random.Random(seed)
    return lambda rank, step: 0.1 * (1 + rng.uniform(-spread, spread))


@pytest.mark.parametrize("name, samples, expected", [
    ("one rank 30% slower, others waiting for it",
     ranks(4, 20, lambda r, s: 0.13 if r == 2 else 0.1), [2]),
    ("one rank 30% slower, no per-step collective",
     ranks(4, 20, lambda r, s: 0.13 if r == 2 else 0.1, wait_for_slowest=False), [2]),
    ("ranks differing by noise (+-15% each step)", ranks(8, 40, noise(1, 0.15)), []),
    ("ranks differing by noise (+-30% each step)", ranks(4, 40, noise(2, 0.3)), []),
    ("slow once (one step 3x), then recovered",
     ranks(4, 20, lambda r, s: 0.3 if (r, s) == (1, 6) else 0.1), []),
    ("slow for the first half of an old window, recovered since",
     ranks(4, 60, lambda r, s: 0.13 if r == 3 and s <= 30 else 0.1), []),
    ("slow only in the newest window",
     ranks(4, 60, lambda r, s: 0.13 if r == 3 and s > 36 else 0.1), [3]),
    ("two ranks: the slow one is named, the fast one is not",
     ranks(2, 20, lambda r, s: 0.13 if r == 1 else 0.1), [1]),
    ("one rank only", ranks(1, 20, lambda r, s: 0.5), []),
    ("no ranks", {}, []),
    ("too few samples in the window", ranks(4, 8, lambda r, s: 0.2 if r == 0 else 0.1), []),
    ("10% slower: below the factor", ranks(4, 20, lambda r, s: 0.11 if r == 0 else 0.1), []),
    ("everyone equally slow", ranks(4, 20, lambda r, s: 0.5), []),
])
def test_the_rule(name, samples, expected):
    assert [s.rank for s in stragglers(samples, RULE)] == expected, name


def test_a_named_straggler_says_by_how_much_and_where_in_the_run():
    (s,) = stragglers(ranks(4, 20, lambda r, step: 0.13 if r == 2 else 0.1), RULE)
    assert s.rank == 2 and s.step == 20 and s.samples == 10
    assert s.busy_s == pytest.approx(0.13) and s.others_busy_s == pytest.approx(0.1)
    assert s.ratio == pytest.approx(1.3)
    assert "rank 2 is 1.30x slower" in s.describe()


def test_a_rank_that_only_waits_is_never_the_straggler():
    # Same intervals everywhere; rank 0 waits most: it is the fastest, not the slowest.
    samples = ranks(4, 20, lambda r, s: 0.05 if r == 0 else 0.1)
    assert stragglers(samples, RULE) == []


@pytest.mark.parametrize("kwargs", [{"factor": 1.0}, {"window_steps": 0}, {"min_samples": 0}])
def test_rule_refuses_numbers_that_mean_nothing(kwargs):
    with pytest.raises(ValueError):
        StragglerRule(**{"factor": 1.2, "window_steps": 10, "min_samples": 3, **kwargs})


def hb(rank, step, step_s, wait_s=0.0, event="step", host="node-a"):
    return Heartbeat(pid=100 + rank, rank=rank, time=0.0, event=event, step=step,
                     step_s=step_s, wait_s=wait_s, host=host)


def test_tracker_reports_once_while_slow_and_again_after_a_recovery():
    t = StragglerTracker(StragglerRule(factor=1.2, window_steps=6, min_samples=3))
    found = []

    def steps(first, last, slow):
        for step in range(first, last + 1):
            for rank in range(3):
                busy = 0.13 if rank == 1 and slow else 0.1
                longest = 0.13 if slow else 0.1
                found.extend((step, f) for f in t.heartbeat(
                    hb(rank, step, longest, longest - busy, host=f"node-{rank}")))

    steps(1, 10, slow=True)
    assert [(step, f.straggler.rank, f.host, f.ranks) for step, f in found] == \
        [(3, 1, "node-1", 3)]
    steps(11, 20, slow=False)  # recovered: nothing said, and forgotten
    assert len(found) == 1 and t.slow == set()
    steps(21, 30, slow=True)
    # Named again once slow steps are more than half of the window (21-24 of 19-24).
    assert [step for step, _ in found] == [3, 24]


def test_tracker_ignores_heartbeats_without_timings():
    t = StragglerTracker(RULE)
    for step in range(1, 30):
        for rank in range(4):
            assert t.heartbeat(hb(rank, step, None)) == []  # an older worker's
            assert t.heartbeat(hb(rank, step, 0.1, event="save_begin")) == []
            assert t.heartbeat(hb(rank, None, 0.1)) == []
    assert t.samples == {}


def test_tracker_keeps_only_the_window():
    t = StragglerTracker(StragglerRule(factor=1.2, window_steps=5, min_samples=3))
    for step in range(1, 101):
        t.heartbeat(hb(0, step, 0.1))
    assert [s.step for s in t.samples[0]] == [96, 97, 98, 99, 100]


def test_config_defaults_and_checks():
    c = Config()
    assert (c.straggler.enabled, c.straggler.factor, c.straggler.window_steps,
            c.straggler.min_samples) == (True, 1.2, 100, 5)
    with pytest.raises(ConfigError, match=r"\[straggler\] exclude_node must be true or false"):
        StragglerConfig(exclude_node="yes")


EVENT = {"attempt": 1, "step": 40, "rank": 2, "host": "gpu-node-7", "ratio": 1.33,
         "busy_s": 0.153, "others_busy_s": 0.115, "ranks": 4, "window_steps": 100,
         "detail": "rank 2 is 1.33x slower than the other ranks (...) on gpu-node-7"}


@pytest.fixture
def run(tmp_path):
    run_dir = tmp_path / "run"
    launch = {"argv": ["torchrun", "train.py"], "resume_from": None, "pid": 100, "settings": {},
              "level": 0}
    write_events(run_dir, [
        ("launch", {**launch, "attempt": 0}),
        ("straggler", {**EVENT, "attempt": 0, "rank": 3, "host": "gpu-node-2",
                       "detail": "rank 3 is slow on gpu-node-2"}),
        ("exit", {"attempt": 0, "returncode": 1, "signal": None, "duration_s": 60.0,
                  "last_step": 60}),
        ("launch", {**launch, "attempt": 1}),
        ("straggler", EVENT),
    ])
    return run_dir


def test_status_shows_the_newest_attempts_stragglers(run):
    s = summarize(run)
    assert [e["rank"] for e in s.stragglers] == [2]  # attempt 0's rank 3 is history
    assert s.stragglers[0]["host"] == "gpu-node-7"
    text = render_text(s)
    assert "straggler:" in text and "rank 2 is 1.33x slower" in text and "gpu-node-7" in text
    assert "rank 3" not in text


def test_report_lists_every_straggler(run):
    rep = gather(run)
    assert [(e["attempt"], e["rank"], e["host"]) for e in rep.stragglers] == \
        [(0, 3, "gpu-node-2"), (1, 2, "gpu-node-7")]
    page = render(rep)
    assert '<section class="stragglers">' in page
    assert 'data-rank="3"' in page and 'data-rank="2"' in page and "gpu-node-7" in page


def test_metrics_count_stragglers_and_show_the_newest_attempts(run, tmp_path):
    from rtrain.supervisor.records.events import read_events

    m = MetricsFile(tmp_path / "m.prom", run_dir=run, ckpt_dir=run / "checkpoints")
    for event in read_events(run / "events.jsonl"):
        m.seed(event)
    m.write()
    values = read_metrics_text((tmp_path / "m.prom").read_text())
    assert [v for (name, _), v in values.items() if name == "rtrain_stragglers_total"] == [2]
    assert [(dict(labels)["rank"], dict(labels)["host"], v) for (name, labels), v
            in values.items() if name == "rtrain_straggler_ratio"] == [("2", "gpu-node-7", 1.33)]


def test_worker_step_heartbeats_carry_step_time_wait_and_host(monkeypatch):
    import socket

    from rtrain.supervisor.proc.heartbeat import HeartbeatReceiver
    from rtrain.worker import runtime

    now = [100.0]
    monkeypatch.setattr(runtime, "_clock", lambda: now[0])
    monkeypatch.setattr(runtime, "_state", runtime._State())
    with HeartbeatReceiver() as rx:
        monkeypatch.setenv("RTRAIN_HEARTBEAT", rx.name)
        monkeypatch.setenv("RTRAIN_STATUS", "/nonexistent")
        runtime._state.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        runtime._state.addr = runtime.socket_address(rx.name)
        runtime.heartbeat(step=1)  # the first step: no interval yet
        for step in range(2, 6):  # 0.125 s steps, each after 0.0625 s waiting for the others
            runtime.boundary_wait(0.0625)
            now[0] += 0.125
            runtime.heartbeat(step=step)
        steps = [h for h in rx.drain() if h.event == "step"]
    assert [h.step for h in steps] == [1, 3, 5]  # throttled to one each 0.2 s
    assert steps[0].step_s is None
    assert [h.step_s for h in steps[1:]] == [0.125, 0.125]
    assert [h.wait_s for h in steps[1:]] == [0.0625, 0.0625]
    assert {h.host for h in steps[1:]} == {socket.gethostname()}


def test_a_rank_hovering_at_the_factor_is_reported_once():
    # Rank 1's busy time alternates between 1.3x and 1.15x of the others' each step: above
    # and below the factor (1.2) by turns, but never back under 1.1 (recovered).
    t = StragglerTracker(StragglerRule(factor=1.2, window_steps=1, min_samples=1))
    found = []
    for step in range(1, 41):
        slow = 0.13 if step % 2 else 0.115
        for rank in range(3):
            busy = slow if rank == 1 else 0.1
            found += t.heartbeat(hb(rank, step, slow, slow - busy))
    assert [f.straggler.rank for f in found] == [1]
