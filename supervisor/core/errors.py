"""One exception tree for every error a user can act on, and rtrain's exit codes.

Only the CLI layer turns an `RtrainError` into a message and an exit code; everything below it
raises with a reason sentence that says what to change.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Iterable


class ExitCode(enum.IntEnum):
    """Every exit status with a meaning: `rtrain`'s own and the ones a worker exits with on
    purpose (contract 2). PREEMPTED is both: the worker exits 75 after saving on a stop request,
    and so does rtrain when it stops for preemption. The worker imports these through
    `rtrain.supervisor.core.protocol` (torch-free). The docstring after each member is its
    meaning as docs/reference.md shows it (scripts/gen_reference.py)."""

    OK = 0
    """launch: the run finished; inspect, prune, status, report, export: done; check-resume:
    the script resumes exactly."""
    GAVE_UP = 1
    """launch: the run gave up (a restart budget, a crash loop, the ladder's floor); inspect:
    a verification asked for with --verify failed; export: the checkpoint fails verification,
    holds nothing to export, or its pickle is refused; check-resume: the resumed runs differ."""
    USAGE = 2
    """A usage or configuration error (one line says what to change); a file in the run or
    checkpoint dir that rtrain refuses (a link, a FIFO, a second name of another file, content
    no rtrain writes) or cannot read; status: no run in RUN_DIR; export: OUT exists (no
    --force); check-resume: the script cannot be checked (it fails, saves no checkpoint, does
    not stop where asked)."""
    STARTUP = 3
    """launch: the training script fails before its first step (import, syntax or argument
    error); not retried."""
    ALREADY_SUPERVISED = 4
    """launch: a live rtrain already supervises this run directory."""
    GAVE_UP_EARLIER = 5
    """launch: the run gave up before; nothing launched (--retry relaunches it, --fresh starts
    it over)."""
    PREEMPTED = 75
    """Stopped on request (preemption, the Slurm time limit) after a checkpoint was committed:
    requeue me (EX_TEMPFAIL). rtrain exits with it, and so does the worker after its save."""
    BAD_CHECKPOINT = 65
    """Worker only: the checkpoint in RTRAIN_RESUME_FROM cannot be loaded (EX_DATAERR). The exit
    record (kind `bad_checkpoint`) is what the supervisor acts on; the code alone is not
    trusted, since any script may exit 65 for reasons of its own."""


class RtrainError(Exception):
    """Base of every error meant for a person. `str(err)` is the one line they read."""

    exit_code: ExitCode = ExitCode.GAVE_UP


class UsageError(RtrainError):
    """Bad arguments, a missing path, a bad configuration value."""

    exit_code = ExitCode.USAGE


class ConfigError(UsageError):
    """An unknown key or bad value in rtrain.toml / [tool.rtrain] / the command line."""


class CheckpointError(RtrainError):
    """A checkpoint that cannot be written, read or trusted."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint that fails verification; `reason` says why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class KeyMismatch(CorruptCheckpoint):
    """An encrypted checkpoint and no key, or another key, to open it. `reason` names the key
    fingerprint expected and the one given. The worker reports it as a bad checkpoint (exit
    65); `rtrain launch` refuses to start (exit 2) before an attempt would meet it."""


class StateMismatch(CheckpointError):
    """The checkpoint does not fit the model/optimizer it is being loaded into."""


class AlreadySupervised(RtrainError):
    exit_code = ExitCode.ALREADY_SUPERVISED


def did_you_mean(word: str, known: Iterable[str], *, otherwise: str = "") -> str:
    """The tail of an "unknown name" message: ` (did you mean 'x'?)` naming the closest known
    name, else `otherwise` (e.g. a list of the known names)."""
    hint = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else otherwise
