"""Saving a checkpoint: when (the schedule, `every="auto"`'s cadence, the save clock), what (the
capture at a step boundary) and where (one process's commit, several ranks'), in the background,
at a failure or a hang, and pruning after it."""
