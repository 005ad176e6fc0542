"""Which attempt may commit into a checkpoint directory: a generation token.

Before each attempt the supervisor writes a fresh token into `<ckpt_dir>/.rtrain-generation`
and gives it to the child as RTRAIN_GENERATION. A writer (the child, its forked async writer,
rank 0 of a distributed save) takes its token when it starts a checkpoint and, right before the
commit's rename, checks under an exclusive flock of that file that the token is still the
current one. A writer left over from an earlier attempt (its supervisor was SIGKILLed and it
escaped the next launch's clean-up) is then refused instead of putting a checkpoint into a run
that has moved on. The supervisor advances the token under the same lock: a commit either
completed before the new token was written, or is refused.

Not checked: writers without a token (an unsupervised script, an older rtrain) and directories
without the file. Tokens have one fixed length, so advancing overwrites the file in place and
needs no new disk block (a full disk cannot leave it empty).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path

from supervisor.errors import CheckpointError

log = logging.getLogger(__name__)

GENERATION_FILE = ".rtrain-generation"


class StaleWriter(CheckpointError):
    """A checkpoint writer whose run has moved on (a newer attempt started since)."""


def new_token() -> str:
    return uuid.uuid4().hex


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:  # a filesystem without locks: check anyway, unserialised
        log.warning("cannot lock the checkpoint generation file (%s)", e.strerror)
    yield  # the lock goes with the descriptor, closed by the caller


def advance(ckpt_dir: Path, token: str) -> None:
    """Make `token` the current generation of `ckpt_dir` (the supervisor, before an attempt)."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(ckpt_dir / GENERATION_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        with _locked(fd):
            data = token.encode()
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def current(ckpt_dir: Path) -> str | None:
    try:
        return (Path(ckpt_dir) / GENERATION_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def committing(ckpt_dir: Path, token: str | Collection[str] | None,
               what: str) -> Iterator[None]:
    """Hold the generation lock around a commit's rename; raise StaleWriter (before the block
    runs) when `token` is no longer the current generation. A distributed save passes the
    tokens of every rank of its group: nodes each run their own supervisor, each advancing the
    shared dir's generation before its attempt, and the group may commit while the current
    token is any of theirs (a newer attempt of any node fences the whole group off)."""
    tokens = {token} if isinstance(token, str) else {t for t in token or () if t}
    if not tokens or "" in tokens:
        yield
        return
    try:
        fd = os.open(Path(ckpt_dir) / GENERATION_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield
        return
    try:
        with _locked(fd):
            now = os.pread(fd, 256, 0).decode(errors="replace").strip()
            if now and now not in tokens:
                mine = ", ".join(sorted(t[:8] for t in tokens))
                raise StaleWriter(f"{what} not committed: its run has moved on (a newer attempt "
                                  f"started since this writer began; generation {mine}, "
                                  f"now {now[:8]})")
            yield
    finally:
        os.close(fd)
