"""The memory tier, rtrain's side: the shared-memory directory, persisting its snapshots."""
