"""scripts/gpu_check.sh on a machine without a GPU: it says so in one line and exits 77
(skipped), running and installing nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from harness import REPO, child_env


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() or shutil.which("nvidia-smi") is not None,
                    reason="this machine has a GPU: scripts/gpu_check.sh runs for real here")
def test_gpu_check_without_a_gpu_is_skipped_with_exit_77():
    r = subprocess.run([str(REPO / "scripts" / "gpu_check.sh")], cwd=REPO,
                       env=child_env(PYTHON=sys.executable), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 77, r.stdout + r.stderr
    assert r.stdout.strip() == ("skipped: no GPU (nvidia-smi lists none and "
                                "torch.cuda.is_available() is False)")
