"""Print, then hang: sleeping (default) or stopped by SIGSTOP (argv[1] == "stop")."""

import os
import signal
import sys
import time


def stuck_here():
    if len(sys.argv) > 1 and sys.argv[1] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)


print("ready", flush=True)
stuck_here()
