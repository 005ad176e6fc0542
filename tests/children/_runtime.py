"""Load worker/runtime.py by path, so test children never import the worker package (torch)."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location(
    "rtrain_worker_runtime", ROOT / "worker" / "runtime.py"
)
runtime = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runtime)
