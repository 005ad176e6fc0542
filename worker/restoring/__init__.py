"""Restoring a checkpoint: pick one, read it verified, then apply it to the training objects."""
