"""Child of test_quick_exit.py: rtrain's excepthook, then an uncaught error in attempt 0 (attempt 1
ends well). What the way out does is written to OUT/attempt-N.json by an atexit handler, which
runs after rtrain's excepthook: the freeze count, and whether a reference cycle made unreachable
before the error was finalized.

usage: quick_exit_probe.py OUT [checkpointer|exit-record]
  checkpointer  (default) a Checkpointer's hook (the save at the failure)
  exit-record   rtrain.install_excepthook() alone, the steps told by heartbeats
"""

import atexit
import gc
import json
import os
import sys
import weakref
from pathlib import Path

import torch

import rtrain

out = Path(sys.argv[1])
hook = sys.argv[2] if len(sys.argv) > 2 else "checkpointer"
attempt = int(os.environ.get("RTRAIN_ATTEMPT") or 0)
seen = {"cycle_finalized": False}


class Node:
    pass


def record() -> None:
    seen["freeze_count"] = gc.get_freeze_count()
    (out / f"attempt-{attempt}.json").write_text(json.dumps(seen))


atexit.register(record)
model = torch.nn.Linear(4, 4)
if hook == "checkpointer":
    ck = rtrain.Checkpointer(model=model, ckpt_dir=str(out / "ck"), every=1000)
    start = ck.restore()
else:
    rtrain.install_excepthook()
    start = 0
for step in range(start + 1, start + 3):  # steps, so the failure is no start-up failure
    if hook == "checkpointer":
        ck.maybe_save(step)
    else:
        rtrain.heartbeat(step=step)
gc.disable()  # the cycle below stays uncollected until a full collection runs
cycle = Node()
cycle.me = cycle
weakref.finalize(cycle, seen.update, cycle_finalized=True)
del cycle
if attempt == 0:
    raise RuntimeError("the probe fails its first attempt")
if hook == "checkpointer":
    ck.close()
