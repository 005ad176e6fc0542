"""`[[hooks]]`: the table read with the config, and the runner."""
