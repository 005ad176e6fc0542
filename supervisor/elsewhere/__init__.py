"""Checkpoints written outside the watched dir: the rule and the scan."""
