"""GPU memory and device loss, behind a reader interface so tests can script a GPU.

`NvmlReader` is the real one. On a machine without a driver or GPU it says so once and then reads
as "no GPU": supervision carries on without GPU evidence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rtrain.supervisor.proc.gpu_health import DeviceHealth, read_nvml, xid_events

log = logging.getLogger(__name__)
_told: set[str] = set()  # say why the GPU is not watched once per process, not once per attempt


def _tell_once(message: str, *args: object) -> None:
    if message not in _told:
        _told.add(message)
        log.info(message, *args)


@dataclass(frozen=True)
class DeviceMemory:
    index: int
    used: int  # bytes
    total: int


@dataclass(frozen=True)
class GpuReading:
    devices: tuple[DeviceMemory, ...] = ()
    process_memory: dict[int, int] = field(default_factory=dict)  # pid -> bytes, asked pids only
    lost: bool = False  # a device is gone (NVML_ERROR_GPU_IS_LOST and kin)
    detail: str = ""  # why `lost`, for the reason sentence


NO_GPU = GpuReading()


class GpuReader(Protocol):
    available: bool  # False: nothing to read (no driver, no device)

    def read(self, pids: Collection[int]) -> GpuReading: ...

    def health(self) -> tuple[DeviceHealth, ...]:
        """Each device's health readings (gpu_health.py); () without a GPU."""
        ...

    def close(self) -> None: ...


class NullReader:
    available = False

    def read(self, pids: Collection[int]) -> GpuReading:
        return NO_GPU

    def health(self) -> tuple[DeviceHealth, ...]:
        return ()

    def close(self) -> None:
        pass


class ScriptedReader:
    """Returns the given readings in order, then the last one forever (tests)."""

    available = True

    def __init__(self, readings: Sequence[GpuReading],
                 health: Sequence[tuple[DeviceHealth, ...]] = ()) -> None:
        if not readings:
            raise ValueError("ScriptedReader needs at least one reading")
        self.readings = list(readings)
        self.calls: list[frozenset[int]] = []
        self.health_readings = list(health)  # one per health() call, then healthy devices
        self.health_calls = 0

    def read(self, pids: Collection[int]) -> GpuReading:
        self.calls.append(frozenset(pids))
        return self.readings[min(len(self.calls), len(self.readings)) - 1]

    def health(self) -> tuple[DeviceHealth, ...]:
        self.health_calls += 1
        if self.health_calls <= len(self.health_readings):
            return self.health_readings[self.health_calls - 1]
        return tuple(DeviceHealth(d.index) for d in self.readings[0].devices)

    def close(self) -> None:
        pass


class NvmlReader:
    """Reads every visible device through NVML (pynvml, from nvidia-ml-py)."""

    def __init__(self) -> None:
        self.available = False
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._xids: Any = None  # NVML event set for XID critical errors
        try:
            import pynvml
        except ImportError as err:
            _tell_once("GPU memory not watched: %s", err)
            return
        try:
            pynvml.nvmlInit()
            self._handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
        except pynvml.NVMLError as err:  # no driver, no library, no device
            _tell_once("GPU memory not watched: NVML unavailable (%s)", err)
            return
        self._nvml = pynvml
        self.available = bool(self._handles)
        # Registered now, so the XIDs of every attempt are pending at the next health() call.
        self._xids = xid_events(pynvml, self._handles) if self.available else None
        if not self.available:
            _tell_once("GPU memory not watched: NVML sees no device")

    def _lost_codes(self) -> set[int]:
        n = self._nvml
        return {
            getattr(n, name)
            for name in ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED")
            if hasattr(n, name)
        }

    def read(self, pids: Collection[int]) -> GpuReading:
        if not self.available:
            return NO_GPU
        n, wanted = self._nvml, set(pids)
        devices, per_pid = [], {}
        for index, handle in enumerate(self._handles):
            try:
                mem = n.nvmlDeviceGetMemoryInfo(handle)
                devices.append(DeviceMemory(index, int(mem.used), int(mem.total)))
                for proc in n.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = proc.usedGpuMemory  # None where the driver hides it
                    if proc.pid in wanted and used is not None:
                        per_pid[proc.pid] = per_pid.get(proc.pid, 0) + int(used)
            except n.NVMLError as err:
                if err.value in self._lost_codes():
                    return GpuReading(tuple(devices), per_pid, True, f"GPU {index}: {err}")
                log.debug("NVML read of GPU %d failed: %s", index, err)
        return GpuReading(tuple(devices), per_pid)

    def health(self) -> tuple[DeviceHealth, ...]:
        if not self.available:
            return ()
        return read_nvml(self._nvml, self._handles, self._xids)

    def close(self) -> None:
        if self._nvml is not None:
            if self._xids is not None:
                try:
                    self._nvml.nvmlEventSetFree(self._xids)
                except self._nvml.NVMLError as err:
                    log.debug("nvmlEventSetFree: %s", err)
            self._nvml.nvmlShutdown()
            self._nvml, self.available = None, False


def wait_gpu_released(
    reader: GpuReader,
    pids: Collection[int],
    timeout_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = 0.1,
) -> dict[int, int]:
    """Wait until none of `pids` holds GPU memory; return those still holding it (pid -> bytes).

    The driver frees a dead process's memory asynchronously; a relaunch that starts before that
    can fail with an out-of-memory error that says nothing about the training itself.
    """
    if not reader.available or not pids:
        return {}
    deadline = clock() + timeout_s
    while True:
        held = reader.read(pids).process_memory
        if not held or clock() >= deadline:
            return held
        sleep(poll_s)
