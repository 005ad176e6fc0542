"""rtrain supervisor: the torch-free half of rtrain (CLI, supervision, checkpoint format)."""

__version__ = "0.1.0"
