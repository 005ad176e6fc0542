"""Foundations every layer and both halves share: errors, the protocol,
file modes, atomic writes."""
