"""torch.compile's caches kept in the run dir for every attempt (dirs.py)."""
