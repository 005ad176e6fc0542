"""Memory pressure: the decision and the per-sample monitor."""
