"""Which checkpoints are kept: the policy, pruning a directory, `rtrain prune`."""
