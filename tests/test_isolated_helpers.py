"""rtrain's own code never runs a module planted in the caller's working directory
(core/isolated.py). A shared directory holds a `json.py` that writes a marker when imported;
someone runs rtrain from there: `rtrain export` (its torch side), `rtrain check-resume`, and a
launch whose relaunch runs in the warm standby and whose checkpoints go to a mirror (its
uploader). The training script lives elsewhere, so its own sys.path (its directory first) does
not reach the planted file either. Real processes throughout."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from harness import events, launch, run_rtrain

import rtrain
from rtrain.supervisor.core import isolated

pytestmark = pytest.mark.slow


def _shared(tmp_path: Path) -> tuple[Path, Path]:
    """A directory with a planted json.py; the marker it would write."""
    shared, marker = tmp_path / "shared", tmp_path / "planted-ran"
    shared.mkdir()
    (shared / "json.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                    "raise ImportError('planted')\n")
    return shared, marker


def test_the_isolated_command_line_finds_rtrain_and_not_the_cwd(tmp_path):
    shared, marker = _shared(tmp_path)
    argv = isolated.module_argv("rtrain.supervisor.core.protocol")
    r = subprocess.run(argv, cwd=shared,
                       capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(shared)})
    assert r.returncode == 0, r.stderr
    assert not marker.exists()


def test_export_never_runs_a_module_of_the_working_directory(tmp_path):
    shared, marker = _shared(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    path = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path / "ckpt").save(1)
    r = run_rtrain("export", str(path), str(tmp_path / "weights.pth"), cwd=shared, timeout=120)
    assert r.returncode == 0, r.stderr  # the torch side ran, in a process of its own
    assert torch.load(tmp_path / "weights.pth", weights_only=True).keys() == \
        model.state_dict().keys()
    assert not marker.exists()


@pytest.mark.soak  # check-resume runs only the user's script; export, the uploader: default tier
def test_check_resume_never_runs_a_module_of_the_working_directory(tmp_path):
    shared, marker = _shared(tmp_path)
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text(
        "import torch, rtrain\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Linear(2, 1)\n"
        "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "ck = rtrain.Checkpointer(model=m, optimizer=o, every=2)\n"
        "start = ck.restore() or 0\n"
        "for step in range(start + 1, 7):\n"
        "    loss = m(torch.ones(1, 2)).sum()\n"
        "    o.zero_grad(); loss.backward(); o.step()\n"
        "    ck.maybe_save(step)\n"
        "ck.save(6)\n")
    r = run_rtrain("check-resume", str(script), "--at", "3", "--work-dir",
                   str(tmp_path / "work"), cwd=shared, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not marker.exists()


def test_the_standby_and_the_uploader_never_run_a_module_of_the_working_directory(tmp_path):
    shared, marker = _shared(tmp_path)
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text(
        "import os, time\nimport torch, rtrain\n"
        "attempt = int(os.environ['RTRAIN_ATTEMPT'])\n"
        "m = torch.nn.Linear(2, 1)\n"
        "rtrain.Checkpointer(model=m).save(attempt + 1)\n"
        "time.sleep(7 if attempt == 0 else 0)\n"  # time for the standby to be ready
        "if attempt == 0:\n    raise RuntimeError('boom')\n")
    run = tmp_path / "run"
    r = launch(run, "--mirror", str(tmp_path / "mirror"), str(script), cwd=shared,
               timeout=240)
    assert r.returncode == 0, r.stderr
    assert [e["standby"] for e in events(run, "launch")] == [False, True]
    assert events(run, "mirror_uploaded")
    assert not marker.exists()
