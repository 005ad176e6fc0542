"""`rtrain.Checkpointer`: save and restore complete training state, atomically and verified.

The Checkpointer holds the settings and the schedule; the work is done by one unit each:
`capture` (the state taken at a step boundary), `save_target` (one process's commit) and
`dist_ckpt` (several ranks'), `async_write` (saving in the background), `retention` (pruning,
making room), `restore` (picking, reading verified, applying), `failsave` (saving at a failure).
"""

from __future__ import annotations

import logging
import os
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from rtrain.checkpoint import crypt, hashing
from rtrain.checkpoint.layout import checkpoint_name, list_checkpoints
from rtrain.supervisor.core.errors import CheckpointError, CorruptCheckpoint, ExitCode
from rtrain.supervisor.core.protocol import ENV_CKPT_DIR, ENV_RESUME_FROM
from rtrain.worker import commwait, dist, options, runtime
from rtrain.worker.checkresume import check_order, resume_check
from rtrain.worker.compilecache import compile_cache
from rtrain.worker.data import position
from rtrain.worker.guards import degrade, faults
from rtrain.worker.memtier import handoff
from rtrain.worker.memtier.memory_tier import MemoryTier
from rtrain.worker.options import Every, Keep, Restoring, Saving
from rtrain.worker.restoring import restore
from rtrain.worker.saving import dist_ckpt, failsave
from rtrain.worker.saving.async_write import BackgroundSave
from rtrain.worker.saving.capture import (
    Components,
    FrozenBase,
    Moving,
    capture,
    environment,
    moving,
    number,
)
from rtrain.worker.saving.retention import Retention
from rtrain.worker.saving.save_clock import SaveClock, first_schedule
from rtrain.worker.saving.save_target import Capture, SaveTarget, write_local
from rtrain.worker.saving.schedule import SaveSchedule
from rtrain.worker.trainstate import hyperparams

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves and restores the whole training state together, atomically and verified: model,
    optimizer, scheduler, GradScaler, data position, every RNG state, step, epoch and extras.

        ckpt = rtrain.Checkpointer(model=model, optimizer=opt, loader=loader, every=100)
        start_step = ckpt.restore()
        for step in range(start_step, total_steps):
            ...
            ckpt.maybe_save(step + 1, metrics={"loss": loss.item()})
        ckpt.close()

    Args:
        model: The torch.nn.Module whose state is saved (DDP- and FSDP-wrapped modules as
            they are). A DDP model on the CPU gets a comm hook that times this rank's wait in
            the gradient all-reduce (the straggler rule); register a hook of your own after
            creating the Checkpointer: it then runs inside rtrain's.
        optimizer: Its optimizer; state is saved keyed by parameter name.
        scheduler: A learning-rate scheduler, or anything with state_dict/load_state_dict.
        scaler: A torch.amp GradScaler.
        loader: Where the data stream stands: a DataLoader whose sampler is a
            rtrain.ResumableSampler, a DataLoader over an IterableDataset, torchdata's
            StatefulDataLoader, or the ResumableSampler itself when the loop iterates it. The
            position saved is what the loop took, not what loader workers fetched ahead.
        ckpt_dir: Where checkpoints go. Default: $RTRAIN_CKPT_DIR (rtrain launch sets it from
            --ckpt-dir), else ./checkpoints.
        every: When to save: a number of steps, "auto", or an Every (below). None: only on a
            stop request, after `request_save()`, or when `save()` is called.
        keep: Which checkpoints to keep: how many of the newest (None: all), or a Keep
            (below).
        saving: How checkpoints are written: a Saving (below).
        restoring: How `restore()` reads them: a Restoring (below).
        signing_key: Sign every manifest (bytes, or a passphrase string); a signed checkpoint
            that does not verify is never loaded. Default: $RTRAIN_SIGNING_KEY or
            $RTRAIN_SIGNING_KEY_FILE.
        encryption_key: Encrypt every checkpoint file: an EncryptionKey, 32 bytes, or a
            string (64 hex digits, else a passphrase). Default: $RTRAIN_ENCRYPTION_KEY or
            $RTRAIN_ENCRYPTION_KEY_FILE (checkpoint/crypt.py).
        exit_on_stop: After a stop request (preemption; rtrain's stop signal) `maybe_save`
            commits a checkpoint and exits 75, which rtrain reads as "preempted". False:
            it returns, and the script ends when it likes (`rtrain.should_stop()`).

    An argument wins over its environment variable. Memory pressure: after a relieve request
    from rtrain, `maybe_save` frees Python garbage, the CUDA allocator's cache, an
    OOMBackoff's micro-batch and whatever the callbacks given to `rtrain.on_pressure()` free.
    """

    def __init__(self, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                 scaler: Any = None, loader: Any = None,
                 ckpt_dir: str | os.PathLike | None = None,
                 every: int | Literal["auto"] | Every | None = None,
                 keep: int | Keep | None = 3, saving: Saving | None = None,
                 restoring: Restoring | None = None, signing_key: bytes | str | None = None,
                 encryption_key: crypt.EncryptionKey | bytes | str | None = None,
                 exit_on_stop: bool = True) -> None:
        self.every = options.as_every(every)
        self.keep = options.as_keep(keep)
        self.saving: Saving = options.as_group(Saving, saving, "saving")
        self.restoring: Restoring = options.as_group(Restoring, restoring, "restoring")
        ckpt_dir = ckpt_dir or os.environ.get(ENV_CKPT_DIR) or "checkpoints"
        self.ckpt_dir = Path(ckpt_dir)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler = scaler
        # The data position counts what the loop consumed (worker/data/position.py).
        self.data = position.track(loader=loader)
        self.sampler = position.bare_sampler(self.data)  # check-resume's evidence looks for it
        bounds = self.every.bounds()
        if bounds is not None:
            self.schedule = first_schedule(bounds, self.every.epoch_end)
        else:
            self.schedule = SaveSchedule(every_steps=self.every.steps,
                                         every_seconds=self.every.seconds,
                                         on_epoch_end=self.every.epoch_end)
        self.exit_on_stop = exit_on_stop
        if isinstance(signing_key, str):
            signing_key = hashing.derive_key(signing_key.encode())
        self.key = signing_key if signing_key is not None else hashing.load_signing_key()
        self.encryption = _encryption_key(encryption_key)
        self.step = 0
        self.epoch = 0
        # The step `restore` resumed from, which the attempt runs again first: an experiment
        # tracker's steps from here on were logged by an earlier attempt and are replayed
        # (TensorBoard's SummaryWriter(purge_step=...), worker/trackers/restarts.py). None: started
        # fresh.
        self.resumed_step: int | None = None
        self.extra: dict[str, Any] = {}
        self.last_saved: Path | None = None
        self._clock = SaveClock(self.schedule, bounds=bounds)
        self._lr_scale = 1.0
        self._frozen = FrozenBase()
        self._retention = Retention(self.ckpt_dir, self.keep.policy(), self.key)
        self._target = SaveTarget(self.ckpt_dir, self.saving.fsync, self.key,
                                  self._retention.make_room, encryption=self.encryption)
        mode = self.saving.async_mode
        self._bg = BackgroundSave("auto" if mode == "off" else mode, self._write, self._target,
                                  self._child_saved)
        self._memory = MemoryTier.open(self.saving.memory, world=dist.world(),
                                       key=self.key, encryption=self.encryption, model=model,
                                       optimizer=optimizer,
                                       implicit=self.saving.memory is options.MEMORY_DEFAULT)
        if self._memory is not None:
            self._memory.keep = asdict(self.keep.policy())  # rtrain prunes by it, not a heartbeat
        self._watch = (failsave.Watch(model, optimizer, scheduler, scaler)
                       if self.saving.on_failure else None)
        self._boundary: _Boundary | None = None
        self._copied = handoff.CopyWatch()  # how long rtrain's copy of a handed save took
        self._hyper: hyperparams.Pending | None = None  # the last restore's, until judged
        # Waits inside DDP's gradient all-reduce, for the straggler rule (worker/commwait.py).
        self._comm = commwait.install(model) if dist.world() is not None else None
        runtime.install()
        runtime.on_pressure(_empty_cuda_cache)
        if self._watch is not None:
            failsave.watch(self)
        # Under `rtrain check-resume` only: evidence for its report, its stop, the final save.
        order = check_order.plan()
        self._check = resume_check.Probe(self, order) if order is not None else None

    @property
    def skipped_saves(self) -> int:
        """Saves skipped so far for lack of space or a storage error (training went on)."""
        return self._target.skipped

    def restore(self, path: str | os.PathLike | None = None) -> int:
        """Load the newest checkpoint that verifies (or `path`). Returns the step to run next.

        Every file is read once, hashed as it is read and compared with the manifest, and
        state.json checked against its schema, before anything is applied to the model. A
        checkpoint that cannot be loaded (a file that does not match its manifest, a required
        file missing, state.json malformed, a layout this process cannot load, a value its
        component's load_state_dict refuses):
        - chosen by rtrain (RTRAIN_RESUME_FROM): a `bad_checkpoint` exit record names it and
          the process exits with ExitCode.BAD_CHECKPOINT (65); rtrain relaunches from the one
          before;
        - picked here from the checkpoint dir: skipped with a warning, the next older one tried;
        - given as `path`: CorruptCheckpoint is raised.
        One that does not fit the model (StateMismatch) is raised: an older one would not fit
        either.
        """
        from_supervisor = path is None and bool(os.environ.get(ENV_RESUME_FROM))
        began = time.monotonic()  # the load's cost goes to the supervisor (restore_s)
        self._boundary = None  # the state is replaced: what was kept no longer describes it
        if self._memory is not None:
            # A snapshot reading the state finishes before it is replaced, and the tier's files
            # are never reused once a restore may have mapped one (worker/memtier/shm_files.py).
            # The live state no longer holds a step either.
            self._memory.release()
            if self._memory.live is not None:
                self._memory.live.forget()
        parts = self._parts()
        r = self.restoring
        source = restore.Source(self.ckpt_dir, r.level, self.key, r.allow_resize,
                                r.map_location, self.encryption)
        try:
            loaded = source.find(path, dist.world(), parts)
            if loaded is not None:
                changes, self._lr_scale = restore.apply_all(loaded, parts, r.allow_pickle,
                                                            self._lr_scale)
                self._judge_hyperparams(changes)
                # Before the first compiled step: torch fills its local caches from it.
                if self.saving.compile_cache:
                    compile_cache.restore(
                        loaded.path, loaded.manifest, loaded.alg,
                        signed=self.key is not None and "signature" in loaded.manifest,
                        allow_pickle=r.allow_pickle, model=self.model,
                        max_mb=self.saving.compile_cache_max_mb, enc=loaded.enc)
        except CorruptCheckpoint as e:
            if from_supervisor:
                restore.report_bad_checkpoint(os.environ[ENV_RESUME_FROM], e.reason)
            raise
        self.resumed_step = None if loaded is None else loaded.manifest["step"]
        if loaded is None:
            log.info("no checkpoint to resume from in %s: starting fresh", self.ckpt_dir)
            # No step: a step would tell the supervisor that training started (startup rule).
            runtime.heartbeat(event="start", restore_s=time.monotonic() - began)
            return 0
        m = loaded.manifest
        for w in restore.environment_changes(m.get("environment", {}), environment(self.model)):
            log.warning("%s", w)
        self.step, self.epoch = m["step"], m["epoch"]
        self.extra = loaded.extra
        self._clock.resumed(self.step, parts.samples())
        if self._check is not None:
            self._check.restored(self.step)
        log.info("resumed from %s (step %d, epoch %d)", loaded.path, self.step, self.epoch)
        runtime.heartbeat(step=self.step, event="start", restore_s=time.monotonic() - began)
        return self.step

    def maybe_save(self, step: int, *, metrics: dict[str, float] | None = None,
                   epoch_end: bool = False, extra: dict[str, Any] | None = None) -> Path | None:
        """Save when the schedule says so, on request, or when a stop was requested.

        After a stop request (preemption) the checkpoint is committed and the process exits 75.
        Also sends the step's heartbeat to the supervisor.
        """
        try:
            return self._maybe_save(step, metrics=metrics, epoch_end=epoch_end, extra=extra)
        finally:
            runtime.step_entered()  # the next step begins (the hang report's progress board)

    def _maybe_save(self, step: int, *, metrics: dict[str, float] | None,
                    epoch_end: bool, extra: dict[str, Any] | None) -> Path | None:
        faults.step_hook(step, self.ckpt_dir)  # a no-op unless RTRAIN_FAULTS arms one
        if self._comm is not None:
            runtime.boundary_wait(self._comm.take())
        if self._check is not None:
            self._check.boundary(step)
        if runtime.pressure_requested():
            runtime.relieve_pressure(step, settings=degrade.effective_settings())
        if self._watch is not None:
            self._boundary = _Boundary(step, self._epoch_now(), moving(self._parts()),
                                       self._watch.marks(), metrics or {}, extra or {})
        stop = runtime.should_stop()
        if self._copied.step is not None and \
                (self.ckpt_dir / checkpoint_name(self._copied.step)).is_dir():
            self._copied.committed(self._clock.clock())
        if self._memory is not None and self._memory.persist_lost:
            self._memory.persist_lost = False  # the disk save rtrain was to make: made here
            self._clock.requested = True
        # An explicit request stays a direct disk write, durable before this call returns.
        requested = self._clock.requested
        samples = self.data.samples_seen if self.data is not None else None
        due = self._clock.tick(step, loss=number((metrics or {}).get("loss")), samples=samples,
                               epoch_end=epoch_end)
        snap = self._memory is not None and self._memory.due(step)
        path = None
        if dist.world() is not None:
            # A stop signal or a timed save reaches ranks at different steps; saving is
            # collective, so one rank's reason is every rank's. So is a memory snapshot's:
            # a step is restored from memory only when every rank has its part of it.
            # Its wait is how long this rank was ahead of the slowest (straggler rule).
            began = time.monotonic()
            stop, due, snap = dist.any_of([stop, due, snap])
            runtime.boundary_wait(time.monotonic() - began)
        # The RNG states and data position were taken above for a save at a failure: nothing
        # ran since, so the captures below reuse them rather than take them again.
        taken = self._boundary.moving if self._boundary is not None \
            and self._boundary.step == step and dist.world() is None else None
        where = handoff.route(due=due, stop=stop, requested=requested,
                              tier_takes=self._tier_takes())
        if where is handoff.Route.RTRAIN and self._hand_to_rtrain(step, metrics, extra, taken):
            path = self.ckpt_dir / checkpoint_name(step)  # the path rtrain will commit it as
        elif where is not handoff.Route.NONE:
            path = self.save(step, metrics=metrics, extra=extra)
        cap = None
        if not (stop or due) and self._memory is not None and snap:
            cap = capture(self._parts(), step, self._epoch_now(), self._lr_scale, metrics or {},
                          extra or {}, taken=taken)
            self._memory.snapshot(cap)
        if not stop and self._memory is not None and self._memory.live_wanted():
            # Every boundary: the live state marks this step whole (worker/memtier/live.py).
            self._memory.boundary(cap or capture(self._parts(), step, self._epoch_now(),
                                                 self._lr_scale, metrics or {}, extra or {},
                                                 taken=taken))
        if stop and self.exit_on_stop:
            self.close()
            log.info("stop requested: checkpoint at step %d committed, exiting %d", step,
                     ExitCode.PREEMPTED)
            runtime.heartbeat(step=step, event="stop")
            raise SystemExit(ExitCode.PREEMPTED)
        return path

    def _hand_to_rtrain(self, step: int, metrics: dict[str, float] | None,
                        extra: dict[str, Any] | None, taken: Moving | None = None) -> bool:
        """A scheduled disk save under the memory tier: snapshot this step and let rtrain copy
        it to the checkpoint dir in the background (worker/memtier/memory_tier.py). False
        when the tier cannot take it: the caller saves to disk itself.

        The loop pays the capture and the snapshot's start, plus the optimizer step's wait for
        the previous snapshot (this one's is not known yet; they hold the same state). The
        cadence counts rtrain's copy of the previous hand-off too (handoff.cadence_cost): it
        runs beside training, on the same cores. Requests that still come faster than rtrain
        copies are merged into the newest, so a short interval never stalls the loop."""
        assert self._memory is not None
        began = self._clock.clock()
        self._clock.save_begins(step)
        self.epoch = self._epoch_now()
        cap = capture(self._parts(), step, self.epoch, self._lr_scale, metrics or {}, extra or {},
                      taken=taken)
        if self._check is not None and "info" in cap.fields:
            cap.fields["info"]["check_resume"] = self._check.evidence()
        self._add_compile_cache(cap)  # rtrain's disk copy carries it, as a disk save would
        if not self._memory.snapshot(cap, persist=True):
            return False
        self._clock.last_step = step
        now = self._clock.clock()
        self._clock.save_ended(step, handoff.cadence_cost(now - began + self._memory.gate_s,
                                                          self._copied.copy_s))
        self._copied.handed(step, now)
        return True

    def _tier_takes(self) -> bool:
        """A single process's memory tier is on: it can take a scheduled disk save (a
        process group's ranks save collectively, to disk). The tier on by default counts: it
        exists only under `rtrain launch`, which copies the snapshots (worker/memtier/
        handoff.py)."""
        return (self._memory is not None and self._memory.off is None
                and dist.world() is None)

    def request_save(self) -> None:
        """Save at the next `maybe_save`, whatever the schedule says."""
        self._clock.requested = True

    def save(self, step: int, *, metrics: dict[str, float] | None = None,
             extra: dict[str, Any] | None = None, epoch: int | None = None) -> Path | None:
        """Save now. Returns the committed path (sync), the path it will have (async), or None
        when the save was skipped for lack of disk space or a storage error (training goes on)."""
        # The stall counts from here: waiting for the save before is training time lost too.
        began = self._clock.clock()
        self._bg.wait()
        if self._clock.last_step == step and self.last_saved is not None \
                and self.last_saved.name == f"checkpoint-{step}":
            return self.last_saved  # already saved at this step (e.g. on schedule, then on stop)
        self._clock.save_begins(step)
        self.epoch = epoch if epoch is not None else self._epoch_now()
        cap = capture(self._parts(), step, self.epoch, self._lr_scale, metrics or {}, extra or {})
        if self._check is not None and "info" in cap.fields:
            cap.fields["info"]["check_resume"] = self._check.evidence()
        self._add_compile_cache(cap)
        if cap.world is None:  # under torch.distributed, rank 0 makes room inside the collective
            short = self._retention.make_room(cap.nbytes)
            if short is not None:
                self._target.skip(step, short)
                return None
        runtime.heartbeat(step=step, event="save_begin")
        if self.saving.async_mode == "off" or cap.sharded is not None:
            # Sharded state is saved synchronously: DCP reads the live parameters.
            path = self._write(cap)
            runtime.heartbeat(step=step, event="save_end")
            if path is not None:
                self._clock.save_ended(step, self._clock.clock() - began)
            return path
        self._bg.start(cap, self.model, shared=self._memory is not None
                       and self._memory.live is not None and self._memory.live.adopted)
        self._clock.last_step = step
        self._clock.save_ended(step, self._clock.clock() - began)
        return self.ckpt_dir / f"checkpoint-{step}"

    def save_on_failure(self, exc: BaseException) -> Path | None:
        """Commit the last step boundary's checkpoint if nothing changed the training state
        since (worker/saving/failsave.py); the committed path, else None.

        An uncaught exception calls this by itself; a script that catches the exception
        calls it in its `except` before ending. Never raises: a save that fails or outlasts
        `Saving.failure_timeout_s` is logged, and the caller goes on failing as it would have.
        """
        if self._watch is None or getattr(exc, "_rtrain_failure_handled", False):
            return None
        try:
            exc._rtrain_failure_handled = True  # once, however many hooks see it
        except AttributeError:  # an exception type with __slots__: it may be seen twice
            pass
        timeout = self.saving.failure_timeout_s
        finished, result = failsave.run_bounded(lambda: self._save_at_failure(exc), timeout)
        if not finished:
            log.error("the save at the failure did not finish in %.0f s: given up", timeout)
            return None
        if isinstance(result, BaseException):
            log.error("the save at the failure failed: %s: %s", type(result).__name__, result)
            return None
        return result

    def close(self) -> None:
        """Wait for a save in flight; raise its error if it failed."""
        if self._hyper is not None:
            self._hyper.settle()  # the script stopped before its verdict's step
            self._hyper = None
        if self._check is not None:
            self._check.finish()
        self._bg.wait()
        if self._memory is not None:
            self._memory.close()
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _judge_hyperparams(self, changes: list[hyperparams.Change]) -> None:
        """Hyper-parameters the checkpoint replaced: judged once the script has run an iteration
        (worker/trainstate/hyperparams.py), so a value it sets every step is no warning."""
        if self._hyper is not None:
            self._hyper.cancel()  # an earlier restore's: this one replaced what it judged
        self._hyper = (hyperparams.Pending(self.optimizer, changes)
                       if changes and self.optimizer is not None else None)

    def _epoch_now(self) -> int:
        if self.data is not None and self.data.samples_seen is not None:
            return self.data.epoch
        return self.epoch

    def _save_at_failure(self, exc: BaseException) -> Path | None:
        """Runs in failsave.run_bounded's thread: decide, then commit the boundary's step."""
        b, watch = self._boundary, self._watch
        assert watch is not None
        try:
            self._bg.wait()  # a background save in flight commits (or fails) first
        except CheckpointError as e:
            log.warning("%s", e)
        committed = {step for step, _ in list_checkpoints(self.ckpt_dir)}
        verdict = failsave.decide(exc, boundary=b and b.step, at_boundary=b and b.marks,
                                  now=watch.marks(), committed=committed,
                                  distributed=failsave.distributed())
        if verdict is not failsave.Verdict.SAVE:
            if verdict is not failsave.Verdict.NOT_A_CRASH and b is not None:
                log.warning("no checkpoint at the failure: %s since step %d",
                            failsave.WHY[verdict], b.step)
            return None
        assert b is not None
        cap = capture(self._parts(), b.step, b.epoch, self._lr_scale, b.metrics, b.extra,
                      taken=b.moving)
        cap.fields["info"].update(saved_at_failure=True, failure=type(exc).__name__)
        self._add_compile_cache(cap)
        short = self._retention.make_room(cap.nbytes)
        if short is not None:
            self._target.skip(b.step, short)
            return None
        runtime.heartbeat(step=b.step, event="save_begin")
        path = self._write(cap)
        runtime.heartbeat(step=b.step, event="save_end")
        if path is not None:
            log.warning("checkpoint of step %d committed at the failure (%s): nothing had "
                        "changed the model or optimizer since that step", b.step,
                        type(exc).__name__)
            runtime.heartbeat(step=b.step, event="saved_at_failure", reason=type(exc).__name__)
        return path

    def _add_compile_cache(self, cap: Capture) -> None:
        """torch's compile artifacts beside the checkpoint, for a relaunch on a fresh node
        (one process only: under torch.distributed each rank compiles its own)."""
        if not self.saving.compile_cache or cap.world is not None or "info" not in cap.fields:
            return
        found = compile_cache.collect(self.model, self.saving.compile_cache_max_mb)
        if found is not None:
            cap.compile_cache = found.data
            cap.fields["info"][compile_cache.INFO_KEY] = found.info

    def _parts(self) -> Components:
        return Components(self.model, self.optimizer, self.scheduler, self.scaler, self.data,
                          self.saving.trainable_only, self.saving.sharded, self._frozen)

    def _write(self, cap: Capture) -> Path | None:
        """Commit `cap` (in this thread, the writer thread or the forked writer), then prune."""
        if cap.world is not None:
            path = dist_ckpt.write(self._target, cap)
        else:
            path = write_local(self._target, cap)
        if path is not None:
            self.last_saved, self._clock.last_step = path, cap.step
            if cap.world is None or cap.world.leader:
                self._retention.apply(self.last_saved, frozenset({self._bg.step} - {None}))
        return path

    def _child_saved(self, step: int) -> None:
        self.last_saved = self.ckpt_dir / f"checkpoint-{step}"
        # The child wrote and hashed it; the next forked child inherits this record.
        self._retention.remember(self.last_saved)


def _empty_cuda_cache() -> str | None:
    """A relieve request's first answer: the CUDA allocator's cached blocks back to the driver."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return f"CUDA cache emptied ({(before - torch.cuda.memory_reserved()) / 2**20:.0f} MiB)"


@dataclass(frozen=True)
class _Boundary:
    """What a save at a failure writes besides the live model and optimizer: kept at the last
    `maybe_save`, with the marks that tell whether those are still that step's."""

    step: int
    epoch: int
    moving: Moving
    marks: failsave.Marks
    metrics: dict[str, float]
    extra: dict[str, Any]


def _encryption_key(given: crypt.EncryptionKey | bytes | str | None
                    ) -> crypt.EncryptionKey | None:
    """`encryption_key=`: an EncryptionKey, 32 raw bytes, or a string (64 hex digits, else a
    passphrase); None reads RTRAIN_ENCRYPTION_KEY / _FILE. With a key, the cipher is imported
    here, before any forked writer could need it (a forked child imports nothing)."""
    if isinstance(given, crypt.EncryptionKey):
        key = given
    elif isinstance(given, bytes):
        key = crypt.EncryptionKey(given, hide_tensors=os.environ.get(crypt.ENV_HIDE_TENSORS)
                                  == "1")
    elif isinstance(given, str):
        key = crypt.EncryptionKey.from_material(
            given, hide_tensors=os.environ.get(crypt.ENV_HIDE_TENSORS) == "1")
    else:
        key = crypt.load_encryption_key()
    if key is not None:
        try:
            crypt.cipher()
        except crypt.MissingCipher as e:
            raise CheckpointError(str(e)) from None
    return key


# help(rtrain.Checkpointer) is the reference: the option groups' fields follow its arguments.
Checkpointer.__doc__ = (Checkpointer.__doc__ or "").rstrip() + "\n\n" + textwrap.indent(
    options.reference(), "    ") + "\n    "
