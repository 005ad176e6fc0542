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

Double buffering. A snapshot is written into a temp dir and renamed into place; the one before
is taken out of the committed names only after the newer one committed, so a process killed
mid-snapshot leaves the previous snapshot whole (a temp dir is never read: rtrain's pick reads
committed names only). rtrain hard-links the snapshot it copies, so neither a removal nor a
reuse here cuts its copy short: a file linked elsewhere is never written again. What an
earlier attempt left (its spare files, a temp dir whose writer died) goes at the first
snapshot.

The budget. Two snapshots live at once (the newest, and the one being written or the spare
files the next one is written into): a state that
does not fit twice in `budget_mb` (default: half of the memory available at the first snapshot)
or in the free space of the shared-memory filesystem (a container's /dev/shm is often 64 MiB)
leaves the tier off, with a warning that says what to change. The pages count against the
run's memory cgroup; rtrain drops the tier before the training process would be OOM-killed
(writing `dropped` into the directory); the process unmaps its files at its next step
boundary, which frees their pages. A snapshot that fails (no space) turns the tier off and
training goes on: the disk tier is untouched.

The disk cadence. While the tier is on, a disk save due on the schedule (`every=`) is a
snapshot of that step followed, once it committed, by a `persist` heartbeat: rtrain copies it
into the checkpoint dir in the background and prunes with the Keep policy every snapshot's
manifest records (`info.keep`; a heartbeat carries no policy: supervisor/memtier/
diskcadence.py), so the loop pays the snapshot, not the disk write. A stop
request, `request_save()`, `save()` and the save at a failure still write to disk from this
process: they must be durable before it goes on or exits. A snapshot rtrain was to persist that
fails makes the next step boundary save to disk here instead (`persist_lost`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

from rtrain.checkpoint import hashing, parts, runid, safetensors_io
from rtrain.checkpoint.commit import PendingCheckpoint, remove_dir
from rtrain.checkpoint.layout import TRASH_PREFIX, list_checkpoints, list_leftovers
from rtrain.supervisor.core.atomic_write import STORAGE_ERRNOS
from rtrain.supervisor.core.protocol import ENV_MEMORY_DIR, MEMORY_DROPPED
from rtrain.worker import dist, runtime
from rtrain.worker.compilecache import compile_cache
from rtrain.worker.guards import faults
from rtrain.worker.memtier import shm_files
from rtrain.worker.options import Memory
from rtrain.worker.saving import dist_ckpt
from rtrain.worker.saving.save_target import Capture, SaveTarget
from rtrain.worker.trainstate.tensors import to_blob

log = logging.getLogger(__name__)

MAX_STALL_SHARE = 0.05  # "auto": the stall at most this share of the time between snapshots
_HEADROOM = 1 << 20  # bytes beyond the tensors: manifest, state.json, safetensors headers


def interval(stall_s: float, write_s: float, step_s: float) -> int:
    """Steps between snapshots under `every="auto"`: the fewest that keep the stall within
    MAX_STALL_SHARE of the time between snapshots and let each snapshot's write finish before
    the next one is due (a later snapshot would otherwise wait for it on the training thread)."""
    if not step_s > 0:
        return 1
    by_stall = math.ceil(stall_s / (MAX_STALL_SHARE * step_s))
    by_write = math.ceil(write_s / step_s)
    return max(1, by_stall, by_write)


def competition(writer_cpu_s: float, process_cpu_s: float, wall_s: float, cores: int) -> float:
    """Seconds of training the writer thread's CPU time took (pure): its copy and hashing run
    beside the next steps, and cost the training only where the cores are busy. The rest of the
    process used `process_cpu_s - writer_cpu_s` over `wall_s`; the busier the cores, the more
    of the writer's time came out of the training (all of it on a machine whose cores the step
    fills, none where cores are idle)."""
    if not (wall_s > 0 and cores > 0 and writer_cpu_s > 0):
        return 0.0
    busy = max(0.0, process_cpu_s - writer_cpu_s) / wall_s / cores
    return writer_cpu_s * min(1.0, busy)


def budget_bytes(opts: Memory) -> int:
    """The tier's memory budget: `budget_mb`, else half of what the host has available."""
    if opts.budget_mb is not None:
        return int(opts.budget_mb * 2**20)
    return available_bytes() // 2


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


def write_snapshot(target: SaveTarget, cap: Capture, copied: threading.Event,
                   files: shm_files.ShmFiles | None = None) -> Path:
    """Commit `cap` into the memory dir: every tensor copied first, `copied` set, then the
    files hashed from the copy (unencrypted) and the manifest committed. With `files`, each
    tensor file is written into a reused, mapped file and hashed chunk by chunk as it is
    copied (worker/memtier/shm_files.py). Raises on any error, leaving nothing behind but what
    the next snapshot's commit removes."""
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
                done = shm_files.fill(f, header, tensors.values(), pending.hash_alg)
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
                 kept: int = 1, reuse: bool = False) -> None:
        self.opts, self.dir = opts, directory
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
        self._read = threading.Event()  # set once the running snapshot read the live tensors
        self._read.set()
        self._gate_wait = 0.0  # the optimizer step's wait for the running snapshot
        self.gate_s = 0.0  # that wait, for the last snapshot that finished
        # (step, time, process CPU time) of the previous snapshot
        self._last_call: tuple[int, float, float] | None = None
        self.writer_cpu_s = 0.0  # the writer thread's CPU time for the newest snapshot
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        self._said: dict[str, Any] | None = None  # the interval last told to rtrain
        # A snapshot rtrain was to persist as a disk save failed: the Checkpointer saves to
        # disk itself at the next step boundary instead.
        self.persist_lost = False
        self._hook = (optimizer.register_step_pre_hook(self._gate)
                      if self.overlap and optimizer is not None else None)

    @classmethod
    def open(cls, opts: Memory | None, *, world: dist.World | None, key: bytes | None,
             encryption: Any, model: torch.nn.Module | None,
             optimizer: torch.optim.Optimizer | None) -> MemoryTier | None:
        """The tier, or None (with a warning) where it cannot run. Under a process group each
        rank snapshots its own part into `rank-<R>/` of the node's memory dir
        (checkpoint/parts.py)."""
        if opts is None:
            return None
        where = os.environ.get(ENV_MEMORY_DIR)
        if not where:
            log.warning("memory tier off: it runs under `rtrain launch`, which persists the "
                        "snapshots; this process saves to disk only")
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
        return cls(opts, directory, key, encryption, model, optimizer, kept, reuse)

    def due(self, step: int) -> bool:
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
        return self._last_call is None or step - self._last_call[0] >= self.every

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
        if not self._swept:  # before the space is counted: an earlier attempt's spares go
            self._swept = True
            _sweep(self.dir)
        if self.last_step is None and not self._pending:
            why = refusal(cap.nbytes, budget_bytes(self.opts), _free_bytes(self.dir),
                          self.kept + 1)
            if why is not None:
                self.stop(why, cap.step)
                return False
        if self.overlap:
            _copy_unguarded(cap, _storages(_guarded(self.model, self.optimizer)),
                            _storages(_buffers(self.model)))
        info = cap.fields.setdefault("info", {})
        info["memory_snapshot"] = True
        if self.keep is not None:
            info["keep"] = self.keep
        if cap.world is not None:
            info.update(parts.part_fields(cap.world.rank, cap.world.size))
        self._pace(cap.step, began)
        self._read.clear()
        self._idle.clear()
        self._gate_wait = 0.0
        self._pending = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rtrain-memory-snapshot",
                                            daemon=True)
            self._thread.start()
        self._jobs.put((cap, persist))
        if not self.overlap:
            self._read.wait()
        self.stall_s = time.monotonic() - began
        return True

    def wait(self) -> None:
        """The running snapshot committed (or failed: the tier is then off)."""
        if self._pending:
            self._idle.wait()
            self._pending = False
            if self.stall_s is not None:
                self.stall_s += self._gate_wait  # the stall that snapshot cost the loop
            self.gate_s = self._gate_wait

    def close(self) -> None:
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
        runtime.heartbeat(step=step, event="snapshot", snapshot={"off": why})
        if threading.current_thread() is not self._thread:
            self.release()

    def _gate(self, *_: Any) -> None:
        """The optimizer's step pre-hook: the running snapshot must have read the state first."""
        if not self._read.is_set():
            t0 = time.monotonic()
            self._read.wait()
            self._gate_wait += time.monotonic() - t0

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._write(*job)
            finally:
                self._idle.set()

    def _write(self, cap: Capture, persist: bool = False) -> None:
        t0, cpu0 = time.monotonic(), time.thread_time()
        try:
            path = write_snapshot(self.target, cap, self._read, self._files)
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
            self._read.set()
        self.write_s = time.monotonic() - t0
        self.writer_cpu_s = time.thread_time() - cpu0
        self.last_step = cap.step
        # Double buffering: the others go only after the newer one committed; anything this
        # process did not just write goes too (an earlier attempt's, e.g. steps beyond a
        # rollback's: never the newest in memory again).
        self._committed = [*self._committed, path][-self.kept:]
        for _, older in list_checkpoints(self.dir):
            if older not in self._committed:
                try:
                    if self._files is None or not self._files.retire(older):
                        remove_dir(older)
                except OSError:
                    pass  # rtrain took it away (it pins what it copies) or removed the dir
        if persist:  # only now: rtrain copies the newest snapshot at this step or later
            runtime.heartbeat(step=cap.step, event="persist")

    def _pace(self, step: int, now: float) -> None:
        """Under "auto", choose the next interval from what the previous snapshot measured,
        and tell rtrain when it starts or changes."""
        prev, self._last_call = self._last_call, (step, now, time.process_time())
        if prev is not None and self.stall_s is not None and self.write_s is not None \
                and step > prev[0] and not isinstance(self.opts.every, int):
            step_s = (now - prev[1]) / (step - prev[0])
            # The stall, and what the writer's copy and hashing took from the steps beside it.
            cost = self.stall_s + competition(self.writer_cpu_s, self._last_call[2] - prev[2],
                                              now - prev[1], self.cores)
            self.every = interval(cost, self.write_s, step_s)
        said = {"every": self.every,
                "stall_s": None if self.stall_s is None else round(self.stall_s, 6),
                "write_s": None if self.write_s is None else round(self.write_s, 6)}
        if self._said is None or said["every"] != self._said["every"]:
            self._said = said
            runtime.heartbeat(step=step, event="snapshot", snapshot=said)


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


def _sweep(memory_dir: Path) -> None:
    """Remove what earlier attempts left in the memory dir: a retired snapshot's spare files
    (trash-named), a temp dir whose writer died. Committed snapshots and rtrain's pins stay."""
    for left in list_leftovers(memory_dir):
        if left.path.name.startswith(TRASH_PREFIX) or not left.writer_alive():
            shutil.rmtree(left.path, ignore_errors=True)


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
