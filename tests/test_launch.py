"""`rtrain launch` end to end: a real supervisor process, real children, real signals.

Each test asserts the sequence of events in events.jsonl, not scraped log text.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import tuned
from harness import CHILDREN, child_env, events, gone, kinds, launch, launch_cmd, wait_for_text

from rtrain.supervisor.records.runstate import load_state


@pytest.mark.slow
def test_crash_once_then_succeed(tmp_path):
    run = tmp_path / "run"
    r = launch(run, str(CHILDREN / "fail_first_attempts.py"), "1", "7")
    assert r.returncode == 0, r.stderr
    # Nothing saved: the fresh relaunch is said (cannot_resume: nothing hands it a checkpoint).
    assert kinds(run) == ["launch", "exit", "classification", "decision", "cannot_resume",
                          "launch", "exit", "decision", "finished"]
    cls = events(run, "classification")[0]
    assert cls["failure"] == "crash" and "exited with code 7" in cls["reason"]
    assert events(run, "launch")[1]["attempt"] == 1
    assert load_state(run).status.value == "finished"
    assert (run / "attempts" / "0" / "stderr.log").read_text().endswith("flaky failure 0\n")


@pytest.mark.slow
def test_startup_failure_is_not_retried(tmp_path):
    run = tmp_path / "run"
    r = launch(run, str(CHILDREN / "import_fails.py"))
    assert r.returncode == 3
    assert kinds(run) == ["launch", "exit", "classification", "decision", "give_up"]
    cls = events(run, "classification")[0]
    assert cls["failure"] == "startup" and "ModuleNotFoundError" in cls["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("via", ["template", "settings"])
def test_gpu_oom_steps_down_the_ladder_keeping_the_effective_batch(tmp_path, via):
    run = tmp_path / "run"
    args = ["--bs", "{batch_size}"] if via == "template" else []
    r = launch(run, "--set", "batch_size=32", "--set", "grad_accum=1",
               str(CHILDREN / "print_cuda_oom.py"), "8", *args)
    assert r.returncode == 0, r.stderr
    launches = events(run, "launch")
    assert [(e["settings"]["batch_size"], e["settings"]["grad_accum"]) for e in launches] == \
        [(32, 1), (16, 2), (8, 4)]
    assert [e["failure"] for e in events(run, "classification")] == ["oom_gpu", "oom_gpu"]
    assert len(events(run, "degrade")) == 2
    if via == "template":
        assert launches[-1]["argv"][-2:] == ["--bs", "8"]
    assert load_state(run).history.level == 2


@pytest.mark.slow
def test_oom_at_the_ladder_floor_gives_up_saying_what_was_tried(tmp_path):
    run = tmp_path / "run"
    r = launch(run, "--set", "batch_size=2", str(CHILDREN / "print_cuda_oom.py"), "0")
    assert r.returncode == 1
    reason = events(run, "give_up")[0]["reason"]
    assert "floor" in reason and "batch_size" in reason


@pytest.mark.slow
def test_nonfinite_rolls_back_one_checkpoint_and_cuts_lr(tmp_path):
    run = tmp_path / "run"
    r = launch(run, "--set", "lr=0.1", str(CHILDREN / "nonfinite_loss.py"))
    assert r.returncode == 0, r.stderr
    second = json.loads((run / "attempts" / "1" / "stdout.log").read_text())
    assert second["resume_from"].endswith("checkpoint-1")
    assert second["settings"]["lr"] == pytest.approx(0.05)
    assert events(run, "classification")[0]["failure"] == "nonfinite"


@pytest.mark.slow
def test_preemption_exits_75_and_the_same_command_continues(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(launch_cmd(run, str(CHILDREN / "heartbeat_steps.py"), "100000"),
                            env=child_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    wait_for_text(run / "attempts" / "0" / "stdout.log", "step 20")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 75, err
    assert "stop requested at step" in (run / "attempts" / "0" / "stdout.log").read_text()
    assert [e["name"] for e in events(run, "signal")] == ["SIGTERM"]
    assert events(run, "decision")[-1]["action"] == "exit_preempted"
    assert load_state(run).status.value == "preempted"
    r = launch(run, str(CHILDREN / "heartbeat_steps.py"), "30")
    assert r.returncode == 0, r.stderr
    assert events(run, "launch")[-1]["attempt"] == 1


@pytest.mark.slow
def test_child_ignoring_the_stop_signal_is_killed_after_the_grace(tmp_path):
    run = tmp_path / "run"
    child = CHILDREN / "ignore_sigterm.py"
    proc = subprocess.Popen(launch_cmd(run, "--grace", "1", str(child)), env=child_env(),
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    wait_for_text(run / "attempts" / "0" / "stdout.log", "ready")
    pid = events(run, "launch")[0]["pid"]
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 75
    assert 0.9 < time.monotonic() - t0 < 10
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "did not save and exit within the grace" in events(run, "classification")[0]["reason"]


@pytest.mark.slow
def test_grandchildren_left_behind_are_swept(tmp_path):
    run = tmp_path / "run"
    pids_file = tmp_path / "pids"
    r = launch(run, str(CHILDREN / "leave_grandchildren.py"), str(pids_file))
    assert r.returncode == 0, r.stderr
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2
    for pid in pids:
        assert not psutil.pid_exists(pid) or \
            psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.parametrize("how", ["silent", "sigstop", "selfstop"])
def test_hang_is_detected_stacks_dumped_and_relaunched(tmp_path, how):
    # selfstop: the child stops itself, and the stop signal that ends its hang (SIGCONT follows
    # it) lets it save and exit 75: still a hang, charged to the hang budget, not a preemption.
    # silent and sigstop cannot act on the stop signal and wait out the whole grace: a short one
    # (this child, without torch, exits within milliseconds of the signal when it can).
    tuned.write(tmp_path, {"hang": {"floor_s": 1.0, "multiple": 2.0, "warmup_steps": 3,
                                    "grace_s": 4.0}})
    run = tmp_path / "run"
    t0 = time.monotonic()
    r = launch(run, str(CHILDREN / "heartbeat_steps.py"), "120", how, "80")
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 30
    cls = events(run, "classification")[0]
    assert cls["failure"] == "hang"
    assert ("exited with code 75" in cls["reason"]) == (how == "selfstop"), cls["reason"]
    assert events(run, "decision")[0]["action"] == "relaunch"
    stacks = list((run / "attempts" / "0").glob("stacks-*.txt"))
    assert stacks, "no stack dump in the attempt dir"
    text = "\n".join(p.read_text(errors="replace") for p in stacks)
    assert "heartbeat_steps.py" in text


@pytest.mark.slow
def test_a_job_suspended_with_rtrain_is_not_a_hang(tmp_path):
    # Slurm's `scontrol suspend` stops every process of the job, rtrain included, and
    # continues them later (in no fixed order): the stopped time is no one's silence.
    tuned.write(tmp_path, {"hang": {"floor_s": 3.0, "multiple": 2.0, "warmup_steps": 3}})
    run = tmp_path / "run"
    proc = subprocess.Popen(launch_cmd(run, str(CHILDREN / "heartbeat_steps.py"), "250"),
                            env=child_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_text(run / "attempts" / "0" / "stdout.log", "step 60")
        child = events(run, "launch")[0]["pid"]
        proc.send_signal(signal.SIGSTOP)
        os.killpg(child, signal.SIGSTOP)
        time.sleep(7)  # past the learned timeout (3 s) and the loop's NOT_RUNNING_S
        proc.send_signal(signal.SIGCONT)  # rtrain first: the child is still stopped a moment
        time.sleep(0.3)
        try:
            os.killpg(child, signal.SIGCONT)
        except ProcessLookupError:
            pass
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert events(run, "classification") == [], events(run, "classification")
    assert "rtrain did not run for" in err


@pytest.mark.slow
def test_plain_script_hang_by_silence(tmp_path):
    run = tmp_path / "run"
    r = launch(run, "--hang-timeout", "1", str(CHILDREN / "hang.py"),
               timeout=60)
    # hang.py hangs in every attempt and never checkpoints: after 3 attempts without a newer
    # checkpoint rtrain calls it a crash loop and gives up.
    assert r.returncode == 1
    assert [e["failure"] for e in events(run, "classification")] == ["hang"] * 3
    assert "crash loop" in events(run, "give_up")[0]["reason"]


@pytest.mark.slow
def test_second_supervisor_on_the_same_run_refuses_with_exit_4(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(launch_cmd(run, str(CHILDREN / "heartbeat_steps.py"), "100000"),
                            env=child_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_text(run / "attempts" / "0" / "stdout.log", "step 3")
        r = launch(run, str(CHILDREN / "heartbeat_steps.py"), "10")
        assert r.returncode == 4
        assert r.stderr.count("\n") == 1 and "already supervised" in r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


@pytest.mark.slow
def test_supervisor_killed_takes_the_child_with_it(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(launch_cmd(run, str(CHILDREN / "heartbeat_steps.py"), "100000"),
                            env=child_env(), cwd=tmp_path, stderr=subprocess.DEVNULL)
    wait_for_text(run / "attempts" / "0" / "stdout.log", "step 3")
    pid = events(run, "launch")[0]["pid"]
    proc.kill()
    proc.wait()
    # gone() counts a zombie as dead: earlier in-process tests made pytest a subreaper, so
    # the killed child may linger unreaped as pytest's zombie.
    assert gone(pid), "the child outlived its SIGKILLed supervisor"
    r = launch(run, str(CHILDREN / "heartbeat_steps.py"), "5")  # the stale lock is taken over
    assert r.returncode == 0, r.stderr


def test_usage_errors_are_one_line_with_exit_2(tmp_path, rtrain):
    # Refused before anything starts: the CLI in this process (no interpreter start to test).
    def launch(run_dir, *args):
        return rtrain("launch", "--run-dir", str(run_dir), "-q", "--no-backoff", *args,
                      cwd=tmp_path)

    r = launch(tmp_path / "run", "--set", "batch_size=8", str(CHILDREN / "fail_first_attempts.py"),
               "--bs", "{batchsize}")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert "{batchsize} but there is no setting of that name" in r.stderr
    (tmp_path / "rtrain.toml").write_text("[restart]\nmax_restart = 3\n")
    r = launch(tmp_path / "run", str(CHILDREN / "fail_first_attempts.py"), "0", "0")
    assert r.returncode == 2 and "did you mean 'max_restarts'" in r.stderr
    assert "Traceback" not in r.stderr
    (tmp_path / "rtrain.toml").write_text("[hang]\nfloor_s = 100\n")
    r = launch(tmp_path / "run", str(CHILDREN / "fail_first_attempts.py"), "0", "0")
    assert r.returncode == 2 and "[hang] floor_s is not a setting: rtrain holds it at 60.0" \
        in r.stderr
    (tmp_path / "rtrain.toml").unlink()
    r = launch(tmp_path / "run", "no_such_train.py")
    assert r.returncode == 2 and "no such script 'no_such_train.py'" in r.stderr
    r = launch(tmp_path / "run", "--retry", "--fresh", str(CHILDREN / "fail_first_attempts.py"))
    assert r.returncode == 2 and "pass one" in r.stderr
    assert not (tmp_path / "run" / "attempts").exists()


@pytest.mark.slow
def test_real_cgroup_oom_kill_is_classified_oom_host_and_degrades(tmp_path):
    cg_root = Path("/sys/fs/cgroup/memory")
    cg = cg_root / f"rtrain-launch-test-{os.getpid()}"
    try:
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(300 << 20))
    except OSError as e:
        pytest.skip(f"cannot create a v1 memory cgroup here: {e}")
    try:
        (cg / "memory.memsw.limit_in_bytes").write_text(str(300 << 20))
    except OSError:
        pass  # no swap accounting: the memory limit alone is enough without swap
    run = tmp_path / "run"
    cmd = " ".join(launch_cmd(run, "--set", "batch_size=16", "--set", "grad_accum=1",
                              str(CHILDREN / "alloc_per_batch.py"), "--bs", "{batch_size}"))
    try:
        r = subprocess.run(["sh", "-c", f"echo $$ > {cg}/cgroup.procs && exec {cmd}"],
                           env=child_env(), cwd=tmp_path, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        cls = events(run, "classification")
        assert cls and all(c["failure"] == "oom_host" for c in cls)
        assert "OOM killer" in cls[0]["reason"]
        final = events(run, "launch")[-1]["settings"]
        assert final["batch_size"] * final["grad_accum"] == 16  # effective batch kept
        assert final["batch_size"] < 16
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _resumed_from(run: Path, attempt: int = 0) -> str | None:
    return json.loads((run / "attempts" / str(attempt) / "stdout.log").read_text())["resume_from"]


@pytest.mark.slow
def test_resume_auto_never_and_an_explicit_path(tmp_path, make_ckpt):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    for step in (10, 20, 30):
        make_ckpt(ckpts, step)
    (ckpts / "checkpoint-30" / "state.json").write_text("{}")  # corrupt the newest
    child = str(CHILDREN / "print_resume_from.py")
    r = launch(run, child)
    assert r.returncode == 0, r.stderr
    assert _resumed_from(run).endswith("checkpoint-20")
    skipped = events(run, "skipped_checkpoint")
    assert skipped[0]["path"].endswith("checkpoint-30") and "state.json" in skipped[0]["reason"]
    assert "skipping checkpoint-30" in r.stderr
    r = launch(run, "--fresh", "--resume", "never", child)
    assert r.returncode == 0 and _resumed_from(run, 0) is None
    # Started over: the earlier run's checkpoints were set aside, where a PATH still finds them.
    [aside] = ckpts.glob(".earlier-run-*")
    assert not list(ckpts.glob("checkpoint-*")) and (aside / "checkpoint-10").is_dir()
    r = launch(run, "--fresh", "--resume", str(aside / "checkpoint-10"), child)
    assert r.returncode == 0 and _resumed_from(run, 0).endswith("checkpoint-10")
    r = launch(run, "--fresh", "--resume", str(aside / "checkpoint-30"), child)
    assert r.returncode == 2
    assert "does not verify" in r.stderr and "checkpoint-30" in r.stderr
