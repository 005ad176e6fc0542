"""Compiled graphs that travel with a checkpoint: torch's compile artifacts and inductor's
kernels, saved beside it in one container and loaded back before the first compiled step."""
