"""Print "ready", wait until the file PATH exists, print "bye" and exit with CODE (default 0).
Attempts after the first exit 0 at once.

usage: wait_for_file.py PATH [CODE]
"""

import os
import sys
import time

if os.environ.get("RTRAIN_ATTEMPT", "0") != "0":
    sys.exit(0)
print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
print("bye", flush=True)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
