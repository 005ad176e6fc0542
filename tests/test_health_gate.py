"""The health gate after a failed attempt: NVML device checks through the GPU reader seam
(scripted readings on CPU, the real NVML where a GPU is present); a failed device makes the
failure `lost_device` with its evidence, and under Slurm the job is requeued away from the node."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from harness import CHILDREN, fake_scontrol

from rtrain.supervisor.config import load_config
from rtrain.supervisor.launch.loop import LaunchSpec, Seams, child_command, launch
from rtrain.supervisor.proc.gpu import DeviceMemory, GpuReading, NvmlReader, ScriptedReader
from rtrain.supervisor.proc.gpu_health import DeviceHealth, describe, problems
from rtrain.supervisor.records.events import read_events
from rtrain.supervisor.records.runstate import load_state

GIB = 1 << 30
ONE_GPU = GpuReading(devices=(DeviceMemory(0, 1 * GIB, 80 * GIB),))


@pytest.mark.parametrize(("health", "expected"), [
    (DeviceHealth(0), []),
    (DeviceHealth(0, retired_pages_pending=None, remap_pending=None, remap_failed=None), []),
    (DeviceHealth(0, xids=(13, 31, 43)), []),  # application errors: the next attempt may run
    (DeviceHealth(0, reachable=False, error="GPU is lost"), ["unreachable (GPU is lost)"]),
    (DeviceHealth(0, retired_pages_pending=True), ["retired memory pages pending a reset"]),
    (DeviceHealth(0, remap_pending=True, remap_failed=False), ["row remapping pending a reset"]),
    (DeviceHealth(0, remap_pending=True, remap_failed=True), ["row remapping failed"]),
    (DeviceHealth(0, xids=(79, 79, 48)), ["XID 79 (GPU has fallen off the bus)",
                                          "XID 48 (double-bit ECC error)"]),
    (DeviceHealth(0, recovery_action=2), ["driver asks for node reboot"]),
])
def test_which_readings_fail_a_device(health, expected):
    assert problems(health) == expected


def run(tmp_path: Path, health, monkeypatch, **cfg) -> tuple[int, list[dict], ScriptedReader]:
    config = load_config({"run_dir": tmp_path / "run", "backoff.enabled": False,
                          "gpu_release_wait_s": 0.5, **cfg}, None, tmp_path)
    reader = ScriptedReader([ONE_GPU], health=health)
    # fail_first_attempts.py 1 7: attempt 0 exits 7 (looks like any crash), attempt 1 succeeds.
    spec = LaunchSpec(command=child_command(str(CHILDREN / "fail_first_attempts.py"), None,
                                            ["1", "7", "0.1"]),
                      config=config, echo=False, cwd=tmp_path)
    code = launch(spec, Seams(gpu=reader, rand=lambda: 0.0, say=lambda line: None))
    return code, read_events(tmp_path / "run" / "events.jsonl"), reader


@pytest.mark.slow
def test_a_failed_device_makes_the_failure_lost_device_with_evidence(tmp_path, monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    bad = (DeviceHealth(0, xids=(79,), retired_pages_pending=True),)
    code, events, reader = run(tmp_path, [bad], monkeypatch)
    assert code == 0
    assert reader.health_calls == 1  # checked after the failure only, not after the success
    [failed] = [e for e in events if e["kind"] == "device_failed"]
    assert failed["devices"][0]["xids"] == [79] and failed["attempt"] == 0
    assert failed["detail"] == describe(list(bad))
    [cls] = [e for e in events if e["kind"] == "classification"]
    assert cls["failure"] == "lost_device"
    assert "GPU 0: retired memory pages pending a reset, XID 79" in cls["reason"]
    assert load_state(tmp_path / "run").history.budgets_used == {"lost_device": 1}


@pytest.mark.slow
def test_healthy_devices_leave_a_crash_a_crash(tmp_path, monkeypatch):
    code, events, reader = run(tmp_path, [], monkeypatch)
    assert code == 0 and reader.health_calls == 1
    assert [e["failure"] for e in events if e["kind"] == "classification"] == ["crash"]
    assert not [e for e in events if e["kind"] == "device_failed"]


@pytest.mark.slow
def test_under_slurm_the_job_is_requeued_with_the_node_excluded(tmp_path, monkeypatch):
    log = tmp_path / "scontrol.log"
    fake_scontrol(tmp_path / "bin", log)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node-7")
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    bad = (DeviceHealth(0, remap_pending=True, remap_failed=True),)
    code, events, _ = run(tmp_path, [bad], monkeypatch, requeue=True)
    assert code == 75
    assert [e["kind"] for e in events if e["kind"] in ("launch", "exclude_node", "requeue")] \
        == ["launch", "exclude_node", "requeue"]
    excluded = next(e for e in events if e["kind"] == "exclude_node")
    assert excluded["done"] and "ExcNodeList=gpu-node-2,gpu-node-7" in excluded["detail"]
    calls = log.read_text().splitlines()
    assert "update JobId=4242 ExcNodeList=gpu-node-2,gpu-node-7" in calls
    assert calls.index("update JobId=4242 ExcNodeList=gpu-node-2,gpu-node-7") \
        < calls.index("requeue 4242")
    assert load_state(tmp_path / "run").status.value == "preempted"


def test_real_nvml_health_where_a_gpu_is_present():
    reader = NvmlReader()
    try:
        if not reader.available:
            assert reader.health() == ()
            pytest.skip("no GPU here: NVML health checked through scripted readings only")
        readings = reader.health()
        assert len(readings) == len(reader.read(()).devices) > 0
        report = {h.index: (h.to_dict(), problems(h)) for h in readings}
        print(json.dumps(report))
        assert all(h.reachable for h in readings), report
        assert not [p for _, p in report.values() if p], report  # a lent GPU is healthy
    finally:
        reader.close()
