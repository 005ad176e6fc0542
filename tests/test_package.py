"""rtrain installs as one import package, `rtrain`, and nothing else: not beside supervisord
(whose import name is `supervisor`), and not in the way of a script's own `worker` or
`supervisor` modules. The wheel and the sdist are built by setuptools' own backend
(tests/built.py); the venvs are real ones, with supervisord from PyPI."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from built import build, unpack_sdist
from harness import CHILDREN, REPO, child_env, launch_cmd, run_child

import rtrain

pytestmark = pytest.mark.slow

DIST_INFO = f"rtrain-{rtrain.__version__}.dist-info"
SUPERVISORD = "supervisor==4.3.0"  # supervisord: its import name is `supervisor`


def shipped_sources() -> set[str]:
    """Where each source file of the checkout lands in site-packages."""
    return {f"rtrain/{path.relative_to(REPO / top)}" if top == "rtrain"
            else f"rtrain/{top}/{path.relative_to(REPO / top)}"
            for top in ("rtrain", "supervisor", "worker", "checkpoint")
            for path in (REPO / top).rglob("*.py") if "__pycache__" not in path.parts}


def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return sorted(z.namelist())


def test_the_wheel_holds_rtrain_and_nothing_else(shipped):
    names = wheel_names(shipped.wheel)
    assert {n.split("/")[0] for n in names} == {"rtrain", DIST_INFO}
    assert {n for n in names if n.endswith(".py")} == shipped_sources()
    with zipfile.ZipFile(shipped.wheel) as z:
        assert z.read(f"{DIST_INFO}/top_level.txt").decode().split() == ["rtrain"]
        entry_points = z.read(f"{DIST_INFO}/entry_points.txt").decode()
    assert "rtrain = rtrain.supervisor.cli:main" in entry_points


def test_the_sdist_builds_the_same_wheel(shipped, tmp_path):
    project = unpack_sdist(shipped.sdist, tmp_path / "sdist")
    again = build(project, tmp_path / "again")
    assert wheel_names(again.wheel) == wheel_names(shipped.wheel)


def test_import_rtrain_costs_no_torch_and_no_cli():
    code = ("import sys, rtrain\n"
            "loaded = lambda: sorted(m for m in ('torch', 'typer', 'rtrain.supervisor.cli') "
            "if m in sys.modules)\n"
            "first = loaded()\n"
            "rtrain.settings(); rtrain.should_stop()\n"
            "torch_free = loaded()\n"
            "rtrain.Checkpointer\n"
            "print(first, torch_free, loaded(), sorted(set(rtrain.__all__) - set(dir(rtrain))))")
    r = run_child([sys.executable, "-c", code], timeout=120, env=child_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "[] [] ['torch'] []"


def test_python_m_rtrain_is_the_cli():
    r = run_child([sys.executable, "-m", "rtrain", "--version"], timeout=60, env=child_env(),
                  cwd=REPO)
    assert r.returncode == 0 and r.stdout.strip() == f"rtrain {rtrain.__version__}", r.stderr


OWN_MODULES = r'''
import json, os, sys
import supervisor
import worker
import rtrain

assert worker.WHOSE == "the script's", worker.__file__
assert supervisor.WHOSE == "the script's", supervisor.__file__
with open(os.environ["WHOSE_OUT"], "a") as f:
    f.write(json.dumps({"worker": worker.__file__, "supervisor": supervisor.__file__,
                        "rtrain": rtrain.Checkpointer.__module__}) + "\n")
'''


def test_a_scripts_own_worker_and_supervisor_change_nothing(tmp_path):
    """A project with its own `worker.py` and `supervisor/` beside train.py, launched from its
    folder with `python -m rtrain` (the folder first on the path of rtrain itself, too):
    the script gets its own modules, rtrain gets its own, and the run resumes after a crash."""
    project = tmp_path / "project"
    (project / "supervisor").mkdir(parents=True)
    (project / "worker.py").write_text('WHOSE = "the script\'s"\n')
    (project / "supervisor" / "__init__.py").write_text('WHOSE = "the script\'s"\n')
    train = CHILDREN / "checkpointer_resume.py"
    (project / "train.py").write_text(OWN_MODULES + train.read_text())
    out, whose = tmp_path / "resumed.jsonl", tmp_path / "whose.jsonl"
    r = run_child(launch_cmd(tmp_path / "run", "train.py", "6", str(out)),
                  cwd=project, timeout=240,
                  env=child_env(RTRAIN_FAULTS="crash@step=3", WHOSE_OUT=str(whose)))
    assert r.returncode == 0, r.stderr[-3000:]
    seen = [json.loads(line) for line in whose.read_text().splitlines()]
    assert len(seen) == 2, seen
    for s in seen:
        assert s == {"worker": str(project / "worker.py"),
                     "supervisor": str(project / "supervisor" / "__init__.py"),
                     "rtrain": "rtrain.worker.checkpointer"}
    resumed = [json.loads(line)["resumed"] for line in out.read_text().splitlines()]
    assert resumed[0] == 0 and resumed[-1] > 0, resumed


# ---------------------------------------------------------------- beside supervisord

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


@pytest.fixture(scope="module")
def from_pypi(tmp_path_factory):
    """supervisord's wheel, and a folder holding what `rtrain --help` imports (typer) and the
    build backend of an editable install: the venvs below see it through a .pth file, so each
    installs only rtrain and supervisord of its own. Needs PyPI, as the suite's set-up does."""
    tmp = tmp_path_factory.mktemp("pypi")
    for argv in ([*PIP, "download", "--no-deps", "-d", str(tmp / "wheels"), SUPERVISORD],
                 [*PIP, "install", "--target", str(tmp / "deps"), "typer", "setuptools>=77"]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        if r.returncode != 0:
            pytest.skip(f"PyPI not reachable: {' '.join(argv[3:5])} failed: "
                        f"{r.stderr.strip().splitlines()[-1:]}")
    (wheel,) = (tmp / "wheels").glob("supervisor-*.whl")
    return wheel, tmp / "deps"


class Venv:
    """A fresh venv without pip of its own: the suite's pip installs into it (`--python`)."""

    def __init__(self, path: Path, deps: Path) -> None:
        subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(path)],
                       check=True, timeout=120)
        self.python = path / "bin" / "python"
        (site,) = path.glob("lib/python*/site-packages")
        (site / "deps.pth").write_text(f"{deps}\n")
        self.site = site

    def pip(self, *args: str) -> None:
        r = subprocess.run([*PIP, "--python", str(self.python), *args], capture_output=True,
                           text=True, timeout=300, check=False)
        assert r.returncode == 0, f"pip {' '.join(args)}: {r.stderr[-2000:]}"

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        return run_child([str(self.python.parent / argv[0]), *argv[1:]], timeout=120,
                         cwd=self.site.parent, env=child_env())

    def owner_of(self, module: str) -> str:
        """The file `import module` loads in this venv, or the error's one line."""
        r = self.run("python", "-c", f"import {module}; print({module}.__file__)")
        return r.stdout.strip() if r.returncode == 0 else r.stderr.strip().splitlines()[-1]


def both_work(venv: Venv) -> None:
    r = venv.run("rtrain", "--help")
    assert r.returncode == 0 and "launch" in r.stdout, r.stderr[-2000:]
    r = venv.run("supervisord", "--version")
    assert r.returncode == 0 and r.stdout.strip() == SUPERVISORD.split("==")[1], r.stderr
    assert venv.owner_of("supervisor").startswith(str(venv.site / "supervisor"))
    assert "No module named 'worker'" in venv.owner_of("worker")  # rtrain's is rtrain.worker


@pytest.mark.xdist_group("pypi")
@pytest.mark.parametrize("how", ["wheel", "editable"])
@pytest.mark.parametrize("first", ["rtrain", "supervisord"])
def test_rtrain_and_supervisord_install_side_by_side(shipped, from_pypi, tmp_path, how, first):
    """Either order, either kind of install: both commands work, and uninstalling one leaves
    the other working (and nothing of it behind)."""
    supervisord_wheel, deps = from_pypi
    source = tmp_path / "source"
    if how == "editable":
        unpack_sdist(shipped.sdist, source)
    (project,) = source.iterdir() if how == "editable" else (None,)
    rtrain_args = (["--no-deps", "--no-build-isolation", "-e", str(project)] if project
                   else ["--no-deps", str(shipped.wheel)])
    venv = Venv(tmp_path / "venv", deps)
    installs = {"rtrain": rtrain_args, "supervisord": ["--no-deps", str(supervisord_wheel)]}
    for name in (first, "supervisord" if first == "rtrain" else "rtrain"):
        venv.pip("install", *installs[name])
    both_work(venv)

    venv.pip("uninstall", "-y", "supervisor")
    r = venv.run("rtrain", "--help")
    assert r.returncode == 0 and "launch" in r.stdout, r.stderr[-2000:]
    assert "No module named 'supervisor'" in venv.owner_of("supervisor")

    venv.pip("install", *installs["supervisord"])
    both_work(venv)
    venv.pip("uninstall", "-y", "rtrain")
    assert venv.run("supervisord", "--version").returncode == 0
    assert "No module named 'rtrain'" in venv.owner_of("rtrain")
    assert not (venv.python.parent / "rtrain").exists()
