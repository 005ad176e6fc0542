"""`rtrain check-resume`: run a training script straight through and stopped-and-resumed, and
compare the final checkpoints tensor by tensor. `check.py` runs and reports, `runs.py` starts
one run, `compare.py` reads and compares checkpoints, `causes.py` names likely causes (pure);
the worker's side is worker/checkresume/resume_check.py."""
