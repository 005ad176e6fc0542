"""PyTorch's NCCL flight recorder for the child: switched on where there is a GPU, dumped on
a hang, its files kept in the attempt dir.

The recorder keeps the last collectives of every process group in a ring buffer (which
collective, its sequence number, sizes, state: scheduled, started, completed). Dumped from each
rank, it shows which rank never joined the collective the others wait in. rtrain sets, only
where the user has not set them (nor their newer `TORCH_FR_*` names):

- `TORCH_NCCL_TRACE_BUFFER_SIZE` = `TRACE_BUFFER_ENTRIES` (0, PyTorch's default, records nothing);
- `TORCH_NCCL_DUMP_ON_TIMEOUT` = 1: the watchdog dumps when a collective times out;
- `TORCH_NCCL_DEBUG_INFO_TEMP_FILE` = `<attempt dir>/nccl_trace_rank_`: each rank's dump is
  `nccl_trace_rank_<rank>` there (PyTorch's default is the system's temporary directory);
- `TORCH_NCCL_DEBUG_INFO_PIPE_FILE` = `<attempt dir>/nccl_trace_pipe_rank_`: each rank reads
  the FIFO `<prefix><rank>.pipe`, and anything written to it makes the rank dump at once.

rtrain finds a hang well before NCCL's own timeout (10 minutes by default), so at the hang it
writes to every rank's pipe (`request_dumps`), and once the attempt has ended it keeps the dumps
(`collect`): in the attempt dir already, or copied there from the prefix the user chose.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path

from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE

log = logging.getLogger(__name__)

TRACE_BUFFER = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")
DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
DUMP_FILE = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")
PIPE_FILE = ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE",)
TRACE_BUFFER_ENTRIES = 2000  # PyTorch's docs suggest 2000 for debugging; a few MB per rank
DUMP_PREFIX = "nccl_trace_rank_"
PIPE_PREFIX = "nccl_trace_pipe_rank_"
DUMP_MAX = 256 << 20  # a dump larger than this is not copied into the attempt dir


def environment(env: Mapping[str, str], attempt_dir: Path, *, gpu: bool) -> dict[str, str]:
    """The variables to add to the child's environment `env` (none without a GPU, none the
    user set)."""
    if not gpu:
        return {}
    wanted = ((TRACE_BUFFER, str(TRACE_BUFFER_ENTRIES)), (DUMP_ON_TIMEOUT, "1"),
              (DUMP_FILE, str(attempt_dir.resolve() / DUMP_PREFIX)),
              (PIPE_FILE, str(attempt_dir.resolve() / PIPE_PREFIX)))
    return {names[0]: value for names, value in wanted if not any(n in env for n in names)}


def _prefix(env: Mapping[str, str], names: tuple[str, ...]) -> Path | None:
    value = next((env[n] for n in names if env.get(n)), None)
    return Path(value) if value else None


def request_dumps(env: Mapping[str, str]) -> int:
    """Ask every rank for its dump now, through its pipe (`<pipe prefix><rank>.pipe`, a FIFO of
    this user's); how many took the request. Nothing to do where no pipe is set."""
    prefix = _prefix(env, PIPE_FILE)
    if prefix is None or not prefix.parent.is_dir():
        return 0
    asked = 0
    for path in prefix.parent.glob(prefix.name + "*.pipe"):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # no reader (ENXIO), or not a FIFO we may write
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISFIFO(st.st_mode) and st.st_uid == os.geteuid():
                os.write(fd, b"1\n")
                asked += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def collect(env: Mapping[str, str], attempt_dir: Path, *, since: float,
            mode: int = DEFAULT_FILE_MODE) -> list[Path]:
    """The recorder's dumps of this attempt (written at or after unix time `since`), in the
    attempt dir: those written elsewhere (a prefix the user chose) are copied in."""
    prefix = _prefix(env, DUMP_FILE)
    if prefix is None or not prefix.parent.is_dir():
        return []
    kept = []
    for path in sorted(prefix.parent.glob(prefix.name + "*")):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if (not stat.S_ISREG(st.st_mode) or path.name.endswith(".pipe")
                or st.st_mtime < since or st.st_uid != os.geteuid()):
            continue
        if path.parent.resolve() == attempt_dir.resolve():
            kept.append(path)
            continue
        if st.st_size > DUMP_MAX:
            log.warning("NCCL flight recorder dump %s not copied: %d bytes", path, st.st_size)
            continue
        target = attempt_dir / path.name
        try:  # never through a link planted at the name in the attempt dir
            with os.fdopen(ownfiles.open_own(path).fd, "rb") as src:  # swapped for a FIFO?
                out = ownfiles.open_own(target, os.O_WRONLY, create=True, mode=mode)
                with os.fdopen(out.fd, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        except OSError as e:
            log.warning("NCCL flight recorder dump %s not copied: %s", path, e)
            continue
        kept.append(target)
    return kept
