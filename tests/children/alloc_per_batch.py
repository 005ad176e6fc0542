"""Allocate batch_size x 40 MiB (touching every page), then finish.

usage: alloc_per_batch.py --bs N
"""

import sys
import time

bs = int(sys.argv[sys.argv.index("--bs") + 1])
print(f"allocating for batch_size={bs}", flush=True)
chunks = [bytearray(40 << 20) for _ in range(bs)]
time.sleep(0.2)
print("done", flush=True)
