"""Print "ready", wait until the file PATH exists, print "bye" and exit 0.

usage: wait_file.py PATH
"""

import os
import sys
import time

print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
print("bye", flush=True)
