import time  # noqa: I001  (the first line: its time is what the relaunch benchmark measures)
t0 = time.monotonic()
import os
import sys

out = sys.argv[1]
attempt = int(os.environ.get("RTRAIN_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
fails = int(sys.argv[2])
with open(out, "a") as f:
    f.write(f"start {attempt} {t0!r}\n")
    if attempt < fails:
        f.write(f"exit {attempt} {time.monotonic()!r}\n")
        f.flush()
        os._exit(1)
