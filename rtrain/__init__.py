"""rtrain: keeps long PyTorch training runs alive.

    import rtrain
    ckpt = rtrain.Checkpointer(model=model, optimizer=opt, loader=loader, every=100)
    start_step = ckpt.restore()

The one import package. The repository keeps its two halves side by side, and the build places
them under this name (setup.py): `rtrain.supervisor` is the `rtrain` command (torch-free: it
starts, watches and restarts the script), `rtrain.worker` the library a training script uses.
The names a script needs are here, each loaded on first use: `import rtrain` costs neither a
torch import nor the supervisor's start-up, and every module of the supervisor, which imports
this package first as its parent, pays nothing for the library's names.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_GUARDS = ("NonFiniteGuard", "OOMBackoff", "SkipBadSamples", "DataError", "skip_none_collate",
           "install_excepthook")
_RUNTIME = ("heartbeat", "on_pressure", "relieve_pressure", "request_stop", "should_stop",
            "write_exit_record")
_SAMPLERS = ("ResumableSampler", "DistributedResumableSampler")
_PUBLIC = {
    "Checkpointer": "rtrain.worker.checkpointer",
    **dict.fromkeys(("Every", "Keep", "Memory", "Restoring", "Saving"), "rtrain.worker.options"),
    **dict.fromkeys(_SAMPLERS, "rtrain.worker.data.sampler"),
    **dict.fromkeys(("sample_generator", "sample_seed", "seeded"), "rtrain.worker.data.sample_rng"),
    **dict.fromkeys(("Settings", "settings"), "rtrain.worker.settings"),
    **dict.fromkeys(_RUNTIME, "rtrain.worker.runtime"),
    **dict.fromkeys(_GUARDS, "rtrain.worker.guards.degrade"),
}
"""Each public name and the module that defines it."""

_MODULES = {"trackers": "rtrain.worker.trackers.restarts"}
"""Modules a script reaches through this package: `rtrain.trackers.wandb_init(...)`."""

__all__ = sorted([*_PUBLIC, *_MODULES, "__version__"])

# Under `rtrain check-resume` only: the runs that stand for one original run start python's and
# numpy's global generators alike, at the script's `import rtrain`, before its own code seeds or
# draws (worker/checkresume/check_order.py). Torch-free; elsewhere it reads one variable.
from rtrain.worker.checkresume import check_order  # noqa: E402

check_order.seed_entropy()

_WARM = ("rtrain.worker.checkpointer", "rtrain.worker.memtier.memory_tier",
         "rtrain.worker.memtier.live", "rtrain.worker.restoring.restore",
         "rtrain.worker.saving.failsave", "rtrain.worker.saving.retention",
         "rtrain.worker.compilecache.compile_cache", "rtrain.worker.data.position",
         "rtrain.checkpoint.crypt")
"""What a script's first Checkpointer imports: a warm standby imports them before its attempt
(supervisor/standby/child_program.py), then calls `_rebind_attempt`."""


def _rebind_attempt() -> None:
    """The attempt's RTRAIN_* variables are set now, in a process that imported rtrain before
    them (a warm standby): what reads them at import reads them again. Keep in step with the
    modules that do (tests/test_standby_preload.py checks that no other one does)."""
    import importlib
    import sys

    check_order.seed_entropy()
    faults = sys.modules.get("rtrain.worker.guards.faults")
    if faults is not None:
        importlib.reload(faults)  # its hooks are bound to the attempt's armed faults


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(import_module(_PUBLIC[name]), name)
    elif name in _MODULES:
        value = import_module(_MODULES[name])
    else:
        raise AttributeError(f"module 'rtrain' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
