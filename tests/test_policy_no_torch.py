"""The supervisor's decision modules must load without torch (fast start, small footprint)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import REPO

MODULES = ["config", "decide.ladder", "decide.classify", "decide.policy", "records.events",
           "records.runstate", "records.lock"]


@pytest.mark.slow
def test_supervisor_modules_do_not_import_torch():
    code = (f"import sys\nfor m in {MODULES!r}:\n    __import__('supervisor.' + m)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
