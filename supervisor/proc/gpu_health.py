"""Device health between attempts: the readings NVML offers, and which of them mean a device
must not be trusted with the next attempt. `problems` is pure; `read_nvml` does the NVML calls
for `gpu.NvmlReader.health()` (tests script `DeviceHealth` readings through `ScriptedReader`).

A reading the driver does not offer (NVML_ERROR_NOT_SUPPORTED: consumer cards, older drivers)
is None and never counts against the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# XIDs after which the device (or its memory, or its bus) needs a reset or a drain, as NVIDIA's
# XID catalogue describes them; application-caused ones (13, 31, 43, ...) are left out: the next
# attempt may well run fine.
FATAL_XIDS = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
# nvmlGpuRecoveryAction_t, the driver's own verdict (r550 and later); 0 is "none".
RECOVERY_ACTIONS = {1: "GPU reset", 2: "node reboot", 3: "drain P2P", 4: "drain and reset",
                    5: "recover IMEX domain", 6: "bus reset", 7: "system reboot"}


@dataclass(frozen=True)
class DeviceHealth:
    """One device's readings, taken after an attempt ended."""

    index: int
    reachable: bool = True
    error: str = ""  # the NVML error when not reachable
    retired_pages_pending: bool | None = None  # retired pages waiting for a reset to take effect
    remap_pending: bool | None = None  # row remapping waiting for a reset
    remap_failed: bool | None = None  # a row remapping failed: the memory is bad
    xids: tuple[int, ...] = ()  # XID critical-error events since the previous check
    recovery_action: int | None = None  # nvmlGpuRecoveryAction_t, where the driver reports it

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "reachable": self.reachable, "error": self.error,
                "retired_pages_pending": self.retired_pages_pending,
                "remap_pending": self.remap_pending, "remap_failed": self.remap_failed,
                "xids": list(self.xids), "recovery_action": self.recovery_action}


def problems(h: DeviceHealth) -> list[str]:
    """What is wrong with the device, one phrase each; [] when it may be used."""
    if not h.reachable:
        return [f"unreachable ({h.error or 'NVML cannot read it'})"]
    out = []
    if h.retired_pages_pending:
        out.append("retired memory pages pending a reset")
    if h.remap_failed:
        out.append("row remapping failed")
    elif h.remap_pending:
        out.append("row remapping pending a reset")
    for xid in dict.fromkeys(h.xids):
        if xid in FATAL_XIDS:
            out.append(f"XID {xid} ({FATAL_XIDS[xid]})")
    if h.recovery_action:
        what = RECOVERY_ACTIONS.get(h.recovery_action, f"recovery action {h.recovery_action}")
        out.append(f"driver asks for {what}")
    return out


def describe(failed: list[DeviceHealth]) -> str:
    """`GPU 0: XID 79 (...); GPU 3: ...` for the lost_device reason sentence."""
    return "; ".join(f"GPU {h.index}: {', '.join(problems(h))}" for h in failed)


def _optional(nvml: Any, call: Any, *args: Any) -> Any:
    """The call's result, or None where the driver does not offer the reading."""
    try:
        return call(*args)
    except nvml.NVMLError as err:
        if err.value != getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", None):
            log.debug("NVML health reading failed: %s", err)
        return None


def read_nvml(nvml: Any, handles: list[Any], events: Any) -> tuple[DeviceHealth, ...]:
    """Health of every device; `events` is an NVML event set registered for XID critical errors
    (None where the driver offers none)."""
    xids: dict[int, list[int]] = {}
    while events is not None:
        try:
            data = nvml.nvmlEventSetWait_v2(events, 0)
        except nvml.NVMLError:  # NVML_ERROR_TIMEOUT: nothing more pending
            break
        try:
            index = nvml.nvmlDeviceGetIndex(data.device)
        except nvml.NVMLError:
            index = -1
        xids.setdefault(index, []).append(int(data.eventData))
    out = []
    for index, handle in enumerate(handles):
        try:
            nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError as err:
            out.append(DeviceHealth(index, reachable=False, error=str(err),
                                    xids=tuple(xids.get(index, ()))))
            continue
        pending = _optional(nvml, nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        rows = _optional(nvml, nvml.nvmlDeviceGetRemappedRows, handle)
        action = None
        field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is not None:
            values = _optional(nvml, nvml.nvmlDeviceGetFieldValues, handle, [field])
            if values and values[0].nvmlReturn == 0:
                action = int(values[0].value.uiVal)
        out.append(DeviceHealth(
            index, retired_pages_pending=None if pending is None else bool(pending),
            remap_pending=None if rows is None else bool(rows[2]),
            remap_failed=None if rows is None else bool(rows[3]),
            xids=tuple(xids.get(index, ()) + xids.get(-1, [])), recovery_action=action))
    return tuple(out)


def xid_events(nvml: Any, handles: list[Any]) -> Any:
    """An event set registered for XID critical errors on every device that offers them."""
    try:
        events = nvml.nvmlEventSetCreate()
    except nvml.NVMLError as err:
        log.debug("no NVML event set: %s", err)
        return None
    for handle in handles:
        _optional(nvml, nvml.nvmlDeviceRegisterEvents, handle,
                  nvml.nvmlEventTypeXidCriticalError, events)
    return events
