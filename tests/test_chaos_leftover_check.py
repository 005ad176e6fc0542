"""scripts/chaos.py's own leftover check must not count the processes that started it (a
wrapper whose command line names the work dir, e.g. `timeout 900 python scripts/chaos.py --dir
D`), and must still count a real leftover."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from harness import REPO, child_env

CHECK = ("import sys; sys.path.insert(0, sys.argv[1]); from chaos_util import leftovers; "
         "print(len(leftovers(sys.argv[2])))")


@pytest.mark.slow
def test_the_wrapper_that_started_the_check_is_not_a_leftover(tmp_path):
    marker = str(tmp_path / "work")
    env = child_env()
    # A wrapper (timeout) and a shell between it and the check, both naming the work dir.
    r = subprocess.run(["timeout", "60", "sh", "-c", f'"{sys.executable}" -c "$0" "$1" "$2"; '
                        f': {marker}', CHECK, str(REPO / "tests"), marker],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        time.sleep(0.1)
        r = subprocess.run(["timeout", "60", sys.executable, "-c", CHECK, str(REPO / "tests"),
                            marker], capture_output=True, text=True, env=env, timeout=60)
        assert r.stdout.strip() == "1", r.stderr
    finally:
        stray.kill()
        stray.wait()
