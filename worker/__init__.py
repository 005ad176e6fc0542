"""rtrain worker: the library used inside a training script.

    import worker
    ckpt = worker.Checkpointer(model=model, optimizer=opt, loader=loader, every=100)
    start_step = ckpt.restore()

`settings`, `should_stop`, `heartbeat` and the rest of `worker.runtime` are torch-free; the
torch-bound parts (`Checkpointer`, the samplers, `sample_generator`) load on first use.
"""

from typing import Any

from supervisor import __version__
from worker import check_order
from worker.runtime import (
    heartbeat,
    on_pressure,
    relieve_pressure,
    request_stop,
    should_stop,
    write_exit_record,
)
from worker.settings import Settings, settings

# Under `rtrain check-resume` only: the runs that stand for one original run start python's and
# numpy's global generators alike, before the script's own code seeds or draws.
check_order.seed_entropy()

_GUARDS = ("NonFiniteGuard", "OOMBackoff", "SkipBadSamples", "DataError", "skip_none_collate",
           "install_excepthook")
_LAZY = {"Checkpointer": "worker.checkpointer", "CadenceBounds": "worker.cadence",
         **dict.fromkeys(("Every", "Keep", "Memory", "Restoring", "Saving"), "worker.options"),
         "ResumableSampler": "worker.sampler",
         "DistributedResumableSampler": "worker.sampler",
         **dict.fromkeys(("sample_generator", "sample_seed", "seeded"), "worker.sample_rng"),
         **dict.fromkeys(_GUARDS, "worker.guards")}

# CadenceBounds stays importable for the deprecated `every_steps=CadenceBounds(...)`.
__all__ = ["Checkpointer", "DataError", "DistributedResumableSampler", "Every",
           "Keep", "Memory", "NonFiniteGuard", "OOMBackoff", "Restoring", "ResumableSampler",
           "Saving", "Settings", "SkipBadSamples",
           "__version__", "heartbeat", "install_excepthook", "on_pressure", "relieve_pressure",
           "request_stop", "sample_generator", "sample_seed", "seeded", "settings",
           "should_stop", "skip_none_collate", "write_exit_record"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
