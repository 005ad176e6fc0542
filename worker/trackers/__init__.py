"""Experiment trackers across restarts (`rtrain.trackers`): one run, one curve, the restarts
marked on it."""
