"""Fail with exit code CODE in the first FAILS attempts (RTRAIN_ATTEMPT), then succeed.

usage: fail_first_attempts.py FAILS CODE [SECONDS]   (runs SECONDS before ending, default 0.2)
"""

import os
import sys
import time

fails, code = int(sys.argv[1]), int(sys.argv[2])
time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.2)
attempt = int(os.environ.get("RTRAIN_ATTEMPT", "0"))
print(f"attempt {attempt} args {sys.argv[1:]}", flush=True)
if attempt < fails:
    print(f"Traceback (most recent call last):\nRuntimeError: flaky failure {attempt}",
          file=sys.stderr, flush=True)
    sys.exit(code)
