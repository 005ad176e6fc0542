"""A rank that reports how it was started, for tests/test_warm_ranks.py: torch-free, so a rank
host (or torchrun) starts it in milliseconds.

usage: rank_probe.py OUT MODE   (OUT/rank<RANK>.json: its environment, argv, parent, group)
MODE ok: exit 0.  fail: rank 1 exits 3 at once, the others wait for a signal (SIGTERM: write
OUT/term<RANK>, exit 0).  stop: every rank waits for the stop signal, writes OUT/term<RANK>
0.5 s later (a save) and exits 75.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

out, mode = Path(sys.argv[1]), sys.argv[2]
rank = os.environ.get("RANK", "?")
terms = []
signal.signal(signal.SIGTERM, lambda *_: terms.append(time.time()))
record = {"env": dict(os.environ), "argv": sys.argv, "orig_argv": sys.orig_argv,
          "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0),
          "modules": "torch" in sys.modules}
(out / f"rank{rank}.json").write_text(json.dumps(record))
if mode == "ok":
    sys.exit(0)
if mode == "fail" and rank == "1":
    sys.exit(3)
deadline = time.monotonic() + 60
while not terms and time.monotonic() < deadline:
    time.sleep(0.01)
if mode == "stop":
    time.sleep(0.5)
(out / f"term{rank}").write_text(repr(terms))
sys.exit(75 if mode == "stop" else 0)
