"""The command line that runs one of rtrain's own modules in a new interpreter, isolated from
the caller's working directory and PYTHON* variables.

`python -m MODULE` puts the working directory first on sys.path, so a `json.py` planted in a
shared directory someone runs `rtrain export` from would run as them. Isolated mode (`-I`)
leaves out the working directory, the script's directory, every PYTHON* variable and the
user's site-packages; the interpreter's own site-packages stay, and with them rtrain wherever
it is installed there (an editable install too). Where this rtrain was imported from a place
isolated mode does not search (PYTHONPATH, the user's site-packages), that one place is added
back, after the standard library, and only when rtrain is not found otherwise.

For rtrain's helpers only (the export's torch side, the mirror's uploader). The training script
keeps its normal sys.path and environment: rtrain never runs the user's code this way, and the
warm standby, which becomes the script's interpreter, runs by absolute path (standby/
warm_child.py), which never puts the working directory on sys.path either.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python -I -c BOOT ROOT MODULE ARGS...`: sys.argv becomes [MODULE's file, ARGS...] as
# under -m. Standard library only, before anything else is imported.
BOOT = ("import importlib.util, runpy, sys\n"
        "root, module = sys.argv.pop(1), sys.argv.pop(1)\n"
        "if importlib.util.find_spec('rtrain') is None:\n"
        "    sys.path.append(root)\n"
        "runpy.run_module(module, run_name='__main__', alter_sys=True)\n")


def import_root() -> str:
    """The directory this rtrain's package was imported from (the package itself is always
    imported already: it is the parent of every module of rtrain's)."""
    return str(Path(sys.modules["rtrain"].__file__ or ".").resolve().parent.parent)


def module_argv(module: str, *args: str, python: str | None = None) -> list[str]:
    """`python -m MODULE ARGS`, isolated (see the module docstring)."""
    return [python or sys.executable, "-I", "-c", BOOT, import_root(), module, *args]
