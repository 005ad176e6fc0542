"""The memory tier (`Saving(memory=...)`): snapshots of the training state in shared memory,
which rtrain persists (supervisor/memtier/), and a process group's resume from its ranks' parts."""
