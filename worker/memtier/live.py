"""The live state: the parameters and the optimizer state kept in shared memory, so a SIGKILL
outside `optimizer.step()` loses no step and costs no copy.

Why. A snapshot copies the state (126 MiB for a 10.5M-parameter model with AdamW): on a CPU
whose cores the step keeps busy that costs 15-40% of a step, so the tier can afford one every
5-15 steps, and a kill loses half that on average. But between two step boundaries the
parameters and the optimizer state change only inside `optimizer.step()` (the same observation
as the save at a failure, worker/saving/failsave.py): during the forward and the backward, most
of a step, the state in memory is exactly the last boundary's. Kept in a shared-memory file
instead of the process's own pages, that state outlives a SIGKILL, a segfault or the OOM killer.

How. After the first optimizer step (its state exists then) and OBSERVE boundaries that showed
no change outside it, each parameter's data and each optimizer state tensor is moved, once,
into a mapped file in `<memory dir>/live/` laid out as the snapshot's safetensors file
(`model.safetensors`, `optimizer.safetensors`: the header, then each tensor's bytes, aligned),
and the parameter (`p.data`) and the optimizer's state entry point at it from then on. At each
step boundary the small parts are written beside them: module buffers (BatchNorm statistics
change in the forward) copied into their slots, `extra.safetensors` (RNG states, data position,
the user's extras), `state.json`, then `mark.json` with the step and the manifest's fields,
renamed into place last. The optimizer's step pre-hook unlinks `mark.json` before anything
changes. So the directory holds a whole step exactly while `mark.json` exists; a kill inside
`optimizer.step()` (or the boundary's writes) finds none, and the newest snapshot or disk save
is the fallback, as without this.

rtrain turns a marked directory into a committed snapshot once the process is gone
(supervisor/memtier/live_seal.py): it hashes the files, writes the manifest, signs it, and from
there the snapshot is resumed from, persisted and verified like any other. Nothing is hashed
while training.

What it assumes, and checks. A parameter or optimizer tensor changed outside the optimizer's
step would make a marked state wrong: each one's version counter (bumped by every in-place
write through the tensor) is read at the boundary and compared at the pre-hook and the next
boundary; a change turns the live state off for the process, with one line. Writes through
`p.data` bypass the counter and are not seen: a script that changes parameters that way outside
`optimizer.step()` passes `Memory(live=False)`. Off as well, with the reason, for parameters
or state on a GPU (the pinned double buffer is that design), not contiguous, or sharing storage
with another tensor, and when the optimizer keeps replacing its state tensors. Tied weights
(one parameter under two names) are one slot; rtrain fills the second name's bytes as it seals.

The pages replace the process's own: the state costs no more memory than without the live state,
but one more copy of the shared-memory filesystem's space (the tier checks it fits). When the
Checkpointer closes, a restore replaces the state or the tier stops, each tensor is copied back
into the process's own memory and the files go.
"""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rtrain.checkpoint import safetensors_io
from rtrain.supervisor.core.atomic_write import write_atomic
from rtrain.supervisor.core.protocol import ENV_GENERATION, LIVE_DIR, LIVE_LAYOUT, LIVE_MARK
from rtrain.worker import runtime
from rtrain.worker.memtier import shm_files
from rtrain.worker.saving.save_target import Capture
from rtrain.worker.trainstate.tensors import dtype_code, to_blob

log = logging.getLogger(__name__)

MARK, LAYOUT = LIVE_MARK, LIVE_LAYOUT
STATE = "state.json"
EXTRA = "extra.safetensors"
MAPPED = ("model", "optimizer")  # the capture's stems whose files are mapped
OBSERVE = 2  # boundaries with an optimizer step and no outside change before adopting
MAX_MOVES = 3  # state tensors replaced by the optimizer before the live state gives up


@dataclass
class _Slot:
    """One captured tensor's place in a mapped file."""

    name: str
    offset: int  # from the file's start
    nbytes: int
    view: torch.Tensor  # the bytes, as the tensor's dtype and shape
    kind: str  # "live" (the training tensor is this view), "copied" (each boundary), "tied"
    source: int | None = None  # a tied name's: the offset of the live slot it shares
    owner: _Owner | None = None  # a live slot's: the parameter or state entry bound to it


@dataclass
class _File:
    stem: str
    mapped: shm_files.ShmFile
    slots: list[_Slot] = field(default_factory=list)


class LiveState:
    """The live state of one single-process training, in `<memory dir>/live/`."""

    def __init__(self, memory_dir: Path, model: torch.nn.Module | None,
                 optimizer: torch.optim.Optimizer | None,
                 unread: Callable[[], None] = lambda: None,
                 spares: shm_files.ShmFiles | None = None) -> None:
        self.dir = memory_dir / LIVE_DIR
        # The snapshots' spare files (an earlier attempt's among them), taken for the live
        # files where one fits: a file made new costs its pages once more (shm_files.py).
        self._spares = spares
        # Returns once no snapshot that may commit is still reading the live tensors: their
        # pages are given back only then (`_unadopt`).
        self._unread = unread
        self.model, self.optimizer = model, optimizer
        self.off: str | None = None if optimizer is not None else "no optimizer was given"
        self.step: int | None = None  # the step marked whole, while marked
        self._files: list[_File] | None = None  # adopted
        self._tracked: list[torch.Tensor] = []  # what only the optimizer's step may change
        self._versions: list[int] | None = None  # their version counters at the boundary
        self._stepped = 0  # optimizer steps begun since the last boundary
        self._clean = 0  # boundaries in a row after an optimizer step and no outside change
        self._moves = 0
        self.marked = False

    @property
    def adopted(self) -> bool:
        """The state lives in the mapped files."""
        return self._files is not None

    @property
    def nbytes(self) -> int:
        """The mapped files' size."""
        return sum(f.mapped.size for f in self._files or [])

    # -- the optimizer's step and the step boundary ---------------------------------------

    def stepping(self) -> None:
        """The optimizer's step pre-hook: nothing may change before the mark is gone."""
        if self.off is not None:
            return
        if self.marked:
            self._unmark()
        if not self._stepped:  # a second step before the boundary changes what the first did
            self._check_outside("before the optimizer's step")
        self._stepped += 1

    def boundary(self, cap: Capture, snapshot: int | None = None) -> None:
        """A step boundary, `cap` taken at it: mark the step whole in the live directory
        (adopting the state first once it is time). `snapshot`: the step of this process's
        newest snapshot, committed or being written (rtrain's seal tells its own from an
        earlier timeline's)."""
        if self.off is not None:
            return
        if self.marked:
            self._unmark()
        if not self._stepped:
            self._check_outside("between two step boundaries")
        if self.off is not None:
            return
        stepped, self._stepped = self._stepped, 0
        if self._files is None:
            self._clean = self._clean + 1 if stepped else 0
            if self._clean > OBSERVE:
                self._adopt(cap)
            self._record()
            if self._files is None:
                return
        elif not self._refill(cap):
            self._record()  # of the tensors now held: adopted again at a later boundary
            return
        try:
            self._write_small(cap, snapshot)
        except OSError as e:
            self.stop(f"cannot write the live state's files: {e.strerror or e}")
            return
        self._record()

    # -- adopting the state ------------------------------------------------------------------

    def _adopt(self, cap: Capture) -> None:
        owners, why = _owners(self.model, self.optimizer)
        if why is not None:
            self.stop(why)
            return
        try:
            self._release_files()
            if self._spares is not None and self.dir.is_dir():
                self._spares.adopt(self.dir)  # an earlier attempt's, not sealed: its files
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir(mode=0o700)
            files = [self._map(stem, cap.tensors.get(stem, {}), owners) for stem in MAPPED]
            layout = {"pid": os.getpid(), "files": {f"{f.stem}.safetensors": {
                "size": f.mapped.size,
                "tensors": {s.name: [dtype_code(s.view.dtype), list(s.view.shape)]
                            for s in f.slots}} for f in files},
                "tied": {f"{f.stem}.safetensors": [[s.source, s.offset, s.nbytes]
                                                  for s in f.slots if s.kind == "tied"]
                         for f in files}}
            write_atomic(self.dir / LAYOUT, json.dumps(layout), durable=False)
        except OSError as e:
            self.stop(f"cannot create the live state's files in {self.dir.parent}: "
                      f"{e.strerror or e}")
            return
        for f in files:
            for s in f.slots:
                if s.owner is not None:
                    s.owner.bind(s.view)
        self._files = files
        self._tracked = [o.tensor() for o in owners.values()]
        nbytes = self.nbytes
        log.info("live state: %d MiB of parameters and optimizer state kept in %s",
                 nbytes >> 20, self.dir)
        runtime.heartbeat(step=cap.step, event="snapshot", snapshot={"live": "on",
                                                                     "bytes": nbytes})

    def _map(self, stem: str, tensors: dict[str, torch.Tensor],
             owners: dict[int, _Owner]) -> _File:
        """The mapped file of one stem: every tensor's bytes copied in, aligned (the widest
        elements first: the data starts 8-aligned), the header a snapshot's."""
        order = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
        blobs = [to_blob(n, t) for n, t in order]
        header = safetensors_io.build_header(blobs)
        size = len(header) + sum(b.data.nbytes for b in blobs)
        path = self.dir / f"{stem}.safetensors"
        mapped = ((self._spares.take_spare(path, size) if self._spares is not None else None)
                  or shm_files.create(path, size))
        mapped.map[:len(header)] = header
        data = torch.frombuffer(mapped.map, dtype=torch.uint8)
        out, pos = _File(stem, mapped), len(header)
        bound: dict[int, int] = {}  # a live tensor's address -> its slot's offset
        for name, t in order:
            n = t.numel() * t.element_size()
            view = data[pos:pos + n].view(t.dtype).view(t.shape)
            owner = owners.get(t.data_ptr()) if n else None
            slot = _Slot(name, pos, n, view, "copied")
            if owner is not None and owner.whole(t):
                slot.kind, slot.source = (("tied", bound[t.data_ptr()])
                                          if t.data_ptr() in bound else ("live", None))
                slot.owner = owner if slot.kind == "live" else None
                bound.setdefault(t.data_ptr(), pos)
            if slot.kind != "tied":
                view.copy_(t)
            out.slots.append(slot)
            pos += n
        return out

    def _refill(self, cap: Capture) -> bool:
        """At a boundary after adoption: the live tensors still the mapped ones (else adopt
        again, MAX_MOVES times), the copied ones refreshed. False when the state went off or
        must be adopted again."""
        assert self._files is not None
        for f in self._files:
            tensors = cap.tensors.get(f.stem, {})
            if len(tensors) != len(f.slots):
                return self._moved(f"the {f.stem}'s tensors changed", cap)
            for s in f.slots:
                t = tensors.get(s.name)
                if t is None or t.dtype != s.view.dtype or t.shape != s.view.shape:
                    return self._moved(f"{s.name} changed", cap)
                if s.kind == "copied":
                    s.view.copy_(t)
                elif s.kind == "live" and t.data_ptr() != s.view.data_ptr():
                    return self._moved(f"{s.name} was replaced by a new tensor", cap)
        return True

    def _moved(self, what: str, cap: Capture) -> bool:
        self._moves += 1
        if self._moves > MAX_MOVES:
            self.stop(f"the state keeps changing its tensors ({what})")
            return False
        self._files = None  # adopted again at a later boundary
        self._clean = 0
        return False

    # -- the small parts, the mark ---------------------------------------------------------

    def _write_small(self, cap: Capture, snapshot: int | None) -> None:
        blobs = [to_blob(n, t) for n, t in sorted(cap.tensors.get("extra", {}).items(),
                                                  key=lambda kv: -kv[1].element_size())]
        _write(self.dir / EXTRA, [safetensors_io.build_header(blobs),
                                  *(b.data for b in blobs)])
        _write(self.dir / STATE, [json.dumps(cap.state_json).encode()])
        mark = {"step": cap.step, "pid": os.getpid(), "fields": cap.fields,
                "generation": os.environ.get(ENV_GENERATION) or None, "snapshot": snapshot,
                "extra": {b.name: [b.dtype, list(b.shape)] for b in blobs}}
        # Created whole by one write (no temp file and rename: they cost more than the rest of
        # the boundary). The mark was removed before anything above was written, and a mark cut
        # short by a kill does not parse: never sealed.
        _write(self.dir / MARK, [json.dumps(mark).encode()])
        self.marked, self.step = True, cap.step

    def _unmark(self) -> None:
        try:
            os.unlink(self.dir / MARK)
        except FileNotFoundError:
            pass
        except OSError as e:  # a mark that stays would name a step the state no longer is
            self.off = f"cannot remove {MARK}: {e.strerror or e}"
            log.warning("live state off: %s", self.off)
            shutil.rmtree(self.dir, ignore_errors=True)
        self.marked, self.step = False, None

    # -- changes outside the optimizer's step -----------------------------------------------

    def _record(self) -> None:
        self._versions = [t._version for t in self._tracked_now()]

    def _tracked_now(self) -> list[torch.Tensor]:
        if self._files is not None:
            return self._tracked
        owners, _ = _owners(self.model, self.optimizer)
        return [o.tensor() for o in owners.values()]

    def _check_outside(self, where: str) -> None:
        if self._versions is None:
            return
        now = [t._version for t in self._tracked_now()]
        if now != self._versions:
            self.stop(f"a parameter or optimizer tensor changed in place {where}, outside "
                      f"optimizer.step()")

    # -- off --------------------------------------------------------------------------------

    def stop(self, why: str) -> None:
        """Off for this process, said once: no mark is ever written again. The tensors stay
        where they are (see the module docstring)."""
        if self.off is None:
            self.off = why
            log.warning("live state off: %s", why)
            runtime.heartbeat(step=None, event="snapshot", snapshot={"live": why})
        self.forget()

    def close(self) -> None:
        """The Checkpointer closed: the training is over, no step is marked from here on."""
        if self.off is None:
            self.off = "closed"
        self.forget()

    def forget(self) -> None:
        """The directory goes (a restore replaced the state; the tier stopped); with the state
        still on, it is adopted again at a later boundary. The tensors move back into the
        process's own memory first, so no mapped page outlives the directory."""
        self.marked, self.step = False, None
        self._unadopt()
        self._release_files()
        shutil.rmtree(self.dir, ignore_errors=True)
        self._files, self._clean, self._versions, self._tracked = None, 0, None, []

    def _unadopt(self) -> None:
        """Each live tensor copied out of its mapped file and bound to the copy, its pages
        given back to the filesystem at once (MADV_REMOVE), so the peak is one tensor more,
        not the state twice: this runs when memory pressure dropped the tier too."""
        if self._files:
            self._unread()
        for f in self._files or []:
            for s in f.slots:
                if s.owner is not None and s.owner.tensor().data_ptr() == s.view.data_ptr():
                    s.owner.bind(s.view.clone())
                s.view = s.view.new_empty(0)
                lo = -(-s.offset // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages of the slot
                hi = (s.offset + s.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
                if hi > lo:
                    try:
                        f.mapped.map.madvise(mmap.MADV_REMOVE, lo, hi - lo)
                    except (OSError, ValueError, AttributeError):
                        pass  # freed with the mapping instead
            f.slots = []

    def _release_files(self) -> None:
        # Unmapped when the last tensor viewing it goes (mmap.close would refuse before).
        for f in self._files or []:
            try:
                os.close(f.mapped.fd)
            except OSError:
                pass
        self._files = None


@dataclass
class _Owner:
    """Where a tensor the optimizer's step changes is held: a parameter, or a state entry."""

    param: torch.nn.Parameter | None
    state: dict[str, Any] | None
    key: str | None

    def tensor(self) -> torch.Tensor:
        return self.param if self.param is not None else self.state[self.key]  # type: ignore

    def whole(self, t: torch.Tensor) -> bool:
        """`t` (captured) is this tensor entire, not part of it."""
        own = self.tensor()
        return t.numel() == own.numel() and t.dtype == own.dtype

    def bind(self, view: torch.Tensor) -> None:
        if self.param is not None:
            self.param.data = view
        else:
            assert self.state is not None and self.key is not None
            self.state[self.key] = view


def _owners(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None
            ) -> tuple[dict[int, _Owner], str | None]:
    """Every parameter and optimizer state tensor by its data's address, or why the live
    state cannot hold them."""
    owners: dict[int, _Owner] = {}
    params = list(model.parameters()) if model is not None else []
    if optimizer is not None:
        params += [p for g in optimizer.param_groups for p in g["params"]]
    seen: set[int] = set()
    found: list[tuple[torch.Tensor, _Owner]] = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            found.append((p, _Owner(p, None, None)))
    for st in (optimizer.state.values() if optimizer is not None else []):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                found.append((v, _Owner(None, st, k)))
    spans = []
    for t, owner in found:
        if t.device.type != "cpu":
            return {}, f"the state is on {t.device.type}, not in host memory"
        if t.is_sparse or not t.is_contiguous():
            return {}, "a parameter or optimizer tensor is sparse or not contiguous"
        if t.numel():
            owners[t.data_ptr()] = owner
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    # Tensors that overlap (a parameter that is a view of another) would stop sharing their
    # bytes once each had its own slot. Views of one buffer that do not overlap (a restore
    # reads a file's tensors into one) are independent, and each gets its own slot.
    spans.sort()
    if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
        return {}, "a parameter or optimizer tensor shares its bytes with another"
    return owners, None


def _write(path: Path, pieces: list[Any]) -> None:
    """Replace `path` with a new file (the mark is gone while it is written)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        for p in pieces:
            view = memoryview(p).cast("B")
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)
