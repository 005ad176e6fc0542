"""The stop before the Slurm time limit: the decision and the launch's planner."""
