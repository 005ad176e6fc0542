"""The launch loop with a scripted GPU reader: memory filling up, then the device lost."""

from __future__ import annotations

import pytest
from harness import CHILDREN

from rtrain.supervisor.config import load_config
from rtrain.supervisor.launch.loop import LaunchSpec, Seams, child_command, launch
from rtrain.supervisor.proc.gpu import DeviceMemory, GpuReading, ScriptedReader
from rtrain.supervisor.records.events import read_events

GIB = 1 << 30


def reading(used_gib: float, lost: bool = False) -> GpuReading:
    return GpuReading(devices=(DeviceMemory(0, int(used_gib * GIB), 80 * GIB),), lost=lost,
                      detail="NVML_ERROR_GPU_IS_LOST (injected)" if lost else "")


@pytest.mark.slow
def test_lost_device_is_classified_and_relaunched(tmp_path, monkeypatch):
    cfg = load_config({"run_dir": tmp_path / "run", "backoff.enabled": False,
                       "sample_interval_s": 0.1, "gpu_release_wait_s": 1.0}, None, tmp_path)
    reader = ScriptedReader([reading(40), reading(64), reading(79.5),
                             reading(79.5, lost=True), reading(0)])
    said: list[str] = []
    # fail_first_attempts.py 0 0 2: runs ~2 s per attempt and succeeds; the device is lost in
    # attempt 0.
    spec = LaunchSpec(command=child_command(str(CHILDREN / "fail_first_attempts.py"), None,
                                            ["0", "0", "2"]),
                      config=cfg, echo=False, cwd=tmp_path)
    code = launch(spec, Seams(gpu=reader, rand=lambda: 0.0, say=said.append))
    assert code == 0
    events = read_events(tmp_path / "run" / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert kinds.count("launch") == 2
    cls = next(e for e in events if e["kind"] == "classification")
    assert cls["failure"] == "lost_device" and "GPU_IS_LOST" in cls["reason"]
    first_exit = next(e for e in events if e["kind"] == "exit")
    assert first_exit["gpu_used_peak"] == int(79.5 * GIB)
    assert first_exit["gpu_total"] == 80 * GIB
    assert any("lost_device" in line for line in said)
    # The reader was asked about the child's own processes (per-process GPU memory).
    first_pid = next(e for e in events if e["kind"] == "launch")["pid"]
    assert any(first_pid in pids for pids in reader.calls)
