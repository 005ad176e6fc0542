"""Whose checkpoint dir it is: rtrain's own files go into it only when it is rtrain's.

rtrain keeps two small files in a checkpoint dir its Checkpointer writes: the generation token
(`.rtrain-generation`, checkpoint/generation.py), which fences off writers of earlier attempts,
and the run identity (`.rtrain-run`, checkpoint/runid.py), which each commit copies into its
manifest for the mirror. Both serve rtrain's own checkpoint format only. A script that keeps
checkpoints of its own (a Trainer, Lightning, nanoGPT, timm) neither checks the token nor
writes a manifest, and its folder is its own: rtrain writes neither file there.

The dir is the script's when
- rtrain hands the script the checkpoint through its arguments (`--resume-arg`, or
  `{checkpoint}` in the command): such a script resumes by its own code, not the worker's; or
- it is the launch's working directory, or the folder of the `.py` script being run
  (`--ckpt-dir .` next to `train.py`).

Otherwise (the default `<run-dir>/checkpoints`, any dir a Checkpointer run names) it is
rtrain's, and the files are kept there as before: the worker looks for them beside its
checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def script_owns(ckpt_dir: Path, *, command: Sequence[str], resume_args: Sequence[str],
                cwd: Path) -> bool:
    """Whether the checkpoint dir belongs to the script (module docstring)."""
    if resume_args or any("{checkpoint}" in a for a in command):
        return True
    here = os.path.realpath(ckpt_dir)
    if here == os.path.realpath(cwd):
        return True
    return any(a.endswith(".py") and os.path.dirname(os.path.realpath(cwd / a)) == here
               for a in command)
