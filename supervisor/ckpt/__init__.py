"""Checkpoint dirs as the supervisor sees them, torch-free: checkpoints of other formats (a
Trainer's, torch.save files), what a launch does to a checkpoint dir (set an earlier run's
aside, keep a copy of a file rewritten in place), progress from their content.

rtrain's own format is `rtrain.checkpoint`, shared with the worker."""
