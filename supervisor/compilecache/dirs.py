"""Where an attempt's compiled graphs are cached: the same place for every attempt of a run.

`torch.compile` keeps what it compiled (inductor's FX graph, AOT autograd and autotuning
caches; Triton's kernels) under `TORCHINDUCTOR_CACHE_DIR` and `TRITON_CACHE_DIR`, by default
in /tmp. /tmp does not outlive a container, a pod or a node, and may be private to a job, so
a relaunch elsewhere pays the whole compilation again. rtrain points both into the run dir
(`<run-dir>/compile-cache/`), which every attempt of the run shares and which survives as long
as the run does; a variable the user set stays the user's.

The standby is started with the attempt's environment (RTRAIN_* removed), so it imports with
the same cache dirs; inductor writes the absolute path back into the environment when it first
resolves its cache dir, which child_program.attempt_environ re-applies over the attempt's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

CACHE_DIR = "compile-cache"  # under the run dir
# torch's variable -> its folder under CACHE_DIR. Triton's own default (~/.triton/cache) is as
# lost on a new pod as /tmp; inductor would put Triton's under its own dir only when Triton's
# variable is unset, so both are named.
VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def cache_env(run_dir: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The cache variables to add to an attempt's environment: those `env` does not set."""
    root = run_dir.resolve() / CACHE_DIR
    return {name: str(root / sub) for name, sub in VARIABLES.items() if not env.get(name)}
