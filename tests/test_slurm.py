"""rtrain under a real one-node Slurm: preempted by the batch signal, requeued, resumed, finished.

`scripts/slurm/local-cluster.sh start` installs Slurm where apt-get can and starts munged,
slurmctld and slurmd on this host; the test submits `scripts/slurm/train.sbatch` as a user would,
sends the preemption signal with `scancel --signal=USR1 --batch`, releases the requeued job with
`scontrol update StartTime=now` (else Slurm holds it back for minutes) and asserts on the run's
events.jsonl and the training script's own log. Skipped, with the reason, where the daemons cannot
start (not root, no apt-get, no network); RTRAIN_REQUIRE_SLURM=1 turns that skip into a failure.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tuned
from harness import REPO

from rtrain.supervisor.proc import slurm
from rtrain.supervisor.records.events import read_events
from rtrain.supervisor.records.runstate import load_state

# One cluster per machine (its daemons, /etc/slurm): every test that starts one runs on one
# pytest-xdist worker (scripts/test.sh runs --dist loadgroup), one module after the other, and
# waits for a cluster another pytest session holds (`running_cluster`): minutes, which the
# timeout allows for.
pytestmark = [pytest.mark.xdist_group("slurm"), pytest.mark.timeout(600)]

CLUSTER = REPO / "scripts" / "slurm" / "local-cluster.sh"
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
CANNOT_START = 3  # local-cluster.sh: this machine cannot run the cluster

# Small and fast: 200 steps take a few seconds on an idle CPU, yet leave time to preempt mid-run.
# A save_every past the end leaves the checkpoint written on the stop signal as the only one, so
# resuming from it proves that no executed step was lost.
TRAIN_ARGS = ["--set", "steps=200", "--set", "batch_size=8", "--set", "resolution=16",
              "--set", "log_every=1", "--set", "save_every=100000", "-q"]
STEPS = 200



# Events beside the sequence these tests check: progress, the warm standby, a failure's cost.
BESIDE = ("heartbeat_summary", "lock_takeover", "standby_ready", "standby_discarded",
          "standby_failed", "recovery", "cadence", "memory_tier", "snapshot_persisted")

def _cluster(action: str, timeout: float, nodes: int = 1) -> subprocess.CompletedProcess:
    env = None if nodes == 1 else {**os.environ, "NODES": str(nodes)}
    return subprocess.run(["bash", str(CLUSTER), action], capture_output=True, text=True,
                          timeout=timeout, env=env)


def running_cluster(nodes: int = 1) -> Iterator[None]:
    """A running local cluster of `nodes` slurmd daemons (the body of a module fixture);
    stopped afterwards if this started it. Skips where the machine cannot run one. The machine
    has one cluster: a lock file held meanwhile makes any other pytest session (or worker) that
    wants one wait for this one to end."""
    with open(Path(tempfile.gettempdir()) / "rtrain-test-slurm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _running_cluster(nodes)


def _running_cluster(nodes: int) -> Iterator[None]:
    before = _cluster("status", 30, nodes).stdout
    was_running = before.count(": running") >= 2 + nodes  # munged, slurmctld, each slurmd
    r = _cluster("start", 300, nodes)  # the first start installs slurm-wlm and munge (~15 s)
    if r.returncode == CANNOT_START:
        reason = (f"no local {nodes}-node Slurm cluster: "
                  f"{r.stderr.strip().splitlines()[-1]}")
        if os.environ.get("RTRAIN_REQUIRE_SLURM") == "1":
            pytest.fail(f"{reason}\n{r.stderr}")
        pytest.skip(reason)
    try:
        assert r.returncode == 0, f"NODES={nodes} local-cluster.sh start failed:\n{r.stderr}"
        yield
    finally:
        if not was_running:
            _cluster("stop", 60, nodes)


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[None]:
    """A running one-node cluster; stopped afterwards if this fixture started it."""
    yield from running_cluster(1)


def _slurm(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        pytest.fail(f"{' '.join(argv)} failed: {r.stderr.strip()}")
    return r


def _job_field(job: str, name: str) -> str | None:
    """A field of `scontrol show job` (JobState, Restarts...), None once Slurm forgot the job."""
    r = _slurm("scontrol", "show", "job", job, check=False)
    m = re.search(rf"\b{name}=(\S+)", r.stdout)
    return m.group(1) if r.returncode == 0 and m else None


def _events(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    return read_events(path) if path.exists() else []


def _steps(log: Path) -> list[int]:
    text = log.read_text() if log.exists() else ""
    return [int(m) for m in re.findall(r"^step (\d+) ", text, re.M)]


def _wait(what: str, ready: Callable[[], bool], timeout: float,
          diagnose: Callable[[], str]) -> float:
    """Poll `ready` until true; returns the seconds it took, fails with `diagnose()` on timeout."""
    t0 = time.monotonic()
    while not ready():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"{what}: not within {timeout:g} s\n{diagnose()}")
        time.sleep(0.1)
    return time.monotonic() - t0


def test_job_info_names_the_job_and_its_restart_count():
    assert slurm.job_info({}) is None
    assert slurm.job_info({"SLURM_JOB_ID": "42"}) == {"job_id": "42", "restart_count": 0,
                                                      "array": None}
    array_task = {"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3",
                  "SLURM_RESTART_COUNT": "2"}
    assert slurm.job_info(array_task) == {"job_id": "43", "restart_count": 2, "array": "40_3"}
    assert slurm.job_id(array_task) == "40_3"  # what `scontrol requeue` is given


@pytest.mark.slow
@pytest.mark.parametrize(("state", "requeued"), [("RUNNING", True), ("COMPLETING", False)])
def test_requeue_only_a_job_slurm_is_not_already_ending(tmp_path, monkeypatch, state, requeued):
    calls = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {shlex.quote(str(calls))}\n"
                    f"[ \"$1\" = show ] && echo 'JobId=7 JobName=x JobState={state} Reason=None'\n"
                    "exit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    done, what = slurm.requeue({"SLURM_JOB_ID": "7"})
    assert done is requeued, what
    assert ("requeue 7" in calls.read_text().splitlines()) is requeued
    if not requeued:
        assert "JobState=COMPLETING" in what and "not requeueing" in what


class Job:
    """`scripts/slurm/train.sbatch` submitted as a user would, its run dir under `tmp`."""

    def __init__(self, tmp: Path, *train_args: str, script: Path = SBATCH,
                 time_limit: str = "00:10:00") -> None:
        self.run, logs, bin_dir = tmp / "run", tmp / "logs", tmp / "bin"
        logs.mkdir()
        bin_dir.mkdir()
        # `rtrain` on the job's PATH, as after `pip install`: this checkout, this interpreter
        # (with the tuning constants of a $TUNING_FILE a test set: tests/tuned.py).
        wrapper = bin_dir / "rtrain"
        wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} "
                           f"{shlex.quote(str(REPO / 'tests' / 'tuned.py'))} \"$@\"\n")
        wrapper.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RTRAIN_")
               and (not k.startswith("SLURM_") or k == "SLURM_CONF")}
        env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", RUN_DIR=str(self.run),
                   OMP_NUM_THREADS="1")  # one thread: a busy CI machine slows it the least
        r = subprocess.run(["sbatch", "--parsable", "--job-name=rtrain-test",
                            f"--time={time_limit}", f"--output={logs}/slurm-%j.log",
                            f"--chdir={REPO}", str(script),
                            *train_args], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"sbatch failed: {r.stderr}"
        self.id = r.stdout.strip().split(";")[0]
        self.log = logs / f"slurm-{self.id}.log"

    def stdout(self, attempt: int) -> Path:
        return self.run / "attempts" / str(attempt) / "stdout.log"

    def state(self) -> str | None:
        return _job_field(self.id, "JobState")

    def wait(self, what: str, ready: Callable[[], bool], timeout: float) -> float:
        return _wait(what, ready, timeout, self.diagnose)

    def diagnose(self) -> str:
        parts = [f"job {self.id}: {_slurm('scontrol', 'show', 'job', self.id, check=False).stdout}"]
        for p in (self.log, self.run / "events.jsonl", self.stdout(0), self.stdout(1)):
            tail = p.read_text()[-3000:] if p.exists() else "(missing)"
            parts.append(f"--- {p}:\n{tail}")
        return "\n".join(parts)

    def cancel(self) -> None:
        _slurm("scancel", self.id, check=False)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the Slurm test needs Linux")
def test_preempted_job_requeues_and_resumes_with_zero_lost_steps(slurm_cluster, tmp_path):
    j = Job(tmp_path, *TRAIN_ARGS)
    job, run, slurm_log, diagnose = j.id, j.run, j.log, j.diagnose
    first, second = j.stdout(0), j.stdout(1)
    try:
        timings = {"stepping": _wait("first run stepping (step 5 in its log)",
                                     lambda: len(_steps(first)) >= 5, 90, diagnose)}

        # Preempt: the signal Slurm sends at --signal=B:USR1@120, to the batch shell only.
        _slurm("scancel", "--signal=USR1", "--batch", job)
        t0 = time.monotonic()
        timings["stop_and_requeue"] = _wait(
            "rtrain saved, requeued and exited",
            lambda: any(e["kind"] == "requeue" for e in _events(run))
            and _job_field(job, "JobState") == "PENDING", 60, diagnose)
        assert _job_field(job, "Restarts") == "1"

        # Release it now: a requeued job is otherwise held back for the credential lifetime
        # (cred_expire, 120 s). Not within the second of the requeue, though: slurmd revoked the
        # old run's credential with a timestamp in whole seconds and rejects a new one created in
        # the same second ("Job credential revoked"), which fails the job for good.
        time.sleep(2.0)
        _slurm("scontrol", "update", f"JobId={job}", "StartTime=now")
        timings["second_run_done"] = _wait(
            "the requeued run finished",
            lambda: _job_field(job, "JobState") not in ("PENDING", "RUNNING", "CONFIGURING",
                                                        "COMPLETING"), 120, diagnose)
        timings["preempt_to_done"] = time.monotonic() - t0
    finally:
        j.cancel()  # a failed test leaves no job behind
    print(f"Slurm timings (s): {json.dumps({k: round(v, 1) for k, v in timings.items()})}")

    events = _events(run)
    kinds = [e["kind"] for e in events if e["kind"] not in BESIDE]
    assert kinds == ["launch", "signal", "exit", "classification", "decision", "requeue",
                     "launch", "exit", "decision", "finished"], diagnose()
    by_kind = {k: [e for e in events if e["kind"] == k] for k in set(kinds)}
    assert by_kind["signal"][0]["name"] == "SIGUSR1"
    assert by_kind["classification"][0]["failure"] == "preempted"
    assert by_kind["decision"][0]["action"] == "requeue"
    assert by_kind["requeue"][0]["done"] is True, by_kind["requeue"][0]["detail"]
    assert by_kind["decision"][1]["action"] == "finished"

    # The job id and SLURM_RESTART_COUNT are recorded by rtrain and echoed by the batch script.
    assert [{k: e["slurm"][k] for k in ("job_id", "restart_count", "array")}
            for e in by_kind["launch"]] == [
        {"job_id": job, "restart_count": 0, "array": None},
        {"job_id": job, "restart_count": 1, "array": None}]
    # The stop before the time limit was armed too (ten minutes, less the margin); the
    # --signal warning came first.
    assert all(e["slurm"]["stop_at"] < e["slurm"]["end_time"] for e in by_kind["launch"])
    text = slurm_log.read_text()
    assert "SLURM_RESTART_COUNT=0" in text and "SLURM_RESTART_COUNT=1" in text, text
    assert "requeued Slurm job" in text, text  # both runs appended to one log

    # Zero lost steps: the second run starts at the step after the last one the first executed,
    # from the checkpoint saved on the stop signal.
    before, after = _steps(first), _steps(second)
    last = before[-1]
    assert 5 <= last < STEPS
    assert before == list(range(1, last + 1))
    assert by_kind["exit"][0]["last_step"] == last
    assert by_kind["launch"][1]["resume_from"].endswith(f"checkpoint-{last}")
    assert f"resumed at step {last}:" in second.read_text()
    assert after == list(range(last + 1, STEPS + 1))

    state = load_state(run)
    assert state is not None and state.status.value == "finished"
    assert _job_field(job, "JobState") in ("COMPLETED", None)  # None: Slurm already forgot it
    assert _slurm("squeue", "-h", "-j", job, check=False).stdout.strip() == ""


@pytest.mark.slow
@pytest.mark.soak  # a preempted job is the default tier's Slurm run
@pytest.mark.skipif(sys.platform != "linux", reason="the Slurm test needs Linux")
def test_cancelled_job_saves_and_is_not_requeued(slurm_cluster, tmp_path):
    j = Job(tmp_path, *TRAIN_ARGS)
    try:
        j.wait("stepping (step 5 in its log)", lambda: len(_steps(j.stdout(0))) >= 5, 90)
        _slurm("scancel", j.id)  # SIGTERM to every process of the job, as a person cancels it
        j.wait("the job ended", lambda: j.state() not in ("PENDING", "RUNNING", "COMPLETING")
               and any(e["kind"] == "requeue" for e in _events(j.run)), 60)
    finally:
        j.cancel()
    assert j.state() in ("CANCELLED", None) and _job_field(j.id, "Restarts") in ("0", None)
    requeue = next(e for e in _events(j.run) if e["kind"] == "requeue")
    assert requeue["done"] is False and "not requeueing" in requeue["detail"], requeue
    # The child got Slurm's SIGTERM (rtrain's stop signal in the batch script) and saved.
    last = _steps(j.stdout(0))[-1]
    exit_event = next(e for e in _events(j.run) if e["kind"] == "exit")
    assert exit_event["returncode"] == 75 and exit_event["last_step"] == last
    assert (j.run / "checkpoints" / f"checkpoint-{last}").is_dir()
    assert load_state(j.run).status.value == "preempted"


# A batch script like train.sbatch without `--signal`: nothing warns before the time limit.
NO_SIGNAL = """#!/bin/bash
#SBATCH --open-mode=append
#SBATCH --requeue
set -euo pipefail
echo "job ${SLURM_JOB_ID}: SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}"
exec rtrain launch examples/vision/train.py --config "$WALL_TEST_CONFIG" --run-dir "$RUN_DIR" \\
    --resume auto --requeue "$@"
"""
WALL_MARGIN_S = 25.0  # a one-minute job stops 35 s after the job started


@pytest.mark.slow
@pytest.mark.soak  # a preempted job is the default tier's Slurm run
@pytest.mark.skipif(sys.platform != "linux", reason="the Slurm test needs Linux")
def test_time_limit_without_signal_saves_requeues_and_loses_no_step(slurm_cluster, tmp_path,
                                                                    monkeypatch):
    """`--time=1` and no `--signal`: rtrain reads the job's EndTime from Slurm, stops the
    training script WALL_MARGIN_S before it (save, exit 75), requeues the job, and the next run
    resumes at the step after the last one executed."""
    config = REPO / "examples" / "vision" / "rtrain.toml"
    script = tmp_path / "no-signal.sbatch"
    script.write_text(NO_SIGNAL)
    monkeypatch.setenv("WALL_TEST_CONFIG", str(config))
    monkeypatch.setenv(tuned.TUNING_FILE, str(tuned.write(tmp_path, {"slurm": {
        "margin_s": WALL_MARGIN_S}})))
    train = ["--set", "steps=1000000", "--set", "batch_size=8", "--set", "resolution=16",
             "--set", "log_every=1", "--set", "save_every=1000000", "-q"]
    j = Job(tmp_path, *train, script=script, time_limit="1")
    first, second = j.stdout(0), j.stdout(1)
    try:
        j.wait("stopped before the time limit and requeued",
               lambda: any(e["kind"] == "requeue" for e in _events(j.run))
               and j.state() == "PENDING", 120)
        assert _job_field(j.id, "Restarts") == "1"
        time.sleep(2.0)  # not in the second of the requeue (see the preemption test)
        _slurm("scontrol", "update", f"JobId={j.id}", "StartTime=now")
        j.wait("the requeued run stepping", lambda: len(_steps(second)) >= 5, 90)
    finally:
        j.cancel()
    j.wait("the job ended", lambda: j.state() not in ("PENDING", "RUNNING", "COMPLETING"), 60)

    events = _events(j.run)
    kinds = [e["kind"] for e in events if e["kind"] not in BESIDE]
    assert kinds[:7] == ["launch", "wall_clock_stop", "exit", "classification", "decision",
                         "requeue", "launch"], j.diagnose()
    launch, stop = events[kinds.index("launch")], next(e for e in events
                                                         if e["kind"] == "wall_clock_stop")
    # The end is the scheduler's (the job's real start + one minute), the stop came before it.
    job = launch["slurm"]
    assert job["end_time"] is not None and job["margin_s"] == WALL_MARGIN_S
    assert job["stop_at"] == pytest.approx(job["end_time"] - WALL_MARGIN_S)
    assert stop["end_time"] == job["end_time"] and stop["margin_s"] == WALL_MARGIN_S
    exit_event = next(e for e in events if e["kind"] == "exit")
    assert exit_event["returncode"] == 75 and exit_event["time"] < job["end_time"]
    assert 0 <= exit_event["stop_s"] < WALL_MARGIN_S
    assert next(e for e in events if e["kind"] == "classification")["failure"] == "preempted"
    assert next(e for e in events if e["kind"] == "decision")["action"] == "requeue"
    assert next(e for e in events if e["kind"] == "requeue")["done"] is True

    # Zero lost steps: the checkpoint written on the stop holds the last step executed, and the
    # requeued run goes on from the next one; no step runs twice.
    before, after = _steps(first), _steps(second)
    last = before[-1]
    assert before == list(range(1, last + 1)) and exit_event["last_step"] == last
    relaunch = [e for e in events if e["kind"] == "launch"][1]
    assert relaunch["resume_from"].endswith(f"checkpoint-{last}")
    assert relaunch["slurm"]["restart_count"] == 1
    assert after == list(range(last + 1, last + 1 + len(after)))
    print(f"time-limit stop: job {j.id}, last step {last} before the stop, stop took "
          f"{exit_event['stop_s']} s, exit {job['end_time'] - exit_event['time']:.1f} s "
          "before the limit")
