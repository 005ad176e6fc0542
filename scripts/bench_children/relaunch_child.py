"""First line: the time the relaunch benchmark measures. Fails (exit 1) while attempt < argv[2]."""

import os
import sys
import time

t0 = time.monotonic()  # os and sys are already loaded by the interpreter: imports cost nothing
out = sys.argv[1]
attempt = int(os.environ.get("RTRAIN_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
fails = int(sys.argv[2])
with open(out, "a") as f:
    f.write(f"start {attempt} {t0!r}\n")
    if attempt < fails:
        f.write(f"exit {attempt} {time.monotonic()!r}\n")
        f.flush()
        os._exit(1)
