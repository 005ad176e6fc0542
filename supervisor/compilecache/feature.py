"""Compile caches, as a feature of `rtrain launch`: every attempt's torch.compile caches in the
run dir (dirs.py), and what the worker said of the cache it found."""

from __future__ import annotations

from collections.abc import Mapping

from rtrain.supervisor.compilecache import dirs
from rtrain.supervisor.core.event_schema import Kind
from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.launch.feature import Attempt, Feature, Run


class CompileCaches(Feature):
    name = "compile caches"

    def __init__(self, run: Run) -> None:
        self.run = run

    def environment(self, attempt: Attempt, env: Mapping[str, str]) -> Mapping[str, str]:
        return dirs.cache_env(self.run.run_dir, env)

    def heartbeat(self, attempt: int, hb: Heartbeat) -> None:
        if hb.event in ("compile_cache_loaded", "compile_cache_ignored"):
            self.run.events.emit(Kind.COMPILE_CACHE, attempt=attempt, rank=hb.rank,
                                 outcome=hb.event.rpartition("_")[2], detail=hb.reason)


def make(run: Run) -> CompileCaches:
    return CompileCaches(run)
