"""The Prometheus metrics file a run keeps current (file.py)."""
