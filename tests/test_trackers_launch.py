"""One run, one curve: a script logging every step to W&B (offline), TensorBoard and MLflow (a
local file store) under `rtrain launch`, SIGKILLed twice and out of memory once (degraded), read
back with each tracker's own reader (tests/children/tracker_train.py). Each resumed attempt
logs again the steps from its checkpoint to the failure; every reader sees one run, each step
once and in order, and the three restarts marked. A second launch on a fresh run dir and
checkpoint dir, resuming from the mirror as a new machine does, continues the same tracker
runs."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from harness import CHILDREN, events, launch

from rtrain.checkpoint import runid
from rtrain.supervisor.mirror.store import open_mirror

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trackers")]

STEPS, KILL0, KILL1, OOM = 25, 8, 14, 19
RESUMED = [None, 5, 10, 15]  # a checkpoint every 5 steps
TRACKERS_ENV = {
    "WANDB_MODE": "offline", "WANDB_SILENT": "true",
    # A SIGKILL loses what W&B had not yet written to its offline file (every 15 s by default).
    "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": "0.1",
    # MLflow 3 asks for a database store; a directory needs no sqlalchemy (mlflow-skinny).
    "MLFLOW_ALLOW_FILE_STORE": "true",
}


@pytest.fixture(scope="session")
def tracked(tmp_path_factory):
    """The launch every test here reads, made once per pytest session. Under pytest-xdist these
    tests can land on several workers (--dist loadgroup's xdist_group is lost with pytest 9.2:
    pytest-xdist issue 1386), and each worker has its own session fixtures: the first makes the
    run in the session's shared temporary dir while the others wait on a lock, then read it."""
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent  # every worker's basetemp is a folder of the session's
    base = shared / "trackers"
    out, run, result = base / "out", base / "run", base / "launch.json"
    with open(shared / "trackers.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            shutil.rmtree(base, ignore_errors=True)  # a worker that died half-way
            out.mkdir(parents=True)
            r = launch(run, "--set", "batch_size=8", "--set", "grad_accum=1",
                       str(CHILDREN / "tracker_train.py"), str(STEPS), str(out), str(KILL0),
                       str(KILL1), str(OOM), env=TRACKERS_ENV, timeout=150)
            result.write_text(json.dumps({"returncode": r.returncode,
                                          "stderr": r.stderr[-3000:]}))
    launched = json.loads(result.read_text())
    assert launched["returncode"] == 0, launched["stderr"]
    return run, out


def _attempts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]


def test_three_failures_each_attempt_with_the_run_identity(tracked):
    run, out = tracked
    exits = events(run, "exit")
    assert [e["signal"] for e in exits[:2]] == ["SIGKILL", "SIGKILL"]
    assert [c["failure"] for c in events(run, "classification")][2] == "oom_gpu"
    assert [d["change"].split(",")[0] for d in events(run, "degrade")] == ["batch_size 8 -> 4"]
    seen = _attempts(out)
    assert [a["resumed_step"] for a in seen] == RESUMED
    ident = runid.read(run / "checkpoints")
    assert {a["RTRAIN_RUN_ID"] for a in seen} == {a["WANDB_RUN_ID"] for a in seen} == {ident}
    assert {a["WANDB_RESUME"] for a in seen} == {"allow"}
    # MLflow's id only once the run exists: the first attempt created it.
    mlflow_ids = [a["MLFLOW_RUN_ID"] for a in seen]
    assert mlflow_ids[0] is None and len(set(mlflow_ids[1:])) == 1


# --- TensorBoard --------------------------------------------------------------------------------

def _tb_raw(tb: Path) -> list:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [e for f in sorted(tb.glob("events.out.tfevents.*"))
            for e in EventFileLoader(str(f)).Load()]


def test_tensorboard_shows_each_step_once_and_the_restarts(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = tracked
    raw = _tb_raw(out / "tb")
    logged = [e.step for e in raw if e.HasField("summary")
              and any(v.tag == "loss" for v in e.summary.value)]
    assert len(logged) > len(set(logged)), "the resumed attempts logged no step again"
    starts = [e.step for e in raw if e.HasField("session_log")]
    assert starts == RESUMED[1:]  # SummaryWriter(purge_step=ckpt.resumed_step)

    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [s.step for s in acc.Scalars("loss")] == list(range(STEPS))
    marks = acc.Scalars("rtrain/attempt")
    assert [m.value for m in marks] == [1, 2, 3]
    assert all(r < m.step for r, m in zip(RESUMED[1:], marks, strict=True))
    texts = [t.tensor_proto.string_val[0].decode()
             for t in acc.Tensors("rtrain/restart/text_summary")]
    assert ["crash" in texts[0], "crash" in texts[1], "oom_gpu" in texts[2]] == [True] * 3
    assert "degraded: batch_size 8 -> 4" in texts[2]
    assert [m.value for m in acc.Scalars("rtrain/steps_again")] == [
        e["steps_lost"] for e in events(tracked[0], "recovery")]


# --- MLflow -------------------------------------------------------------------------------------

def _mlflow(out: Path):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client, client.search_runs(experiments)


def test_mlflow_one_run_each_step_once_and_the_restarts(tracked, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run, out = tracked
    client, runs = _mlflow(out)
    assert len(runs) == 1
    [r] = runs
    assert r.data.tags["rtrain.run"] == runid.read(run / "checkpoints")
    assert r.info.run_id == _attempts(out)[1]["MLFLOW_RUN_ID"]
    assert [m.step for m in client.get_metric_history(r.info.run_id, "loss")] == list(
        range(STEPS))
    # MLflow cannot drop a value: the replayed steps keep what the attempt before logged
    # (attempt 2 reached step OOM at batch size 8), the degraded batch shows from the next on.
    sizes = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "batch_size")}
    assert (sizes[RESUMED[3]], sizes[OOM], sizes[OOM + 1]) == (8, 8, 4)
    marks = client.get_metric_history(r.info.run_id, "rtrain/attempt")
    assert [m.value for m in marks] == [1, 2, 3]
    notes = [r.data.tags[f"rtrain.restart.{a}"] for a in (1, 2, 3)]
    assert "after attempt 0 crash" in notes[0] and "after attempt 2 oom_gpu" in notes[2]


# --- W&B ----------------------------------------------------------------------------------------

_BLOCK = 32 * 1024


def _wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (`run-<id>.wandb`), parsed with W&B's own protobuf
    classes. The container is LevelDB's log format behind a 7-byte W&B header; a record torn
    by a kill ends the list."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, parts, pos = [], [], 7
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):
            break
        parts = [] if kind in (1, 2) else parts
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            out.append(record)
    return out


def _wandb_attempts(out: Path) -> list[tuple[str, int | None, list[dict]]]:
    """Each attempt's offline run, in order: its id, the step it rewound to, its rows."""
    runs = []
    for d in sorted((out / "wandb").glob("offline-run-*")):
        [f] = d.glob("run-*.wandb")
        ident, branch, rows = None, None, []
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ident = rec.run.run_id
                if rec.run.HasField("branch_point"):
                    branch = int(rec.run.branch_point.value)
            elif kind == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                             for i in rec.history.item})
        runs.append((ident, branch, rows))
    return runs


def _wandb_history(attempts) -> list[dict]:
    """The run as W&B keeps it: a rewind drops what follows its step, then the attempt
    appends its rows."""
    history: list[dict] = []
    for _, branch, rows in attempts:
        if branch is not None:
            history = [h for h in history if h["_step"] <= branch]
        history += rows
    return history


def test_wandb_rewinds_the_run_at_each_resume(tracked):
    run, out = tracked
    attempts = _wandb_attempts(out)
    assert {a[0] for a in attempts} == {runid.read(run / "checkpoints")}
    assert [a[1] for a in attempts] == [None] + [k - 1 for k in RESUMED[1:]]
    # Each killed attempt logged past the step the next one rewinds to.
    assert all(max(r["_step"] for r in rows) > nxt[1]
               for (_, _, rows), nxt in itertools.pairwise(attempts))
    history = _wandb_history(attempts[:len(RESUMED)])
    assert [h["_step"] for h in history] == list(range(STEPS))
    # The replayed steps are the degraded attempt's: batch size 4 from its resumed step on.
    assert [h["batch_size"] for h in history[RESUMED[3] - 1:RESUMED[3] + 1]] == [8, 4]
    marks = [h for h in history if "rtrain/attempt" in h]
    assert [h["rtrain/attempt"] for h in marks] == [1, 2, 3]
    assert "oom_gpu" in marks[2]["rtrain/restart"]


# --- A fresh machine ------------------------------------------------------------------------------

MORE = 27  # the continuation runs on to this step


@pytest.fixture(scope="module")
def continued(tracked):
    """The run continued on a fresh machine: a new run dir and checkpoint dir, resuming from
    the mirror, which holds the first machine's checkpoint-20."""
    run, first = tracked
    mirror = run.parent / "mirror"
    open_mirror(str(mirror)).upload(run / "checkpoints" / "checkpoint-20")
    out = run.parent / "fresh-out"  # the trackers' files as the first machine left them
    shutil.copytree(first, out)
    fresh = run.parent / "fresh-run"
    r = launch(fresh, "--ckpt-dir", str(run.parent / "fresh-ckpt"), "--mirror", str(mirror),
               "--set", "batch_size=4", "--set", "grad_accum=2",
               str(CHILDREN / "tracker_train.py"), str(MORE), str(out), "-1", "-1", "-1",
               env={**TRACKERS_ENV, "RTRAIN_CACHE_DIR": str(run.parent / "cache")},
               timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [e["kind"] for e in events(fresh, "mirror_downloaded")] == ["mirror_downloaded"]
    return run, fresh, out


@pytest.mark.soak  # a second launch on fresh dirs; the identity's survival is table-tested
def test_a_fresh_machine_continues_the_same_tracker_runs(continued, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run, fresh, out = continued
    ident = runid.read(run / "checkpoints")
    assert runid.read(fresh.parent / "fresh-ckpt") == ident
    last = _attempts(out)[-1]
    assert (last["attempt"], last["resumed_step"], last["RTRAIN_RUN_ID"]) == (0, 20, ident)
    assert last["MLFLOW_RUN_ID"] is None  # no record in the new run dir: found by its tag

    client, runs = _mlflow(out)
    assert len(runs) == 1
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")] == list(
        range(MORE))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [s.step for s in acc.Scalars("loss")] == list(range(MORE))

    attempts = _wandb_attempts(out)
    assert attempts[-1][:2] == (ident, 19)
    assert [h["_step"] for h in _wandb_history(attempts)] == list(range(MORE))
