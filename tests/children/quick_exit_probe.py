"""Child of test_quick_exit.py: a Checkpointer, then an uncaught error in attempt 0 (attempt 1
ends well). What the way out does is written to OUT/attempt-N.json by an atexit handler, which
runs after rtrain's excepthook: the freeze count, and whether a reference cycle made unreachable
before the error was finalized.

usage: quick_exit_probe.py OUT
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
attempt = int(os.environ.get("RTRAIN_ATTEMPT") or 0)
seen = {"cycle_finalized": False}


class Node:
    pass


def record() -> None:
    seen["freeze_count"] = gc.get_freeze_count()
    (out / f"attempt-{attempt}.json").write_text(json.dumps(seen))


atexit.register(record)
model = torch.nn.Linear(4, 4)
ck = rtrain.Checkpointer(model=model, ckpt_dir=str(out / "ck"), every=1000)
start = ck.restore()
for step in range(start + 1, start + 3):  # steps, so the failure is no start-up failure
    ck.maybe_save(step)
gc.disable()  # the cycle below stays uncollected until a full collection runs
cycle = Node()
cycle.me = cycle
weakref.finalize(cycle, seen.update, cycle_finalized=True)
del cycle
if attempt == 0:
    raise RuntimeError("the probe fails its first attempt")
ck.close()
