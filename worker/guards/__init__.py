"""Degrading inside the process before a restart is needed (non-finite steps skipped, OOM
back-off, bad samples dropped), and the faults injected to test recovery (RTRAIN_FAULTS)."""
