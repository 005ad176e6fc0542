"""Who may read what rtrain writes: one file mode for the run's files, torch-free, used by both
halves.

Policy: the files rtrain writes (state.json, events.jsonl, the lock, every checkpoint file) get
`file_mode`, default 0600; the directories it creates (the run dir, the checkpoint dir, each
checkpoint dir) get the same bits plus search (x) where read is granted: 0700 by default. The
directories keep others out, but one that exists already keeps its mode (the user chose it, e.g.
`--run-dir .` in a 0755 home), so attempt logs and stack dumps get `file_mode` too (`env_mode`:
the mode a child's environment carries). For a team directory set `file_mode = "0640"`
(group reads: inspect, status, report) or `"0660"` (group may also prune). Others may never
write. The metrics file is the exception: 0644, since a collector usually runs as another user.

The supervisor hands the mode to the worker in RTRAIN_FILE_MODE (octal, e.g. "0600").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rtrain.supervisor.core.errors import ConfigError

ENV_FILE_MODE = "RTRAIN_FILE_MODE"
"""Octal mode of the checkpoint files the worker writes (default 0600; dirs get the same plus
x where readable). `rtrain launch` sets it from `file_mode`; set it yourself for a script run
by hand."""
DEFAULT_FILE_MODE = 0o600
_ALLOWED = 0o666  # read and write bits only: no execute, setuid or sticky on data files


def parse_mode(value: Any, where: str = "file_mode") -> int:
    """A mode from the config (TOML `0o640`, or "0640" / "640") or the environment; ConfigError
    says what to change. The owner must keep read and write; others may not write."""
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        try:
            mode = int(text, 8)
        except ValueError:
            raise ConfigError(f"{where} must be an octal mode such as \"0600\" or \"0640\" "
                              f"(got {value!r})") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        mode = value
    else:
        raise ConfigError(f"{where} must be an octal mode such as \"0600\" (got {value!r})")
    if mode & ~_ALLOWED or mode & 0o600 != 0o600:
        raise ConfigError(f"{where} {mode:#05o}: use read/write bits only, with the owner's "
                          "read and write kept, e.g. \"0600\" or \"0640\"")
    if mode & 0o002:
        raise ConfigError(f"{where} {mode:#05o} lets every user write the run's files and "
                          "checkpoints; use \"0660\" and a group instead")
    return mode


def dir_mode(file_mode: int) -> int:
    """The directory mode that goes with `file_mode`: x wherever r is granted (0640 -> 0750)."""
    return file_mode | (file_mode & 0o444) >> 2


def from_env(env: dict[str, str] | None = None) -> int:
    """The worker's mode: RTRAIN_FILE_MODE, else the default (also when run by hand)."""
    raw = (os.environ if env is None else env).get(ENV_FILE_MODE)
    return DEFAULT_FILE_MODE if not raw else parse_mode(raw, ENV_FILE_MODE)


def env_mode(env: Mapping[str, str]) -> int:
    """The run's mode as a child's environment carries it (`from_env`); the default where it
    is missing or not a mode (a hand-made environment)."""
    try:
        return from_env(dict(env))
    except ConfigError:
        return DEFAULT_FILE_MODE


def make_dir(path: Path, file_mode: int) -> None:
    """Create `path` (and missing parents) with the policy's directory mode; an existing
    directory keeps its own."""
    path = Path(path)
    if path.is_dir():
        return
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    for d in missing:  # mkdir's mode is cut by the umask: set it exactly
        set_mode(d, dir_mode(file_mode))


def set_mode(target: Path | int, mode: int) -> None:
    """chmod a path or an open descriptor. Someone else's file in a shared directory cannot be
    changed by us (EPERM) and keeps its mode: not an error."""
    try:
        if isinstance(target, int):
            os.fchmod(target, mode)
        else:
            os.chmod(target, mode, follow_symlinks=False)
    except (PermissionError, NotImplementedError):
        pass


def apply_tree(root: Path, file_mode: int) -> None:
    """Give `root` (a directory being committed) and everything in it the policy's modes.
    Symlinks are never followed (a link in a checkpoint could point anywhere)."""
    set_mode(root, dir_mode(file_mode))
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                set_mode(path, dir_mode(file_mode) if name in dirnames else file_mode)

