"""rtrain.worker: the library used inside a training script (`import rtrain` reaches its public
names, each loaded on first use). At the top are the Checkpointer, its option groups, `settings`
and `runtime` (the stop flag, heartbeats, the exit record) and `dist`, which the folders share;
each folder is one thing a user can name: saving, restoring, the memory tier, the data position,
guards, check-resume, trackers, export, and what they share (`trainstate`). The torch-free
modules (`settings`, `runtime`, `stuck.progress`, `checkresume.check_order`, `trackers.restarts`)
serve data-loading and launcher processes too; the rest import torch."""
