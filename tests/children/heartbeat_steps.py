"""A worker-library script without torch: heartbeats every 20 ms, exit 75 on a stop request.

usage: heartbeat_steps.py STEPS [MODE N]
MODE, at step N of attempt 0: `silent` stops sending anything and sleeps; `sigstop` stops
itself (SIGSTOP), then, once continued, is silent; `selfstop` stops itself, then, once
continued, steps on (and so saves and exits 75 on the stop signal that continued it).
"""

import os
import signal
import sys
import time

import rtrain
from rtrain.worker import runtime

steps = int(sys.argv[1])
mode, at = (sys.argv[2], int(sys.argv[3])) if len(sys.argv) > 3 else (None, -1)
attempt = int(os.environ.get("RTRAIN_ATTEMPT", "0"))
runtime.install()
for step in range(1, steps + 1):
    time.sleep(0.02)
    rtrain.heartbeat(step=step, loss=1.0 / step, samples=8)
    print(f"step {step}", flush=True)
    if rtrain.should_stop():
        print(f"stop requested at step {step}: saved, exiting 75", flush=True)
        sys.exit(75)
    if attempt == 0 and step == at:
        if mode in ("sigstop", "selfstop"):
            os.kill(os.getpid(), signal.SIGSTOP)
        while mode != "selfstop":  # silent: no heartbeats, no output
            time.sleep(1)
