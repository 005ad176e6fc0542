"""Write a line to each stream, then exit with the code given (default 3)."""

import sys

print("starting", flush=True)
print("Traceback (most recent call last):\nRuntimeError: boom", file=sys.stderr, flush=True)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
