"""`rtrain check-resume`'s side in the training process: the order it gives (where to stop, the
entropy to start from) and the evidence each manifest gets of what a resume may not bring back.
The command itself is supervisor/checkresume/."""
