"""A busy worker: spins the CPU, 30 output lines/s and a heartbeat per 20 ms step, for N s.
With a second argument H it stops heartbeats after H seconds and writes the time of its last
heartbeat to that file (hang latency)."""

import sys
import time

import rtrain
from rtrain.worker import runtime

runtime.install()
seconds = float(sys.argv[1])
hang_file = sys.argv[2] if len(sys.argv) > 2 else None
t0 = time.monotonic()
step = last_print = 0
while time.monotonic() - t0 < seconds:
    end = time.monotonic() + 0.02
    while time.monotonic() < end:
        pass
    step += 1
    rtrain.heartbeat(step=step, loss=1.0, samples=8)
    if time.monotonic() - last_print > 1 / 30:
        print(f"step {step}", flush=True)
        last_print = time.monotonic()
if hang_file:
    with open(hang_file, "w") as f:
        f.write(repr(time.time()))
    time.sleep(600)
