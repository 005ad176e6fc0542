"""The optional features of `rtrain launch`, one line each, in the order the loop calls them
(launch/feature.py has the protocol). A feature is its folder and its line here: delete both and
the rest builds, launches and passes its tests (tests/test_features.py runs a launch with none).

The order matters where two act on one moment: under memory pressure the warm standby makes
room before the memory tier drops its snapshots; the mirror opens (a bad store stops the
launch) before the memory tier commits what an earlier rtrain left in memory.
"""

from __future__ import annotations

from importlib import import_module

from rtrain.supervisor.launch.feature import Feature, Run

FEATURES = (
    "rtrain.supervisor.mirror.feature",  # uploads to a store, a newer checkpoint brought back
    "rtrain.supervisor.standby.feature",  # a warm interpreter starts the next attempt
    "rtrain.supervisor.memtier.feature",  # snapshots in memory, copies on peer nodes
    "rtrain.supervisor.elsewhere.feature",  # checkpoints written where rtrain does not watch
    "rtrain.supervisor.trackers.feature",  # W&B and MLflow continue one run
    "rtrain.supervisor.compilecache.feature",  # torch.compile's caches kept for every attempt
    "rtrain.supervisor.stuck.feature",  # which rank is stuck at a hang, NCCL's flight recorder
    "rtrain.supervisor.straggler.feature",  # a rank slower than the others, said
    "rtrain.supervisor.hooks.feature",  # [[hooks]] commands on events
    "rtrain.supervisor.metrics.feature",  # the Prometheus metrics file
)
"""Each feature's module: its `make(run)` returns the feature, or None when the run's config
leaves it off."""


def make_all(run: Run, names: tuple[str, ...] = FEATURES) -> list[Feature]:
    """The features of one launch, made in order."""
    made = (import_module(name).make(run) for name in names)
    return [f for f in made if f is not None]


def in_place(names: tuple[str, ...] = FEATURES) -> dict[str, tuple[str, ...]]:
    """The files the features write in place in the run dir ("run") and the checkpoint dir
    ("ckpt"), each module's `IN_PLACE`: checked before a launch writes anything
    (launch/rundir.py refuse_planted)."""
    found: dict[str, tuple[str, ...]] = {"run": (), "ckpt": ()}
    for name in names:
        for where, files in getattr(import_module(name), "IN_PLACE", {}).items():
            found[where] += tuple(files)
    return found
