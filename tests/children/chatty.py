"""A chatty worker-library script without torch: LINE_BYTES of output per step (newline
included) to stdout or stderr, a heartbeat per step, exit 75 on a stop request.

usage: chatty.py STEPS LINE_BYTES SLEEP_S [out|err]
"""

import sys
import time

import rtrain
from rtrain.worker import runtime

steps, width, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
out = sys.stderr if sys.argv[4:5] == ["err"] else sys.stdout
runtime.install()
for step in range(1, steps + 1):
    if pause:
        time.sleep(pause)
    rtrain.heartbeat(step=step, loss=1.0 / step, samples=8)
    head = f"step {step} "
    print(head + "x" * max(0, width - len(head) - 1), file=out, flush=True)
    if rtrain.should_stop():
        print(f"stop requested at step {step}: saved, exiting 75", file=out, flush=True)
        sys.exit(75)
print("done", file=out, flush=True)
