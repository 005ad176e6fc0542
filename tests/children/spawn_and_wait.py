"""Spawn a sleeping child with rtrain.supervisor.proc.spawn, write its pid to argv[1], wait for
a kill."""

import os
import sys
import time
from pathlib import Path

from rtrain.supervisor.proc.spawn import ChildSpec, spawn

out = Path(sys.argv[1])
child = spawn(
    ChildSpec(
        argv=[sys.executable, "-c", "import time; time.sleep(600)"],
        env=dict(os.environ),
        cwd=out.parent,
        attempt_dir=out.parent / "attempt",
    )
)
out.with_suffix(".tmp").write_text(str(child.pid))
os.replace(out.with_suffix(".tmp"), out)
time.sleep(600)
