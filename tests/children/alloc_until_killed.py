"""Allocate and touch memory in 10 MiB pieces until killed (or 4 GiB, then exit 9)."""

import time

chunks = []
for _ in range(400):
    chunks.append(bytearray(10 * 1024 * 1024))  # zero-filled: every page is touched
    time.sleep(0.001)
raise SystemExit(9)
