"""The commands that read a run or a checkpoint directory, and their rendering."""
