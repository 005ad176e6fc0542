"""A worker-library child: install, step with heartbeats every 50 ms.

argv[1] == "silent": after 20 steps stop sending and sleep (a hang the learned timeout catches).
argv[1] == "slow_hang_save": as "silent", serving the save at a hang as worker/saving/hang_save.py
does (the control FIFO), with a save that takes argv[2] seconds and then writes `saved` into the
status dir.
argv[1] == "preempt": step until should_stop(), then "save" and exit 75.
argv[1] == "preempt_refused": as "preempt", with a `control_refused` heartbeat (the FIFO
thread's report of a request without the token) from step 3 on, and after its `stop`.
argv[1] == "pressure": as "preempt", answering relieve requests (memory pressure) at each step
boundary; after 100 steps (5 s) exit 0.
"""

import os
import sys
import threading
import time
from pathlib import Path

from rtrain.supervisor.core.protocol import CONTROL_FIFO
from rtrain.worker import runtime  # torch-free: `import rtrain` loads no torch


def serve_hang_save(seconds: float) -> None:
    status = Path(os.environ["RTRAIN_STATUS"])
    status.mkdir(parents=True, exist_ok=True)
    os.mkfifo(status / CONTROL_FIFO, 0o600)

    def serve() -> None:
        with open(status / CONTROL_FIFO, "rb") as f:
            request = f.read()
        assert request == f"\nfailsave {os.environ['RTRAIN_CONTROL_TOKEN']}\n".encode(), request
        runtime.heartbeat(event="save_begin", step=20)
        time.sleep(seconds)
        (status / "saved").write_text("step 20")
        runtime.heartbeat(event="save_end", step=20)
        runtime.heartbeat(event="hang_save_done")

    threading.Thread(target=serve, daemon=True).start()


runtime.install()
mode = sys.argv[1]
if mode == "slow_hang_save":
    serve_hang_save(float(sys.argv[2]))
step = 0
while True:
    step += 1
    time.sleep(0.05)
    runtime.heartbeat(step=step, loss=1.0 / step, samples=8, event="step")
    if mode == "preempt_refused" and step >= 3:
        runtime.heartbeat(event="control_refused", reason="1 request on control refused")
    if mode in ("silent", "slow_hang_save") and step >= 20:
        time.sleep(600)
    if mode == "pressure":
        if runtime.relieve_pressure(step) is not None:
            print(f"relieved at step {step}", flush=True)
        if step >= 100:
            sys.exit(0)
    if mode in ("preempt", "preempt_refused", "pressure") and runtime.should_stop():
        runtime.heartbeat(event="save_begin", step=step)
        runtime.heartbeat(event="save_end", step=step)
        runtime.heartbeat(event="stop", step=step)
        if mode == "preempt_refused":
            runtime.heartbeat(event="control_refused", reason="2 requests on control refused")
        print(f"stopped at step {step}", flush=True)
        sys.exit(75)
