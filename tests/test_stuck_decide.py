"""The stuck-rank rule (supervisor/stuck/decide.py), by table: recorded stack dumps (the DDP
hang of tests/test_dist_stuck.py, paths moved under /home/u) and progress boards in, the
ranks behind and the sentence out."""

from __future__ import annotations

import pytest

from rtrain.supervisor.stuck.decide import Frame, RankState, parse_stacks, ranges, summarise

SITE = "/home/u/venv/lib/python3.11/site-packages"
ROOTS = ("/home/u/rtrain/worker", "/home/u/rtrain/supervisor", "/usr/lib/python3.11")

# faulthandler, rank 3 of 4: asleep in its forward (an injected hang in a forward pre-hook).
FH_FORWARD = f"""\
Current thread 0x00007fe8a805bb80 (most recent call first):
  File "/home/u/rtrain/worker/guards/faults.py", line 165 in _sleep_forever
  File "/home/u/rtrain/worker/guards/faults.py", line 222 in _in_step
  File "/home/u/proj/train.py", line 65 in forward_hook
  File "{SITE}/torch/nn/modules/module.py", line 1821 in inner
  File "{SITE}/torch/nn/modules/module.py", line 1884 in _call_impl
  File "{SITE}/torch/nn/modules/module.py", line 1778 in _wrapped_call_impl
  File "/home/u/proj/train.py", line 88 in <module>
"""
# faulthandler, ranks 0-2: DDP's gradient all-reduce waits for rank 3 inside the backward.
FH_BACKWARD = f"""\
Current thread 0x00007f56c09f1b80 (most recent call first):
  File "{SITE}/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "{SITE}/torch/autograd/__init__.py", line 395 in backward
  File "{SITE}/torch/_tensor.py", line 623 in backward
  File "/home/u/proj/train.py", line 90 in <module>
"""
# py-spy of the same backward, with a second thread (py-spy shortens the paths).
SPY_BACKWARD = """\
Process 20741: /home/u/venv/bin/python -u /home/u/proj/train.py 6
Python v3.11.7 (/usr/bin/python3.11)

Thread 20750 (idle): "pt_autograd_0"
    Condition.wait (threading.py:331)
    Thread._bootstrap (threading.py:1002)
Thread 20741 (idle): "MainThread"
    _engine_run_backward (torch/autograd/graph.py:979)
    backward (torch/autograd/__init__.py:395)
    Tensor.backward (torch/_tensor.py:623)
    <module> (train.py:90)
"""
# faulthandler with a side thread first: the main thread is the one running the module.
FH_THREADS = f"""\
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 2950 in all_reduce
  File "/home/u/rtrain/worker/dist.py", line 72 in any_of
  File "/home/u/rtrain/worker/checkpointer.py", line 243 in _maybe_save
  File "/home/u/proj/train.py", line 95 in <module>
"""
# A rank computing at the line of the loop where the others all-reduce by hand.
FH_COMPUTE_AT_95 = f"""\
Current thread 0x00007f0000000003 (most recent call first):
  File "{SITE}/torch/nn/functional.py", line 2100 in linear
  File "/home/u/rtrain/worker/checkpointer.py", line 243 in _maybe_save
  File "/home/u/proj/train.py", line 95 in <module>
"""


def st(rank, step=4, stack="", *, entered=True, left_at=100.0):
    return RankState(rank=rank, step=step, left_at=left_at,
                     entered_at=left_at + 0.1 if entered else None,
                     frames=parse_stacks(stack))


def test_parse_faulthandler_and_py_spy():
    frames = parse_stacks(FH_FORWARD)
    assert [f.func for f in frames][:3] == ["_sleep_forever", "_in_step", "forward_hook"]
    assert frames[0] == Frame("/home/u/rtrain/worker/guards/faults.py", 165, "_sleep_forever")
    spy = parse_stacks(SPY_BACKWARD)
    assert spy[0] == Frame("torch/autograd/graph.py", 979, "_engine_run_backward")
    assert spy[-1].func == "<module>"  # the MainThread, not the first thread listed
    assert parse_stacks(FH_THREADS)[0].func == "all_reduce"
    assert parse_stacks("no stacks here\n") == ()
    # an appended second dump: the newest counts
    assert parse_stacks(FH_BACKWARD + FH_FORWARD)[0].func == "_sleep_forever"


@pytest.mark.parametrize(("states", "behind", "summary"), [
    # The DDP hang: rank 3 in its forward, the others in the backward of the same step.
    ([st(0, stack=FH_BACKWARD), st(1, stack=FH_BACKWARD), st(2, stack=FH_BACKWARD),
      st(3, stack=FH_FORWARD)], [3],
     "rank 3 is in step 5 (for 9.9 s) at forward_hook (train.py:65), inside _sleep_forever "
     "(faults.py:165); ranks 0-2 wait in step 5 at <module> (train.py:90), inside "
     "_engine_run_backward (graph.py:979)"),
    # A step behind, by the boards alone (no stacks): the others finished step 5.
    ([st(0, 5), st(1, 4), st(2, 5)], [1],
     "rank 1 is in step 5 (for 9.9 s); ranks 0, 2 wait in step 6"),
    # At the boundary after step 4 (not yet in step 5) vs in step 5.
    ([st(0, 4), st(1, 4, entered=False)], [1],
     "rank 1 is at the end of step 4 (for 10 s); rank 0 waits in step 5"),
    # Same line of the loop: the rank in the collective waits for the one still computing.
    ([st(0, stack=FH_THREADS), st(1, stack=FH_COMPUTE_AT_95)], [1],
     "rank 1 is in step 5 (for 9.9 s) at <module> (train.py:95), inside linear "
     "(functional.py:2100); rank 0 waits in step 5 at <module> (train.py:95), waiting in "
     "all_reduce"),
    # Everyone at the same place: nobody behind, and the group is larger than this node.
    ([st(0, stack=FH_BACKWARD), st(1, stack=FH_BACKWARD)], [],
     "no rank is behind: ranks 0-1 wait in step 5 at <module> (train.py:90), inside "
     "_engine_run_backward (graph.py:979) (the group has 8 ranks: the one holding them up is "
     "on another node)"),
    # Different functions at the same step cannot be ordered.
    ([st(0, stack=FH_FORWARD.replace("forward_hook", "other_hook")), st(1, stack=FH_FORWARD)],
     [],
     None),
    # A rank before its first step (no board step) and one in step 1.
    ([RankState(rank=0), st(1, 0)], [],
     None),
])
def test_who_is_behind(states, behind, summary):
    report = summarise(states, now=110.0, world=8, library_roots=ROOTS)
    assert report is not None
    assert list(report.behind) == behind, report.summary
    if summary is not None:
        assert report.summary == summary
    if not behind:
        assert report.summary.startswith(("no rank is behind", "no rank could be named"))


def test_source_lines_and_collectives_in_the_places():
    frames = tuple(f if f.func != "forward_hook" else
                   Frame(f.file, f.line, f.func, "faults.in_step(step=step + 1)")
                   for f in parse_stacks(FH_FORWARD))
    back = st(0, stack=FH_THREADS)
    report = summarise([back, RankState(rank=1, step=4, left_at=100.0, entered_at=100.1,
                                        frames=frames)], now=101.0, library_roots=ROOTS)
    assert report is not None
    places = {p.rank: p for p in report.ranks}
    assert places[1].where.startswith("`faults.in_step(step=step + 1)` in forward_hook")
    assert places[0].collective == "all_reduce" and places[1].collective is None
    assert places[1].behind and places[1].since_s == 0.9
    assert report.to_dict()["behind"] == [1]


def test_a_single_process_is_said_where_it_is():
    report = summarise([st(0, stack=FH_FORWARD)], now=110.0, library_roots=ROOTS)
    assert report is not None and report.behind == (0,)
    assert report.summary == ("rank 0 is in step 5 (for 9.9 s) at forward_hook (train.py:65), "
                              "inside _sleep_forever (faults.py:165)")
    # one rank heard of a larger group (one process per node): no one to name here
    report = summarise([st(0, stack=FH_THREADS)], now=110.0, world=2, library_roots=ROOTS)
    assert report is not None and report.behind == ()
    assert "on another node" in report.summary


def test_nothing_to_report_without_ranks():
    assert summarise([], now=0.0) is None


@pytest.mark.parametrize(("ranks", "text"), [
    ([3], "rank 3"), ([0, 1, 2], "ranks 0-2"), ([5, 0, 1, 2, 7, 8], "ranks 0-2, 5, 7-8"),
])
def test_ranges(ranks, text):
    assert ranges(ranks) == text
