"""Which rank is stuck, end to end: 4 gloo ranks on CPU under `rtrain launch --nproc-per-node 4`,
rank 3 hung inside its forward while the others wait for it in DDP's gradient all-reduce. The
hang's `stuck_ranks` event, the classification, `rtrain status` and `rtrain report` name rank 3
and where it is; the NCCL flight recorder's dumps (a scripted recorder: gloo has none) are asked
for at the hang and kept in the attempt dir."""

from __future__ import annotations

import json

import pytest
import tuned
from harness import CHILDREN, events, launch, run_rtrain


@pytest.mark.slow
def test_rank_stuck_in_its_forward_is_named(tmp_path):
    run = tmp_path / "run"
    # Rank 3 sleeps in its forward of step 5; a short silence is a hang, a short grace (no rank
    # can act on the stop signal), and no relaunch (test_dist_resume's hang test has one).
    (tmp_path / "rtrain.toml").write_text("[hang]\ntimeout_s = 6.0\n"
                                          "[restart]\nmax_restarts = 0\n")
    tuned.write(tmp_path, {"hang": {"grace_s": 1.0}})
    # The flight recorder's files where the user put them, its pipes served by a scripted
    # recorder (gloo has none): rtrain asks for the dumps at the hang and keeps them.
    fr = tmp_path / "fr"
    fr.mkdir()
    r = launch(run, "--nproc-per-node", "4", str(CHILDREN / "dist_train.py"),
               str(tmp_path / "out"), "6", "--width", "8", "--scripted-flight-recorder",
               env={"RTRAIN_FAULTS": "hang_forward@step=5,rank=3",
                    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(fr / "trace_"),
                    "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(fr / "pipe_")}, timeout=150)
    assert events(run, "give_up"), r.stderr[-3000:]
    (stuck,) = events(run, "stuck_ranks")
    assert stuck["behind"] == [3], stuck
    places = {p["rank"]: p for p in stuck["ranks"]}
    assert sorted(places) == [0, 1, 2, 3]
    assert places[3]["step"] == 5 and places[3]["phase"] == "step", places[3]
    assert "forward_hook" in places[3]["where"] and "in_step" in places[3]["where"], places[3]
    for rank in (0, 1, 2):
        assert not places[rank]["behind"]
        assert places[rank]["step"] == 5 and "loss.backward()" in places[rank]["where"]
    summary = stuck["summary"]
    assert summary.startswith("rank 3 is in step 5"), summary
    assert "ranks 0-2 wait in step 5 at `loss.backward()`" in summary, summary
    attempt = run / "attempts" / "0"
    assert stuck["flight_recorder"] == [str(attempt / f"trace_{n}") for n in range(4)]
    assert (attempt / "trace_3").read_text() == "scripted trace of rank 3"
    (cls,) = events(run, "classification")
    assert cls["failure"] == "hang" and summary in cls["reason"], cls
    status = run_rtrain("status", str(run), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["stuck"]["summary"] == summary
    text = run_rtrain("status", str(run))
    assert "stuck ranks" in text.stdout and "attempt 0: rank 3 is in step 5" in text.stdout
    report = run_rtrain("report", str(run))
    assert report.returncode == 0, report.stderr
    assert "rank 3 is in step 5" in (run / "report.html").read_text()
