"""rtrain as it ships: a wheel and an sdist built from a copy of this checkout by setuptools'
own build backend (PEP 517), as `pip install .` and `python -m build` would build them. The copy
keeps the checkout clean (setuptools writes build/ and an egg-info beside its input) and lets
parallel test workers build at once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from harness import REPO

# What the build reads: the metadata, the package mapping and the four folders it maps.
INPUTS = ("pyproject.toml", "setup.py", "README.md", "rtrain", "supervisor", "worker", "checkpoint")

BUILD = """
import json, sys
from setuptools import build_meta
out = sys.argv[1]
print(json.dumps({"wheel": build_meta.build_wheel(out), "sdist": build_meta.build_sdist(out)}))
"""


@dataclass(frozen=True)
class Built:
    wheel: Path
    sdist: Path


def copy_inputs(src: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in INPUTS:
        if (src / name).is_dir():
            shutil.copytree(src / name, dest / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src / name, dest / name)
    return dest


def build(source: Path, out: Path) -> Built:
    """Build the wheel and the sdist of the project at `source` into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-c", BUILD, str(out)], cwd=source, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    names = json.loads(r.stdout.strip().splitlines()[-1])
    return Built(out / names["wheel"], out / names["sdist"])


def build_checkout(tmp: Path) -> Built:
    """This checkout's wheel and sdist."""
    return build(copy_inputs(REPO, tmp / "src"), tmp / "dist")


def unpack_sdist(sdist: Path, dest: Path) -> Path:
    """The sdist's project folder, unpacked beneath `dest`."""
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    (root,) = dest.iterdir()
    return root
