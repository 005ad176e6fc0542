"""The memory tier (`Saving(memory=...)`): snapshots of the training state in shared memory.

A snapshot is a checkpoint in the usual format (safetensors files, state.json, a manifest with
every file's hash, signed and encrypted as the run's disk checkpoints are) committed by the
same rename into RTRAIN_MEMORY_DIR, an owner-only directory in /dev/shm that rtrain creates and
persists from (supervisor/memtier/). So a snapshot verifies like a disk checkpoint, and rtrain
can copy it into the checkpoint dir, byte for byte, once this process is gone: a SIGKILL, a
segfault or the OOM killer loses the steps since the last snapshot, not since the last disk save.

The stall. A snapshot is taken at a step boundary. The small parts that change during a step
(RNG states, the data position, module buffers such as batch-norm statistics, the user's
extras) are copied at once; the parameters and the optimizer state change only inside
`optimizer.step()`, so with `overlap` a thread writes them into shared memory while the next
step's forward and backward run, and a pre-hook on the optimizer's `step()` waits until they
are copied. The stall is the capture plus what the copy does not hide. A single process's
snapshot is written into the files of the snapshot before the one it replaces, mapped once
(worker/memtier/shm_files.py): no page to allocate or free, one memmove per chunk without the
GIL, and each chunk hashed from the copy while it is in cache, so the manifest describes the
boundary's state. What the writer's CPU time costs a step is then the copy itself, on a
machine whose cores the step keeps busy (docs/benchmarks.md). A rank's part and an encrypted
snapshot go into new files, hashed after the copy (an encrypted one as it is encrypted).

Not waiting. Under "auto", a copy into reused files that the optimizer's pre-hook finds
unfinished is abandoned rather than waited for (CopyGate: the writer stops at its next chunk,
the files become spares, nothing is committed), at most MAX_ABANDONED times in a row; the
next one is waited for. A snapshot rtrain is to persist (a disk save) is always waited for.
Why the writer keeps the normal priority: it shares the GIL with the training thread, and a
SCHED_IDLE writer descheduled while it holds the GIL (between two chunks, in the commit) holds
the training thread back behind every other runnable process, DataLoader workers included.

Double buffering. A snapshot is written into a temp dir and renamed into place; the one before
is taken out of the committed names only after the newer one committed, so a process killed
mid-snapshot leaves the previous snapshot whole (a temp dir is never read: rtrain's pick reads
committed names only). rtrain hard-links the snapshot it copies, so neither a removal nor a
reuse here cuts its copy short: a file linked elsewhere is never written again. What an
earlier attempt left (its spare files, a temp dir whose writer died) goes at the first
snapshot.

The budget. Two snapshots live at once (the newest, and the one being written or the spare
files the next one is written into): a state that does not fit twice in `budget_mb` (default:
half of the memory available at the first snapshot, and of the cgroup's room) or in the free
space of the shared-memory filesystem (a container's /dev/shm is often 64 MiB) leaves the tier
off, with a warning that says what to change (left out, `memory=` is on only where it fits).
The pages count against the run's memory cgroup; rtrain drops the tier before the training
process would be OOM-killed (writing `dropped` into the directory); the process unmaps its
files at its next step boundary, which frees their pages. A snapshot that fails (no space)
turns the tier off and training goes on: the disk tier is untouched.

The disk cadence. While the tier is on, a disk save due on the schedule (`every=`) is a
snapshot of that step followed, once it committed, by a `persist` heartbeat: rtrain copies it
into the checkpoint dir in the background and prunes with the Keep policy every snapshot's
manifest records (`info.keep`; a heartbeat carries no policy: supervisor/memtier/
diskcadence.py), so the loop pays the snapshot, not the disk write. A stop
request, `request_save()`, `save()` and the save at a failure still write to disk from this
process: they must be durable before it goes on or exits. A snapshot rtrain was to persist that
fails makes the next step boundary save to disk here instead (`persist_lost`). The tier on by
default hands the scheduled saves over as the named one does (worker/memtier/handoff.py). Such
a snapshot is never abandoned, and the optimizer's next step waits until it committed before
the live state's mark goes: with the live state on, a kill at any moment after the hand-off
finds the step in memory (marked, or committed) and rtrain commits it at the attempt's end;
without it, a kill before the commit leaves the snapshot or checkpoint before.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from rtrain.checkpoint import hashing, parts, runid, safetensors_io
from rtrain.checkpoint.commit import PendingCheckpoint, remove_dir
from rtrain.checkpoint.layout import TRASH_PREFIX, list_checkpoints, list_leftovers
from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.atomic_write import STORAGE_ERRNOS, write_atomic
from rtrain.supervisor.core.protocol import ENV_MEMORY_DIR, MEMORY_DROPPED
from rtrain.worker import dist, runtime
from rtrain.worker.compilecache import compile_cache
from rtrain.worker.guards import faults
from rtrain.worker.memtier import pacing, shm_files
from rtrain.worker.memtier.live import LiveState
from rtrain.worker.options import Memory
from rtrain.worker.saving import dist_ckpt
from rtrain.worker.saving.save_clock import run_mtbf
from rtrain.worker.saving.save_target import Capture, SaveTarget
from rtrain.worker.trainstate.tensors import to_blob

log = logging.getLogger(__name__)

_HEADROOM = 1 << 20  # bytes beyond the tensors: manifest, state.json, safetensors headers
MAX_ABANDONED = 2  # snapshots abandoned in a row before the next one is waited for
PROBE_EVERY = 8  # at an interval of 1, one snapshot in this many is skipped: the plain step
REPACE_STEPS = 32  # once the cost is measured, the interval is re-chosen this often
PACE_FILE = ".pace.json"  # in the memory dir: the steps measured, for the next attempt
# An attempt's first steps are not measured: the restore's first allocations, and rtrain's
# copy of the snapshot it resumed from to the checkpoint dir beside them (0.15-0.2 s). More
# left an attempt killed 12-20 steps in with too few steps to measure a snapshot's cost.
WARMUP_STEPS = 2


def budget_bytes(opts: Memory) -> int:
    """The tier's memory budget: `budget_mb`, else half of what the host has available, and
    of what the run's memory cgroup has left below its limit (the snapshots' pages count
    against it: a budget the cgroup cannot hold would bring the OOM killer the tier is for)."""
    if opts.budget_mb is not None:
        return int(opts.budget_mb * 2**20)
    room = cgroup_room_bytes()
    return min(available_bytes(), room if room is not None else available_bytes()) // 2


def cgroup_room_bytes(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this process's memory cgroup may still use below its limit (v1's
    memory.limit_in_bytes, else v2's memory.max, each at its usual mount under `root`); None
    without a limit or where none can be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f]
    except OSError:
        return None
    for _, controllers, rel in (ln for ln in lines if len(ln) == 3):
        if "memory" in controllers.split(","):
            group, names = root / "memory" / rel.lstrip("/"), ("memory.limit_in_bytes",
                                                              "memory.usage_in_bytes")
        elif controllers == "":
            group, names = root / rel.lstrip("/"), ("memory.max", "memory.current")
        else:
            continue
        try:
            limit = (group / names[0]).read_text().strip()
            used = int((group / names[1]).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 62:  # "max", or v1's near-2**63: none
            return max(0, int(limit) - used)
    return None


def available_bytes() -> int:
    """MemAvailable (free plus reclaimable cache); free pages where /proc/meminfo says nothing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def refusal(nbytes: int, budget: int, shm_free: int, copies: int = 2) -> str | None:
    """Why a state of `nbytes` cannot have a memory tier (None: it fits `copies` times: the
    snapshots kept and the one being written)."""
    need = copies * (nbytes + _HEADROOM)
    gib = 2**30
    times = {2: "twice", 3: "three times"}.get(copies, f"{copies} times")
    if need > budget:
        return (f"the state ({nbytes / gib:.2f} GiB) does not fit {times} in the tier's budget "
                f"({budget / gib:.2f} GiB): raise Memory(budget_mb=) or free host memory")
    if need > shm_free:
        return (f"the state ({nbytes / gib:.2f} GiB) does not fit {times} in the shared-memory "
                f"filesystem's free space ({shm_free / gib:.2f} GiB): give it more (a "
                f"container's --shm-size) or set memory=None")
    return None


class Abandoned(Exception):
    """The optimizer's step came before the snapshot's copy was done, and did not wait for it:
    that snapshot is never committed."""


class CopyGate:
    """Between a snapshot's copy and the optimizer's next step, decided under one lock: the
    copy finished first (`set`: the step may change the state), or the step came first and
    abandoned it (`abandon`: the writer stops at its next chunk and commits nothing). So a
    snapshot is whole from one step boundary, or it is not a snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.read = threading.Event()  # the copy is done (or there is none)
        self.read.set()
        self.abandoned = False

    def arm(self) -> None:
        """A new snapshot starts reading the live state."""
        self.read.clear()
        self.abandoned = False

    def set(self) -> None:
        """The writer: every byte is copied; raises Abandoned if the step came first."""
        with self._lock:
            if self.abandoned:
                raise Abandoned
            self.read.set()

    def check(self) -> None:
        """The writer, before each chunk: raises Abandoned once the step came."""
        if self.abandoned:
            raise Abandoned

    def abandon(self) -> bool:
        """The optimizer's pre-hook: abandon the copy unless it is done (True: abandoned)."""
        with self._lock:
            if self.read.is_set():
                return False
            self.abandoned = True
            self.read.set()  # nothing is left to wait for
            return True


def write_snapshot(target: SaveTarget, cap: Capture, copied: CopyGate | threading.Event,
                   files: shm_files.ShmFiles | None = None) -> Path:
    """Commit `cap` into the memory dir: every tensor copied first, `copied` set, then the
    files hashed from the copy (unencrypted) and the manifest committed. With `files`, each
    tensor file is written into a reused, mapped file and hashed chunk by chunk as it is
    copied (worker/memtier/shm_files.py); a CopyGate may abandon that copy (Abandoned is
    raised, the files kept as spares). Raises on any error, leaving nothing behind but what
    the next snapshot's commit removes."""
    check = copied.check if isinstance(copied, CopyGate) else None
    pending = PendingCheckpoint(target.ckpt_dir, cap.step, fsync=False,
                                hash_alg=hashing.alg_for(target.key),
                                encryption=target.encryption)
    try:
        later = []
        for stem, tensors in cap.tensors.items():  # FILES, and a rank's rng-rank<R> file
            name = f"{stem}.safetensors"
            blobs = [to_blob(n, t) for n, t in tensors.items()]
            meta = _rank_rng_meta(cap, stem)
            if target.encryption is not None:
                pending.write_tensors(name, blobs, metadata=meta)  # encrypted and hashed at once
                continue
            listed = {b.name: [b.dtype, list(b.shape)] for b in blobs}
            if files is not None:
                header = safetensors_io.build_header(blobs, meta)
                f = files.take(pending.tmp, name, len(header) + sum(b.data.nbytes for b in blobs))
                done = shm_files.fill(f, header, tensors.values(), pending.hash_alg, check)
                faults.on_save_write(cap.step)
                pending.add_file(name, done.size, done.hash, listed)
                continue
            safetensors_io.write_file(pending.tmp / name, blobs, metadata=meta, fsync=False,
                                      hash_alg=None)
            faults.on_save_write(cap.step)  # chaos: a death between two files of a snapshot
            later.append((name, listed))
        copied.set()  # the live state may change from here on
        for name, listed in later:
            path = pending.tmp / name
            pending.add_file(name, path.stat().st_size,
                             hashing.hash_file(path, pending.hash_alg), listed)
        if cap.world is None or cap.world.leader:
            pending.write_bytes("state.json", json.dumps(cap.state_json).encode())
        # A disk-cadence snapshot's compile cache (worker/compilecache/compile_cache.py).
        if cap.compile_cache is not None:
            pending.write_bytes(compile_cache.FILE, cap.compile_cache)
        path = pending.commit(cap.fields, target.key)
    except Abandoned:
        if files is not None:
            files.abandoned(pending.tmp)
        pending.abort()  # whatever is left of the temp dir
        raise
    except BaseException:
        if files is not None:
            files.aborted()
        pending.abort()
        raise
    if files is not None:
        files.committed(path)
    return path


def _rank_rng_meta(cap: Capture, stem: str) -> dict[str, str] | None:
    """A rank's part carries its python/numpy RNG in its RNG file's metadata, as on disk."""
    if cap.world is None or stem != dist_ckpt.rng_stem(cap.world.rank):
        return None
    return {"rng": json.dumps(cap.rank_rng)}


class MemoryTier:
    """Snapshots into RTRAIN_MEMORY_DIR at the `Memory` option's cadence, one at a time."""

    def __init__(self, opts: Memory, directory: Path, key: bytes | None, encryption: Any,
                 model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                 kept: int = 1, reuse: bool = False, implicit: bool = False) -> None:
        self.opts, self.dir = opts, directory
        # On because the script left `memory=` out (options.MEMORY_DEFAULT): the same tier,
        # but the disk saves stay this process's own (worker/checkpointer.py).
        self.implicit = implicit
        # rtrain's `dropped` lies in the node's memory dir, above a rank's own directory.
        self.dropped = (directory.parent if parts.RANK_DIR.fullmatch(directory.name)
                        else directory) / MEMORY_DROPPED
        self.model, self.optimizer = model, optimizer
        self.target = SaveTarget(directory, False, key, lambda n: None, encryption=encryption)
        self.overlap = opts.overlap and optimizer is not None
        # Committed snapshots kept. A rank's part keeps the one before its newest too: the
        # ranks snapshot the same steps, but one may commit a step as another dies before
        # committing it, and the group resumes from a step every rank holds (three buffers).
        self.kept = kept
        self._committed: list[Path] = []  # this process's newest snapshots, oldest first
        # A single process's unencrypted snapshots go into reused, mapped files
        # (worker/memtier/shm_files.py); used by the writer thread, released by the training
        # thread only while no snapshot is running.
        self._files = shm_files.ShmFiles() if reuse and encryption is None else None
        self._swept = False  # the leftovers of earlier attempts removed (first snapshot)
        self._auto = not isinstance(opts.every, int)
        self.every = opts.every if isinstance(opts.every, int) else 1
        self.off: str | None = None
        self.last_step: int | None = None  # the newest committed snapshot's step
        self.stall_s: float | None = None  # the newest snapshot's stall, gate wait included
        self.write_s: float | None = None  # the newest snapshot's write, start to commit
        # One writer thread for the process's life, started at the first snapshot: starting a
        # thread per snapshot cost the training thread several ms on a loaded machine.
        self._thread: threading.Thread | None = None
        # Each job: the capture, and whether rtrain is to persist it (a disk save).
        self._jobs: queue.SimpleQueue[tuple[Capture, bool] | None] = queue.SimpleQueue()
        # The Checkpointer's Keep policy (RetentionPolicy's fields), recorded in each
        # snapshot's manifest as info.keep: what rtrain prunes with after persisting one.
        self.keep: dict[str, Any] | None = None
        self._pending = False  # a snapshot was handed to the writer and not waited for
        self._idle = threading.Event()  # set while the writer has nothing in hand
        self._idle.set()
        # Whether the running snapshot read the live tensors, or the optimizer abandoned it.
        self._copy = CopyGate()
        self.abandoned = 0  # snapshots abandoned so far
        self._abandoned_in_row = 0
        self._persisting = False  # the running snapshot is a disk save: never abandoned
        # Cleared while a disk save's snapshot is being written: set once it committed (or
        # failed). The optimizer's pre-hook waits for it before the live state's mark goes.
        self._persisted = threading.Event()
        self._persisted.set()
        # The steps' durations, beside a snapshot and not, continued from the attempts before.
        self.costs = pacing.Costs.from_state(_read_pace(directory))
        self._steps_seen = 0  # step boundaries this process saw (WARMUP_STEPS)
        self._boundary: float | None = None  # the previous step boundary's time
        self._beside = False  # a snapshot started at the previous boundary
        # ShmFiles.created at the previous boundary: a snapshot that made its files new paid
        # the kernel for every page once (80 ms for 126 MiB here, against 10 ms into reused
        # ones), which the steps beside it are not to count (Costs.hold).
        self._created_seen = 0
        self._dues = 0  # step boundaries seen at an interval of 1 (PROBE_EVERY)
        self._repaced: int | None = None  # the step the measured cost last chose the interval
        self.cost_s: float | None = None  # what a snapshot costs the steps (pacing.py)
        self.nbytes = 0  # the newest snapshot's tensor bytes
        # What each snapshot took of the CPU (its stall, gate wait included, and the writer's
        # CPU time): the most it can cost a step whose cores it competes for, a bound on a
        # measured cost that noise on a loaded machine can push far above it.
        self._cpu_costs: deque[float] = deque(maxlen=pacing.WINDOW)
        self._pace_written = 0.0  # when PACE_FILE was last written
        self._gate_wait = 0.0  # the optimizer step's wait for the running snapshot
        self.gate_s = 0.0  # that wait, for the last snapshot that finished
        # (step, time, process CPU time) of the previous snapshot
        self._last_call: tuple[int, float, float] | None = None
        self.writer_cpu_s = 0.0  # the writer thread's CPU time for the newest snapshot
        self._last_cpu = 0.0  # ... for the newest that finished, committed or abandoned
        self._last_fresh = False  # ... and whether it made new files (not counted: pacing)
        self._said: dict[str, Any] | None = None  # the interval last told to rtrain
        # A snapshot rtrain was to persist as a disk save failed: the Checkpointer saves to
        # disk itself at the next step boundary instead.
        self.persist_lost = False
        self._started: int | None = None  # the step of the newest snapshot handed to the writer
        # The parameters and optimizer state kept in shared memory (worker/memtier/live.py):
        # a single process's unencrypted tier, on the same assumption as `overlap`.
        self.live = (LiveState(directory, model, optimizer, unread=self._copy.read.wait,
                               spares=self._files)
                     if self.overlap and self._files is not None else None)
        self._hook = (optimizer.register_step_pre_hook(self._gate)
                      if self.overlap and optimizer is not None else None)

    @classmethod
    def open(cls, opts: Memory | None, *, world: dist.World | None, key: bytes | None,
             encryption: Any, model: torch.nn.Module | None,
             optimizer: torch.optim.Optimizer | None,
             implicit: bool = False) -> MemoryTier | None:
        """The tier, or None (with a warning) where it cannot run. Under a process group each
        rank snapshots its own part into `rank-<R>/` of the node's memory dir
        (checkpoint/parts.py). `implicit`: the script left `memory=` out; then the tier is off,
        without a warning, outside `rtrain launch` (nothing would persist a snapshot) and under
        a process group (a rank's part goes into new files, several times a single process's
        cost: a tier the script names)."""
        if opts is None:
            return None
        where = os.environ.get(ENV_MEMORY_DIR)
        if not where:
            if not implicit:
                log.warning("memory tier off: it runs under `rtrain launch`, which persists "
                            "the snapshots; this process saves to disk only")
            return None
        if implicit and (world is not None or _launched_ranks() > 1):
            log.info("memory tier off by default under a process group: name it "
                     "(Saving(memory=\"auto\")) to snapshot each rank's part")
            return None
        directory, kept = Path(where), 1
        # Reused files only for a single process: rtrain's peer server reads a rank's parts
        # without pinning them.
        reuse = world is None
        if world is not None:
            if dist.is_sharded(model):
                log.warning("memory tier off: sharded (FSDP/DTensor) state is saved by DCP; in "
                            "this release the ranks save it to disk only")
                return None
            try:
                directory, kept = _rank_dir(directory, world.rank), 2
            except OSError as e:
                log.warning("memory tier off: cannot create this rank's directory in %s: %s",
                            where, e.strerror or e)
                return None
        return cls(opts, directory, key, encryption, model, optimizer, kept, reuse, implicit)

    def due(self, step: int) -> bool:
        now = time.monotonic()
        self._steps_seen += 1
        created = self._files.created if self._files is not None else 0
        if (self._files is not None and self._files.max_spares > 1
                and (self.live is None or self.live.off is not None or self.live.adopted)):
            self._files.limit(1)  # the live state took its files, or takes none
        if created != self._created_seen:  # this step and the next, which it may reach
            self._created_seen = created
            self.costs.hold(2)
        measured = self._boundary is not None and self._steps_seen > WARMUP_STEPS
        self.costs.step(now - self._boundary if measured else None, self._beside)
        self._boundary, self._beside = now, False
        if self._files is not None and self._files.held:
            # Mapped files keep their pages until unmapped, whoever deletes them: released at
            # this step boundary once the tier is off or rtrain dropped it, not at the next
            # snapshot, which may be many steps away.
            if self.off is None and self.dropped.exists():
                self.stop("rtrain dropped it (memory pressure); the disk tier goes on", step)
            if self.off is not None:
                self.release()
        if self.off is not None:
            return False
        if isinstance(self.opts.every, int):
            return step % self.every == 0
        # From the last snapshot started, committed or not: a first one still being written
        # must not make every step after it wait for it.
        if self._last_call is not None and step - self._last_call[0] < self.every:
            return False
        if self.every == 1 and self._last_call is not None and self._auto:
            # Snapshots at every step leave no plain step to measure their cost against.
            self._dues += 1
            if self._dues % PROBE_EVERY == 0:
                return False
        return True

    def snapshot(self, cap: Capture, persist: bool = False) -> bool:
        """Start writing `cap` (taken at this step boundary); returns once the training
        thread may go on (see the module docstring), False when the tier took nothing.
        `persist`: once committed, ask rtrain to copy the snapshot to the checkpoint dir, as
        the disk save of this step."""
        began = time.monotonic()
        self.wait()
        if self.off is not None:
            self.release()
            return False
        if cap.sharded is not None:
            self.stop("sharded (FSDP/DTensor) state is saved by DCP; in this release the ranks "
                      "save it to disk only", cap.step)
            return False
        if self.dropped.exists():
            self.stop("rtrain dropped it (memory pressure); the disk tier goes on", cap.step)
            return False
        if not self._swept:  # before the space is counted: an earlier attempt's spares
            self._swept = True  # are taken as this process's, or go
            _sweep(self.dir, self._files)
        if self.last_step is None and not self._pending:
            why = refusal(cap.nbytes, budget_bytes(self.opts),
                          _free_bytes(self.dir) + self._spare_bytes(), self.kept + 1)
            if why is not None:
                self.stop(why, cap.step)
                return False
        self.nbytes = cap.nbytes
        if self.overlap:
            _copy_unguarded(cap, _storages(_guarded(self.model, self.optimizer)),
                            _storages(_buffers(self.model)))
        self._mark_fields(cap)
        info = cap.fields["info"]
        if cap.world is not None:
            info.update(parts.part_fields(cap.world.rank, cap.world.size))
        self._pace(cap.step, began)
        self._copy.arm()
        self._persisting = persist
        if persist:
            self._persisted.clear()
            # A disk save's: rtrain's copy to the checkpoint dir runs beside this step and the
            # next. That is the disk cadence's cost (worker/saving/cadence.py counts it), not a
            # snapshot's, which would otherwise come out several times what it is.
            self.costs.hold(2)
        self._beside = True
        self._idle.clear()
        self._gate_wait = 0.0
        self._pending = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rtrain-memory-snapshot",
                                            daemon=True)
            self._thread.start()
        self._jobs.put((cap, persist))
        self._started = cap.step
        if not self.overlap:
            self._copy.read.wait()
        self.stall_s = time.monotonic() - began
        return True

    def wait(self) -> None:
        """The running snapshot committed (or failed: the tier is then off)."""
        if self._pending:
            self._idle.wait()
            self._pending = False
            if self.stall_s is not None:
                self.stall_s += self._gate_wait  # the stall that snapshot cost the loop
                if not self._last_fresh:
                    self._cpu_costs.append(self.stall_s + self._last_cpu)
            self.gate_s = self._gate_wait

    def live_wanted(self) -> bool:
        """Whether `boundary` has anything to do (a capture costs a step ~1 ms otherwise)."""
        return self.live is not None and self.live.off is None

    def boundary(self, cap: Capture) -> None:
        """A step boundary (`cap` taken at it, after any snapshot of it started): the live
        state marks it whole, once its files fit the shared-memory filesystem beside the
        snapshots (one more copy of the state; no more host memory: its pages replace the
        process's own)."""
        live = self.live
        if live is None or live.off is not None:
            return
        if self.off is not None:
            live.stop(self.off)
            return
        if not live.adopted and self._files is not None:
            why = refusal(cap.nbytes, 1 << 62,
                          _free_bytes(self.dir) + self._live_bytes() + self._spare_bytes(),
                          self.kept + 2)
            if why is not None:
                live.stop(why)
                return
        self._mark_fields(cap)
        adopted = live.adopted
        live.boundary(cap, self._started)
        if live.adopted and not adopted:  # the copy into the live files: the next step's
            self.costs.hold(1)

    def _spare_bytes(self) -> int:
        """What the spare files hold of the filesystem: theirs to fill before new ones."""
        return self._files.spare_bytes if self._files is not None else 0

    def _live_bytes(self) -> int:
        """What the live files already hold of the filesystem (adopted again: freed first)."""
        return self.live.nbytes if self.live is not None else 0

    def _mark_fields(self, cap: Capture) -> None:
        info = cap.fields.setdefault("info", {})
        info["memory_snapshot"] = True
        if self.keep is not None:
            info["keep"] = self.keep

    def close(self) -> None:
        if self.live is not None:
            self.live.close()
        self.wait()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.release()

    def release(self) -> None:
        """Unmap the snapshots' files and delete the spares (the training thread, after
        `wait`): the next snapshot writes new files. Committed snapshots stay."""
        self.wait()
        if self._files is not None:
            self._files.close()

    def stop(self, why: str, step: int | None = None) -> None:
        """Turn the tier off for this process, once, saying why to the log and to rtrain."""
        if self.off is not None:
            return
        self.off = why
        log.warning("memory tier off: %s", why)
        if self.live is not None and threading.current_thread() is not self._thread:
            self.live.stop(why)
        runtime.heartbeat(step=step, event="snapshot", snapshot={"off": why})
        if threading.current_thread() is not self._thread:
            self.release()

    def _gate(self, *_: Any) -> None:
        """The optimizer's step pre-hook: the running snapshot must have read the state first,
        or be abandoned. Under "auto", a snapshot into reused files that is not a disk save is
        abandoned rather than waited for, MAX_ABANDONED times in a row at most: the previous
        one stays the newest, whole (CopyGate); the next after those is waited for. A fixed
        interval is the script's word for how many steps a kill may lose: always waited for.

        A disk save handed to rtrain is waited for until it committed, before the live state's
        mark goes: its step stays whole in memory (marked, then committed), so a kill inside
        this optimizer step does not lose it either."""
        if self._persisting and not self._persisted.is_set():
            t0 = time.monotonic()
            self._persisted.wait()
            self._gate_wait += time.monotonic() - t0
        if self.live is not None:
            self.live.stepping()  # before anything changes: the live state is no step now
        if self._copy.read.is_set():
            return
        if (self._auto and self._files is not None and not self._persisting
                and self._abandoned_in_row < MAX_ABANDONED and self._copy.abandon()):
            self._abandoned_in_row += 1
            self.abandoned += 1
            return
        t0 = time.monotonic()
        self._copy.read.wait()
        self._gate_wait += time.monotonic() - t0

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._write(*job)
            finally:
                self._idle.set()

    def _write(self, cap: Capture, persist: bool = False) -> None:
        t0, cpu0 = time.monotonic(), time.thread_time()
        created = self._files.created if self._files is not None else 0
        try:
            path = write_snapshot(self.target, cap, self._copy, self._files)
        except Abandoned:
            self._last_cpu = time.thread_time() - cpu0
            return  # the previous snapshot stays the newest; the files are spares again
        except OSError as e:  # a failed snapshot costs the tier, never the training
            why = os.strerror(e.errno) if e.errno in STORAGE_ERRNOS else f"{e}"
            self.stop(f"the snapshot of step {cap.step} could not be written: {why}", cap.step)
            self.persist_lost = self.persist_lost or persist
            return
        except BaseException as e:
            self.stop(f"the snapshot of step {cap.step} failed: {type(e).__name__}: {e}",
                      cap.step)
            self.persist_lost = self.persist_lost or persist
            return
        finally:
            self._last_fresh = self._files is not None and self._files.created != created
            self._copy.read.set()
            self._persisted.set()
        self._abandoned_in_row = 0
        self.write_s = time.monotonic() - t0
        self.writer_cpu_s = self._last_cpu = time.thread_time() - cpu0
        self.last_step = cap.step
        # Double buffering: the others go only after the newer one committed; anything this
        # process did not just write goes too (an earlier attempt's, e.g. steps beyond a
        # rollback's: never the newest in memory again).
        self._committed = [*self._committed, path][-self.kept:]
        for _, older in list_checkpoints(self.dir):
            if older not in self._committed:
                try:
                    if self._files is None:
                        remove_dir(older)
                    elif not self._files.retire(older):
                        self._files.adopt(older)  # an earlier attempt's: its files reused
                except OSError:
                    pass  # rtrain took it away (it pins what it copies) or removed the dir
        if persist:  # only now: rtrain copies the newest snapshot at this step or later
            runtime.heartbeat(step=cap.step, event="persist")
        if self._auto and time.monotonic() - self._pace_written >= 1.0:
            # Here, off the training thread, once a second: what the steps measured so far.
            self._pace_written = time.monotonic()
            try:
                state = self.costs.state()
            except RuntimeError:  # the training thread added a step meanwhile: next time
                return
            _write_pace(self.dir, state)

    def _pace(self, step: int, now: float) -> None:
        """Under "auto", choose the next interval from what snapshots cost the steps
        (pacing.py): the steps' measured difference once there is one (this attempt's and
        the ones' before, PACE_FILE), re-chosen every REPACE_STEPS; before it, every
        MEASURE_EVERY steps to measure it. Tells rtrain when the tier starts, the cost is
        first measured, or the interval changes."""
        prev, self._last_call = self._last_call, (step, now, time.process_time())
        measured = self.costs.cost_s()
        step_s = self.costs.step_s()
        if measured is not None:
            cpu = statistics.median(self._cpu_costs) if self._cpu_costs else None
            busy = 0.0
            if prev is not None and now > prev[1]:
                busy = (self._last_call[2] - prev[2]) / ((now - prev[1]) * _cores())
            self.cost_s = pacing.bounded_cost(measured, cpu, busy)
        if step_s is None and prev is not None and step > prev[0]:
            step_s = (now - prev[1]) / (step - prev[0])
        due = self._repaced is None or step - self._repaced >= REPACE_STEPS
        if self._auto and self.cost_s is None and prev is not None:
            # Nothing measured yet: every other step, so that the steps measure the cost at
            # once. An estimate from the writer's CPU time said 17-20 steps for a snapshot that
            # cost nothing measurable beside a step that left idle time (a lower-priority
            # writer's CPU time is not the step's), and so measured late, if ever.
            self.every = pacing.MEASURE_EVERY
        elif self._auto and self.cost_s is not None and step_s is not None and due:
            mtbf = run_mtbf()
            self.every = pacing.interval(cost_s=self.cost_s, write_s=self.write_s or 0.0,
                                         step_s=step_s,
                                         mtbf_s=mtbf.seconds if mtbf.observed else None)
            if measured is not None:
                self._repaced = step
        said = {"every": self.every, "stall_s": _rounded(self.stall_s),
                "write_s": _rounded(self.write_s), "cost_s": _rounded(self.cost_s),
                "step_s": _rounded(step_s), "bytes": self.nbytes,
                "measured": measured is not None}
        # Under "auto", also once the cost is first measured: rtrain says it then.
        if (self._said is None or said["every"] != self._said["every"]
                or (self._auto and said["measured"] != self._said["measured"])):
            self._said = said
            runtime.heartbeat(step=step, event="snapshot", snapshot=said)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _launched_ranks() -> int:
    """WORLD_SIZE as torchrun sets it: several ranks even before (or without) a process group,
    whose single-process snapshots would share one memory dir."""
    try:
        return int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return 1


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _read_pace(directory: Path) -> Any:
    """The step durations earlier attempts measured (PACE_FILE; pacing.Costs.from_state checks
    them), None without a file that reads: an attempt killed within a few dozen steps then
    adds to their estimate instead of measuring from nothing each time."""
    try:
        return json.loads(ownfiles.read_own(directory / PACE_FILE, limit=16384))
    except (OSError, ownfiles.RefusedFile, ValueError):
        return None


def _write_pace(directory: Path, state: dict[str, list[float]]) -> None:
    if not directory.is_dir():  # rtrain removed it: never made again from here
        return
    try:
        write_atomic(directory / PACE_FILE, json.dumps(state), durable=False)
    except OSError:
        pass  # the next attempt measures again


def _guarded(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None
             ) -> list[torch.Tensor]:
    """What changes only inside optimizer.step(): the parameters and the optimizer's state."""
    out = list(model.parameters()) if model is not None else []
    if optimizer is not None:
        for group in optimizer.param_groups:
            out.extend(group["params"])
        for st in optimizer.state.values():
            out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


def _buffers(model: torch.nn.Module | None) -> list[torch.Tensor]:
    """What a module changes outside the optimizer's step (batch-norm statistics in the
    forward): its buffers. Walked directly, not through a second state_dict()."""
    return list(model.buffers()) if model is not None else []


def _storages(tensors: list[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.device.type == "cpu"}


def _copy_unguarded(cap: Capture, guarded: set[int], buffers: set[int]) -> None:
    """Copy, now, every captured tensor that may change before the optimizer's step: module
    buffers, and anything in the extras file (the user's own tensors). Parameters and the
    optimizer state stay shared: the optimizer's pre-hook guards them. Tensors the capture made
    for itself (RNG states, data position, a device's state copied to the host) are left."""
    for stem, tensors in cap.tensors.items():
        for name, t in tensors.items():
            ptr = t.untyped_storage().data_ptr()
            if ptr in guarded:
                continue
            if ptr in buffers or stem == "extra":
                tensors[name] = t.clone()


def _rank_dir(memory_dir: Path, rank: int) -> Path:
    """This rank's part of the node's memory dir, owner-only, with the run identity rtrain
    put in the memory dir (each part's manifest names the run)."""
    path = parts.rank_dir(memory_dir, rank)
    path.mkdir(mode=0o700, exist_ok=True)
    run = runid.read(memory_dir)
    if run is not None and runid.read(path) != run:
        runid.write(path, run)
    return path


def _sweep(memory_dir: Path, files: shm_files.ShmFiles | None) -> None:
    """What earlier attempts left in the memory dir: a retired snapshot's spare files
    (trash-named) are taken as this process's spares (`files`), or removed; a temp dir whose
    writer died is removed. Committed snapshots and rtrain's pins stay."""
    for left in list_leftovers(memory_dir):
        if files is not None and left.path.name.startswith(TRASH_PREFIX):
            files.adopt(left.path, populate=False)  # the training thread's time
        elif left.path.name.startswith(TRASH_PREFIX) or not left.writer_alive():
            shutil.rmtree(left.path, ignore_errors=True)


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
