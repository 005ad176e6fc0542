"""rtrain.supervisor: the `rtrain` command and the torch-free half of rtrain (the CLI,
supervision, the reading commands)."""
