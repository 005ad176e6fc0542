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

The file is opened through `ownfiles.open_own`: a link planted at its name (which would have
the token written into the file it points to), a FIFO (which would hang the writer's commit)
or a second name of another file is refused, and so is a file holding anything but a token:
rtrain never truncates what it did not write.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path

from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.errors import CheckpointError

log = logging.getLogger(__name__)

GENERATION_FILE = ".rtrain-generation"
TOKEN_MAX = 256  # bytes: a token is 32 hex digits
_TOKEN = re.compile(rb"\s*[0-9a-f]*\s*")


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
    path = ckpt_dir / GENERATION_FILE
    fd = ownfiles.open_own(path, os.O_RDWR, create=True, mode=0o644).fd
    try:
        with _locked(fd):
            _check_token_file(path, os.pread(fd, TOKEN_MAX + 1, 0))
            data = token.encode()
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _check_token_file(path: Path, held: bytes) -> None:
    """RefusedFile unless `held` is what a generation file holds: nothing, or a token."""
    if len(held) > TOKEN_MAX or not _TOKEN.fullmatch(held):
        raise ownfiles.RefusedFile(path, "holds something other than a generation token")


def current(ckpt_dir: Path) -> str | None:
    """The current token; None when there is none. RefusedFile for a file rtrain did not
    write."""
    path = Path(ckpt_dir) / GENERATION_FILE
    try:
        held = ownfiles.read_own(path, limit=TOKEN_MAX, what="generation token")
    except FileNotFoundError:
        return None
    _check_token_file(path, held)
    return held.decode().strip() or None


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
        # Never through a link, never blocking on a FIFO: RefusedFile ends the commit.
        fd = ownfiles.open_own(Path(ckpt_dir) / GENERATION_FILE).fd
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
