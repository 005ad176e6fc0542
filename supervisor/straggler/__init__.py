"""Stragglers under torchrun: a rank consistently slower than the others. The rule is pure
(decide.py); the tracker fed from the watch's heartbeats is track.py."""
