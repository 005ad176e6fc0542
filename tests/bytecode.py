"""A pytest plugin (tests/conftest.py loads it): the project's bytecode, compiled once before any
test starts a process.

The suite starts hundreds of Python processes (rtrain, training scripts, torchrun and
its ranks), and each imports modules of supervisor/ or worker/. Where PYTHONDONTWRITEBYTECODE is
set, as many containers and CI images set it, no process writes what it compiled, so every one
compiles the same modules from source again: about a third of a second for each `rtrain launch`
here, on a loaded 2-core machine. Compiled here once, in the process that starts the pytest-xdist
workers, every later process loads the bytecode instead. compileall writes into __pycache__
beside the sources, where any import would without the variable, and skips what is up to date.
"""

from __future__ import annotations

import compileall

import pytest
from harness import REPO

# What the processes tests start import: rtrain, the library inside the training script, the
# scripts the tests run as children, and the examples some of them train.
COMPILED = ("rtrain", "supervisor", "worker", "checkpoint", "tests/children", "examples")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # a pytest-xdist worker: the process that started it has compiled
    for folder in COMPILED:
        # A read-only checkout compiles nothing: each process then compiles for itself.
        compileall.compile_dir(REPO / folder, quiet=2, workers=1)
