"""Which attempt may commit into a checkpoint directory: a generation token.

Before each attempt the supervisor writes a fresh token into `<ckpt_dir>/.rtrain-generation`
and gives it to the child as RTRAIN_GENERATION. A writer (the child, its forked async writer,
rank 0 of a distributed save) takes its token when it starts a checkpoint and, right before the
commit's rename, checks under an exclusive flock of that file that the token is still the
current one. A writer left over from an earlier attempt (its supervisor was SIGKILLed and it
escaped the next launch's clean-up) is then refused instead of putting a checkpoint into a run
that has moved on. The supervisor advances the token under the same lock: a commit either
completed before the new token was written, or is refused.

Several nodes (`--nnodes`), each with its own supervisor, share one checkpoint dir: each node
keeps its own file, `.rtrain-generation-<node>`, and its token names it (`node_token`). A
group's commit carries every rank's token and is refused when any of its nodes has moved on (a
newer attempt there, which the group's failure or a restart for a new node brings), never
because a node outside the group started an attempt: a replacement node, started while the
survivors train on at the smaller size, must not fence their commits before it joins them.

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
import hashlib
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
TOKEN_MAX = 256  # bytes: a token is 32 hex digits, a node's 48
_TOKEN = re.compile(rb"\s*[0-9a-f]*\s*")
NODE_KEY_LEN = 16
"""Hex digits of a node's key, at the head of its tokens."""
_RANDOM_LEN = 32


class StaleWriter(CheckpointError):
    """A checkpoint writer whose run has moved on (a newer attempt started since)."""


def new_token() -> str:
    return uuid.uuid4().hex


def node_key(host: str, run_dir: Path) -> str:
    """One node's key among several sharing a checkpoint dir: its host and run dir, so a
    supervisor started again on the same node fences the writers its predecessor left."""
    name = f"{host}\0{os.path.realpath(run_dir)}".encode()
    return hashlib.blake2b(name, digest_size=NODE_KEY_LEN // 2).hexdigest()


def node_token(key: str) -> str:
    """A fresh token of the node `key` (node_key): it names that node's file."""
    return key + new_token()


def _short(token: str) -> str:
    """A token as messages show it: its random part's head (a node's key is the same in all
    of that node's tokens)."""
    return token[-_RANDOM_LEN:][:8]


def token_file(ckpt_dir: Path, token: str) -> Path:
    """The file that holds `token`'s generation: its node's, or the dir's one file."""
    if len(token) == NODE_KEY_LEN + _RANDOM_LEN:
        return Path(ckpt_dir) / f"{GENERATION_FILE}-{token[:NODE_KEY_LEN]}"
    return Path(ckpt_dir) / GENERATION_FILE


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:  # a filesystem without locks: check anyway, unserialised
        log.warning("cannot lock the checkpoint generation file (%s)", e.strerror)
    yield  # the lock goes with the descriptor, closed by the caller


def advance(ckpt_dir: Path, token: str) -> None:
    """Make `token` the current generation of `ckpt_dir` (the supervisor, before an attempt),
    in its node's file for a node's token."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = token_file(ckpt_dir, token)
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
    tokens of every rank of its group: each file they name (a node's) must hold one of them,
    so a newer attempt of any node of the group fences the whole group off. A dir's one file
    shared by several supervisors (tokens without a node, an older rtrain's) holds any of
    theirs."""
    tokens = {token} if isinstance(token, str) else {t for t in token or () if t}
    if not tokens or "" in tokens:
        yield
        return
    by_file: dict[Path, set[str]] = {}
    for t in tokens:
        by_file.setdefault(token_file(ckpt_dir, t), set()).add(t)
    with contextlib.ExitStack() as held:
        for path in sorted(by_file):  # one order for every writer: no two wait on each other
            try:
                # Never through a link, never blocking on a FIFO: RefusedFile ends the commit.
                fd = ownfiles.open_own(path).fd
            except FileNotFoundError:
                continue
            held.callback(os.close, fd)
            held.enter_context(_locked(fd))
            now = os.pread(fd, TOKEN_MAX, 0).decode(errors="replace").strip()
            if now and now not in by_file[path]:
                mine = ", ".join(sorted(_short(t) for t in tokens))
                raise StaleWriter(f"{what} not committed: its run has moved on (a newer attempt "
                                  f"started since this writer began; generation {mine}, "
                                  f"now {_short(now)})")
        yield
