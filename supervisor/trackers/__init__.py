"""Experiment trackers continued across attempts: one run, one curve (env.py)."""
