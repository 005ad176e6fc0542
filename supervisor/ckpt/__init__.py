"""The checkpoint format, torch-free: layout, manifest, hashing, verification, retention.

Both halves use it: the worker writes checkpoints with it, the supervisor picks the one to resume
from, and `rtrain inspect` / `rtrain prune` read it, all without importing torch.
"""
