"""Leave processes behind when rtrain is SIGKILLed: a `setsid` grandchild with a cleared
environment that keeps appending to DIR/ticks, and a forked checkpoint writer (as
Saving(async_mode="fork") forks one) that commits step 7 once DIR/go exists.

usage: leave_behind_on_kill.py DIR     (attempt 0 only; later attempts exit 0 at once)
DIR receives grandchild.pid, writer.pid and, if the writer gets to commit, writer.result.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

from rtrain.checkpoint.commit import PendingCheckpoint
from rtrain.checkpoint.generation import StaleWriter

d = Path(sys.argv[1])
if os.environ.get("RTRAIN_ATTEMPT") != "0":
    print("a later attempt: nothing to do", flush=True)
    sys.exit(0)
tick = ("import sys, time\n"
        "while True:\n"
        "    with open(sys.argv[1], 'a') as f: f.write('tick\\n')\n"
        "    time.sleep(0.05)\n")
g = subprocess.Popen([sys.executable, "-c", tick, str(d / "ticks")], start_new_session=True,
                     env={"PATH": os.environ.get("PATH", "")})
(d / "grandchild.pid").write_text(str(g.pid))
if os.fork() == 0:
    try:
        pending = PendingCheckpoint(os.environ["RTRAIN_CKPT_DIR"], 7, fsync=False)
        pending.write_json("state.json", {"step": 7})
        (d / "writer.pid").write_text(str(os.getpid()))
        while not (d / "go").exists():
            time.sleep(0.02)
        try:
            pending.commit({})
            result = "committed"
        except StaleWriter as e:
            result = f"refused: {e}"
        (d / "writer.result").write_text(result)
    finally:
        os._exit(0)
print("ready", flush=True)
while True:
    time.sleep(1)
