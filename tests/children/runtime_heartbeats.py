"""A worker-library child: install, step with heartbeats every 50 ms.

argv[1] == "silent": after 20 steps stop sending and sleep (a hang the learned timeout catches).
argv[1] == "preempt": step until should_stop(), then "save" and exit 75.
argv[1] == "pressure": as "preempt", answering relieve requests (memory pressure) at each step
boundary; after 100 steps (5 s) exit 0.
"""

import sys
import time

from _runtime import runtime

runtime.install()
mode = sys.argv[1]
step = 0
while True:
    step += 1
    time.sleep(0.05)
    runtime.heartbeat(step=step, loss=1.0 / step, samples=8, event="step")
    if mode == "silent" and step >= 20:
        time.sleep(600)
    if mode == "pressure":
        if runtime.relieve_pressure(step) is not None:
            print(f"relieved at step {step}", flush=True)
        if step >= 100:
            sys.exit(0)
    if mode in ("preempt", "pressure") and runtime.should_stop():
        runtime.heartbeat(event="save_begin", step=step)
        runtime.heartbeat(event="save_end", step=step)
        runtime.heartbeat(event="stop", step=step)
        print(f"stopped at step {step}", flush=True)
        sys.exit(75)
