"""Start a grandchild in our group and one that escapes with setsid; write their pids to argv[1].
Then sleep (argv[2] == "stay") or exit 0 at once, leaving them behind."""

import os
import subprocess
import sys
import time

sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
inside = subprocess.Popen(sleeper)
escaped = subprocess.Popen(sleeper, start_new_session=True)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{inside.pid} {escaped.pid}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
print("ready", flush=True)
if len(sys.argv) > 2 and sys.argv[2] == "stay":
    time.sleep(600)
