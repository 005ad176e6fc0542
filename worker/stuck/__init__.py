"""Which rank is stuck at a hang, this rank's side: its progress board, which rtrain reads
(supervisor/stuck/)."""
