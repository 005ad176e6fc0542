"""`worker.Checkpointer`: save and restore complete training state, atomically and verified."""

from __future__ import annotations

import errno
import json
import logging
import os
import platform
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

import supervisor
from supervisor import filemode
from supervisor.ckpt import hashing, retention
from supervisor.ckpt.commit import PendingCheckpoint, free_bytes
from supervisor.ckpt.layout import list_checkpoints
from supervisor.ckpt.prune import PruneReport, prune
from supervisor.ckpt.verified_read import LoadError, read_listed
from supervisor.ckpt.verify import Level, VerifiedCache, select_rtrain_resume, verify
from supervisor.decide.failures import FailureKind
from supervisor.errors import CheckpointError, CorruptCheckpoint, StateMismatch
from supervisor.protocol import (
    ENV_CKPT_DIR,
    ENV_RESUME_FROM,
    ENV_RUN_DIR,
    EXIT_BAD_CHECKPOINT,
    EXIT_PREEMPTED,
)
from worker import data, dist, dist_ckpt, faults, runtime, state
from worker.sampler import ResumableSampler
from worker.schedule import SaveSchedule
from worker.settings import current as current_settings
from worker.tensors import cpu_contiguous, decode, dtype_code, encode, load_listed, to_blob

log = logging.getLogger(__name__)

# Errors of the storage, not of the program: a save that meets them is skipped, training goes on.
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EROFS}
_FILES = ("model", "optimizer", "extra")


@dataclass
class _Capture:
    """Everything one save writes, taken at a step boundary."""

    step: int
    tensors: dict[str, dict[str, torch.Tensor]]  # file stem -> name -> CPU contiguous tensor
    state_json: dict[str, Any]
    fields: dict[str, Any]
    world: dist.World | None = None  # set when a process group is initialised
    rank_rng: dict[str, Any] | None = None  # this rank's python/numpy RNG (rng-rank<R> file)
    sharded: dict[str, Any] | None = None  # state written with torch.distributed.checkpoint

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for f in self.tensors.values() for t in f.values())


@dataclass
class _Loaded:
    """A checkpoint read and verified, not yet applied."""

    path: Path
    manifest: dict[str, Any]
    state: dict[str, Any]  # state.json
    tensors: dict[str, dict[str, torch.Tensor]]  # file stem -> name -> tensor
    rng: tuple[dict[str, torch.Tensor], dict[str, Any]] | None
    layout: str  # "sharded" or "replicated" (dist_ckpt.check_world)
    alg: str  # the manifest's file hash
    extra: Any  # the user's extras, decoded


class Checkpointer:
    """Saves model, optimizer, scheduler, GradScaler, sampler, RNG and user extras together.

    ckpt = Checkpointer(model=model, optimizer=opt, scheduler=sched, loader=loader,
                        every_steps=100, keep=3)
    start_step = ckpt.restore()
    for step in range(start_step, total_steps):
        ...
        ckpt.maybe_save(step + 1, metrics={"loss": loss.item()})
    ckpt.close()
    """

    def __init__(self, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                 scaler: Any = None, sampler: ResumableSampler | None = None,
                 ckpt_dir: str | os.PathLike | None = None,
                 every_steps: int | Literal["auto"] | None = None,
                 every_seconds: float | None = None, total_steps: int | None = None,
                 on_epoch_end: bool = False, keep: int | None = 3, keep_best: int = 0,
                 metric: str | None = None, mode: Literal["min", "max"] = "min",
                 milestone_every: int = 0, async_save: bool = False,
                 async_mode: Literal["auto", "fork", "thread"] = "auto",
                 trainable_only: bool = False, verify_level: Literal["quick", "full"] = "full",
                 map_location: str | torch.device = "cpu", exit_on_stop: bool = True,
                 fsync: bool = True, signing_key: bytes | str | None = None,
                 sharded: bool | None = None, allow_resize: bool = False,
                 allow_pickle: bool = False, loader: Any = None) -> None:
        ckpt_dir = ckpt_dir or os.environ.get(ENV_CKPT_DIR) or "checkpoints"
        self.ckpt_dir = Path(ckpt_dir)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler, self.sampler = scaler, sampler
        # With loader=, the data position counts what the loop consumed (worker/data.py).
        self.data = data.track(sampler=sampler, loader=loader)
        if every_steps == "auto":
            self.schedule = SaveSchedule.auto(total_steps or 0, on_epoch_end)
        else:
            self.schedule = SaveSchedule(every_steps=every_steps, every_seconds=every_seconds,
                                         on_epoch_end=on_epoch_end)
        self.policy = retention.RetentionPolicy(keep=keep, keep_best=keep_best, metric=metric,
                                                mode=mode, milestone_every=milestone_every)
        self.async_save = async_save
        if async_mode not in ("auto", "fork", "thread"):
            raise ValueError(f"async_mode must be 'auto', 'fork' or 'thread', not {async_mode!r}")
        self.async_mode = async_mode
        self.trainable_only = trainable_only
        self.sharded = sharded  # None: detect (DTensor / FSDP parameters) at each save
        self.allow_resize = allow_resize
        # Sharded (DCP) checkpoints are read without unpickling; True hands them to DCP's own
        # reader, which unpickles (runs code from) the checkpoint: trusted checkpoints only.
        self.allow_pickle = allow_pickle
        self.verify_level = Level(verify_level)
        self.map_location = map_location
        self.exit_on_stop = exit_on_stop
        self.fsync = fsync
        if isinstance(signing_key, str):
            signing_key = hashing.derive_key(signing_key.encode())
        self.key = signing_key if signing_key is not None else hashing.load_signing_key()
        self.step = 0
        self.epoch = 0
        self.extra: dict[str, Any] = {}
        self.last_saved: Path | None = None
        self.skipped_saves = 0
        self._last_save_step: int | None = None
        self._last_save_time = time.monotonic()
        self._save_requested = False
        self._hb_samples = 0
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._inflight: threading.Thread | None = None
        self._inflight_step: int | None = None
        self._error: BaseException | None = None
        self._frozen_fp: str | None = None
        self._lr_scale = 1.0
        self._verified = VerifiedCache()  # checkpoints retention may rely on without re-hashing
        runtime.install()

    # ------------------------------------------------------------ restore

    def restore(self, path: str | os.PathLike | None = None) -> int:
        """Load the newest checkpoint that verifies (or `path`). Returns the step to run next.

        Every file is read once, hashed as it is read and compared with the manifest before
        anything is applied to the model. A checkpoint that cannot be loaded (a file that does
        not match its manifest, a required file missing, a layout this process cannot load):
        - chosen by rtrain (RTRAIN_RESUME_FROM): a `bad_checkpoint` exit record names it and
          the process exits EXIT_BAD_CHECKPOINT; rtrain relaunches from the one before;
        - picked here from the checkpoint dir: skipped with a warning, the next older one tried;
        - given as `path`: CorruptCheckpoint is raised.
        One that does not fit the model (StateMismatch) is raised: an older one would not fit
        either.
        """
        w = dist.world()
        from_supervisor = path is None and bool(os.environ.get(ENV_RESUME_FROM))
        try:
            if w is None and path is None and not from_supervisor:
                loaded = self._first_loadable()
            else:
                found = self._agree(path, w)
                loaded = None if found is None else self._read(*found, w)
            if loaded is not None:
                self._restore_components(loaded)
        except CorruptCheckpoint as e:
            if from_supervisor:
                _report_bad_checkpoint(os.environ[ENV_RESUME_FROM], e.reason)
            raise
        if loaded is None:
            log.info("no checkpoint to resume from in %s: starting fresh", self.ckpt_dir)
            return 0
        m = loaded.manifest
        for w in _environment_changes(m.get("environment", {}), _environment(self.model)):
            log.warning("%s", w)
        self.step, self.epoch = m["step"], m["epoch"]
        self.extra = loaded.extra
        self._last_save_step = self.step
        self._hb_samples = self._samples() or 0
        log.info("resumed from %s (step %d, epoch %d)", loaded.path, self.step, self.epoch)
        runtime.heartbeat(step=self.step, event="start")
        return self.step

    def _agree(self, path: str | os.PathLike | None, w: dist.World | None
               ) -> tuple[Path, dict[str, Any]] | None:
        if w is not None:  # rank 0 picks and verifies; every rank loads that one
            return dist_ckpt.agree(lambda: self._pick(path), w)
        chosen = self._pick(path)
        return None if chosen is None else (chosen.path, chosen.manifest)

    def _pick(self, path: str | os.PathLike | None):
        env_path = os.environ.get(ENV_RESUME_FROM)
        if path is None and env_path:
            # The supervisor verified it fully a moment ago; loading hashes every byte it uses,
            # so a file swapped since is caught there, not by a second full read here.
            path, level = env_path, Level.QUICK
        else:
            level = self.verify_level
        if path is not None:
            v = verify(path, level, self.key)
            if not v.ok:
                raise CorruptCheckpoint(str(path), v.reason)
            return v
        if os.environ.get(ENV_RUN_DIR):
            return None  # supervised without RTRAIN_RESUME_FROM: the supervisor chose a fresh start
        sel = select_rtrain_resume(self.ckpt_dir, self.verify_level, self.key)
        for v in sel.skipped:
            log.warning("skipping %s: %s", v.path.name, v.describe())
        return sel.chosen

    def _first_loadable(self) -> _Loaded | None:
        """Run by hand: the newest checkpoint that verifies and loads; older ones on failure."""
        if os.environ.get(ENV_RUN_DIR):
            return None  # supervised without RTRAIN_RESUME_FROM: the supervisor chose a fresh start
        for _, p in list_checkpoints(self.ckpt_dir):
            v = verify(p, self.verify_level, self.key)
            if not v.ok:
                log.warning("skipping %s: %s", p.name, v.describe())
                continue
            try:
                return self._read(v.path, v.manifest, None)
            except CorruptCheckpoint as e:
                log.warning("skipping %s: %s", p.name, e.reason)
        return None

    def _read(self, path: Path, m: dict[str, Any], w: dist.World | None) -> _Loaded:
        """Read everything a restore needs from `path`, verified; nothing is applied yet, so a
        checkpoint that fails here leaves the model as it was."""
        try:
            alg = hashing.manifest_alg(m, self.key)
            info = m.get("info") if isinstance(m.get("info"), dict) else {}
            layout = dist_ckpt.check_world(info, w, self._is_sharded(), self.allow_resize,
                                           path.name)
            st = _read_state(path, m, alg)
            tensors = {stem: self._load_tensors(path, stem, m, alg) for stem in _FILES}
            rng = dist_ckpt.load_rank_rng(path, m, st, tensors["extra"], w.rank if w else 0, alg)
            try:
                extra = decode(st.get("extra", {}), tensors["extra"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise LoadError(f"state.json's extras refer to what extra.safetensors does not "
                                f"hold ({type(e).__name__}: {e})") from None
        except (LoadError, hashing.HashAlgError) as e:
            raise CorruptCheckpoint(str(path), f"cannot load: {e}") from None
        return _Loaded(path, m, st, tensors, rng, layout, alg, extra)

    def _load_tensors(self, path: Path, stem: str, m: dict[str, Any], alg: str
                      ) -> dict[str, torch.Tensor]:
        name = f"{stem}.safetensors"
        if name not in m["files"]:
            return {}
        tensors, _ = load_listed(path, name, m, alg)
        # RNG states must stay on the CPU; the rest may go straight to the training device.
        device = torch.device("cpu" if stem == "extra" else self.map_location)
        if device.type == "cpu":
            return tensors
        return {k: v.to(device) for k, v in tensors.items()}

    def _restore_components(self, loaded: _Loaded) -> None:
        m, st, tensors, rng, path = (loaded.manifest, loaded.state, loaded.tensors, loaded.rng,
                                     loaded.path)
        info = m.get("info") if isinstance(m.get("info"), dict) else {}
        layout = loaded.layout
        if layout == "sharded":
            try:
                dist_ckpt.load_sharded(path, m, loaded.alg, self.model, self.optimizer,
                                       self.allow_pickle)
            except LoadError as e:
                raise CorruptCheckpoint(str(path), f"cannot load: {e}") from None
        elif self.model is not None:
            # What the file holds (read, not what the manifest claims) against the model, and
            # the optimizer's tensors against their parameters, before anything is copied.
            saved = {n: [dtype_code(t.dtype), list(t.shape)] for n, t in tensors["model"].items()}
            trainable_only = bool(info.get("trainable_only"))
            for w in state.check_model(self.model.state_dict(), saved, trainable_only):
                log.warning("%s", w)
            if self.optimizer is not None:
                state.check_optimizer(self.optimizer, self.model, tensors["optimizer"])
            if trainable_only:
                self._check_frozen(info.get("frozen_fingerprint"))
            state.load_model(self.model, tensors["model"])
        if self.optimizer is not None and layout != "sharded":
            if "optimizer" not in st:
                raise StateMismatch("the checkpoint holds no optimizer state but an optimizer "
                                    "was given: pass optimizer=None to load weights only")
            for w in state.load_optimizer(self.optimizer, self.model, tensors["optimizer"],
                                          st["optimizer"]):
                log.warning("%s", w)
        if self.scheduler is not None and "scheduler" in st:
            self.scheduler.load_state_dict(decode(st["scheduler"], tensors["extra"]))
        if self.scaler is not None and st.get("scaler"):
            self.scaler.load_state_dict(decode(st["scaler"], tensors["extra"]))
        if self.data is not None:
            self.data.load_state_dict(st, tensors["extra"])
        self._apply_lr_scale(float(st.get("lr_scale", 1.0)))
        if rng is None:
            return
        state.load_rng(*rng)
        if self.data is not None:
            self.data.restored()  # sampler-only: undo the next iter(loader)'s global draw

    def _apply_lr_scale(self, saved_scale: float) -> None:
        """After a non-finite loss the supervisor sets `lr_scale` (for scripts without an `lr`
        knob): scale the restored learning rates by what is new since the checkpoint."""
        wanted = current_settings().get("lr_scale", saved_scale)
        if not isinstance(wanted, (int, float)) or isinstance(wanted, bool) or wanted <= 0:
            return
        self._lr_scale = float(wanted)
        ratio = self._lr_scale / saved_scale
        if ratio == 1.0 or self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if isinstance(group.get(key), float):
                    group[key] *= ratio
        for attr in ("base_lrs", "_last_lr"):
            values = getattr(self.scheduler, attr, None)
            if isinstance(values, list):
                setattr(self.scheduler, attr, [v * ratio for v in values])
        log.warning("learning rate scaled by %g (lr_scale %g, checkpoint had %g)", ratio,
                    self._lr_scale, saved_scale)

    def _check_frozen(self, saved_fp: str | None) -> None:
        if self.model is None or saved_fp is None:
            return
        fp = state.content_fingerprint(state.frozen_tensors(self.model))
        if fp != saved_fp:
            raise StateMismatch("the frozen base model differs from the one this trainable-only "
                                "checkpoint was trained on: load the same base weights first")
        self._frozen_fp = fp

    # ------------------------------------------------------------ save

    def maybe_save(self, step: int, *, metrics: dict[str, float] | None = None,
                   epoch_end: bool = False, extra: dict[str, Any] | None = None) -> Path | None:
        """Save when the schedule says so, on request, or when a stop was requested.

        After a stop request (preemption) the checkpoint is committed and the process exits 75.
        Also sends the step's heartbeat to the supervisor.
        """
        faults.step_hook(step, self.ckpt_dir)  # a no-op unless RTRAIN_FAULTS arms one
        stop = runtime.should_stop()
        now = time.monotonic()
        seen = self._samples()
        runtime.heartbeat(step=step, loss=_number((metrics or {}).get("loss")),
                          samples=None if seen is None else seen - self._hb_samples,
                          next_save_step=self._next_save_step(step))
        self._hb_samples = seen or 0
        path = None
        due = self._save_requested or self.schedule.due(
            step, last_step=self._last_save_step, now=now, last_time=self._last_save_time,
            epoch_end=epoch_end)
        if dist.world() is not None:
            # A stop signal or a timed save reaches ranks at different steps; saving is
            # collective, so one rank's reason is every rank's.
            stop, due = dist.any_of([stop, due])
        if stop or due:
            path = self.save(step, metrics=metrics, extra=extra)
        if stop and self.exit_on_stop:
            self.close()
            log.info("stop requested: checkpoint at step %d committed, exiting %d", step,
                     EXIT_PREEMPTED)
            runtime.heartbeat(step=step, event="stop")
            raise SystemExit(EXIT_PREEMPTED)
        return path

    def request_save(self) -> None:
        """Save at the next `maybe_save`, whatever the schedule says."""
        self._save_requested = True

    def save(self, step: int, *, metrics: dict[str, float] | None = None,
             extra: dict[str, Any] | None = None, epoch: int | None = None) -> Path | None:
        """Save now. Returns the committed path (sync), the path it will have (async), or None
        when the save was skipped for lack of disk space or a storage error (training goes on)."""
        self._wait_inflight()
        if self._last_save_step == step and self.last_saved is not None:
            return self.last_saved  # already saved at this step (e.g. on schedule, then on stop)
        self._save_requested = False
        self._last_save_time = time.monotonic()
        if epoch is not None:
            self.epoch = epoch
        elif self.data is not None and self.data.samples_seen is not None:
            self.epoch = self.data.epoch
        cap = self._capture(step, metrics or {}, extra or {})
        if cap.world is not None:
            return self._save_dist(cap)
        short = self._make_room(cap.nbytes)
        if short is not None:
            self._skip(step, short)
            return None
        runtime.heartbeat(step=step, event="save_begin")
        if not self.async_save:
            path = self._write(cap)
            runtime.heartbeat(step=step, event="save_end")
            return path
        self._inflight_step = step
        if self._fork_snapshot(cap):
            pid, err_fd = _fork_writer(self, cap)
            target, args = self._wait_child, (cap, pid, err_fd)
        else:
            target, args = self._write_bg, (self._snapshot(cap),)
        self._inflight = threading.Thread(target=target, args=args, name="rtrain-ckpt-writer",
                                          daemon=True)
        self._inflight.start()
        self._last_save_step = step
        return self.ckpt_dir / f"checkpoint-{step}"

    def _save_dist(self, cap: _Capture) -> Path | None:
        runtime.heartbeat(step=cap.step, event="save_begin")
        if not self.async_save or cap.sharded is not None:
            # Sharded state is saved synchronously: DCP reads the live parameters.
            path = self._write(cap)
            runtime.heartbeat(step=cap.step, event="save_end")
            return path
        if self.async_mode == "fork":
            raise ValueError("async_mode='fork' cannot be used with torch.distributed: a forked "
                             "writer cannot take part in the checkpoint's collectives; use "
                             "async_mode='thread' or 'auto'")
        self._inflight_step = cap.step
        self._inflight = threading.Thread(target=self._write_bg, args=(self._snapshot(cap),),
                                          name="rtrain-ckpt-writer", daemon=True)
        self._inflight.start()
        self._last_save_step = cap.step
        return self.ckpt_dir / f"checkpoint-{cap.step}"

    def _is_sharded(self) -> bool:
        return self.sharded if self.sharded is not None else dist.is_sharded(self.model)

    def close(self) -> None:
        """Wait for a save in flight; raise its error if it failed."""
        self._wait_inflight()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _samples(self) -> int | None:
        return self.data.samples_seen if self.data is not None else None

    def _next_save_step(self, step: int) -> int | None:
        n = self.schedule.every_steps
        return (step // n + 1) * n if n else None

    def _capture(self, step: int, metrics: dict[str, Any], extra: dict[str, Any]) -> _Capture:
        w = dist.world()
        if w is not None:
            return self._capture_dist(w, step, metrics, extra)
        return self._capture_local(step, metrics, extra)

    def _capture_dist(self, w: dist.World, step: int, metrics: dict[str, Any],
                      extra: dict[str, Any]) -> _Capture:
        sharded = self._is_sharded()
        if sharded and self.trainable_only:
            raise ValueError("trainable_only is not supported with sharded (FSDP/DTensor) state")
        rng_tensors, rng_plain = state.rng_state()
        sharded_sd = dist_ckpt.sharded_state(self.model, self.optimizer) if sharded else None
        if w.leader:
            # Replicated state (DDP: identical on every rank) is written once, by rank 0.
            cap = self._capture_local(step, metrics, extra, rng=False,
                                      components=not sharded)
            cap.fields["info"].update(world_size=w.size,
                                      layout="sharded" if sharded else "replicated")
        else:
            cap = _Capture(step, {}, {}, {})
        stem = dist_ckpt.rng_stem(w.rank)
        cap.tensors[stem] = {k: cpu_contiguous(v) for k, v in rng_tensors.items()}
        cap.world, cap.rank_rng, cap.sharded = w, rng_plain, sharded_sd
        return cap

    def _capture_local(self, step: int, metrics: dict[str, Any], extra: dict[str, Any],
                       rng: bool = True, components: bool = True) -> _Capture:
        tensors: dict[str, dict[str, torch.Tensor]] = {stem: {} for stem in _FILES}
        st: dict[str, Any] = {"step": step, "epoch": self.epoch, "lr_scale": self._lr_scale}
        info: dict[str, Any] = {"trainable_only": self.trainable_only, "world_size": 1}
        fingerprint = None
        if self.model is not None and not components:
            fingerprint = state.fingerprint_items(self.model.state_dict())
        if self.model is not None and components:
            tensors["model"] = state.model_tensors(self.model, self.trainable_only)
            fingerprint = state.fingerprint_items(self.model.state_dict())
            if self.trainable_only:
                if self._frozen_fp is None:
                    self._frozen_fp = state.content_fingerprint(state.frozen_tensors(self.model))
                info["frozen_fingerprint"] = self._frozen_fp
        if self.optimizer is not None and components:
            opt_tensors, st["optimizer"] = state.optimizer_state(self.optimizer, self.model)
            if self.trainable_only:
                keep = set(tensors["model"])
                opt_tensors = {k: v for k, v in opt_tensors.items()
                               if k.startswith("@") or k.rpartition("/")[0] in keep}
            tensors["optimizer"] = opt_tensors
        ex = tensors["extra"]
        if self.scheduler is not None:
            st["scheduler"] = encode(self.scheduler.state_dict(), ex, "scheduler")
        if self.scaler is not None:
            st["scaler"] = encode(self.scaler.state_dict(), ex, "scaler")
        if self.data is not None:
            st.update(self.data.state_dict(ex))
        if rng:
            rng_tensors, st["rng"] = state.rng_state()
            ex.update(rng_tensors)
        st["extra"] = encode(extra, ex, "extra")
        for stem in _FILES:
            tensors[stem] = {k: cpu_contiguous(v) for k, v in tensors[stem].items()}
        samples = self._samples() or 0
        fields = {
            "epoch": self.epoch, "samples_seen": samples, "fingerprint": fingerprint,
            "environment": _environment(self.model), "settings": current_settings(),
            "metrics": {k: _number(v) for k, v in metrics.items()}, "info": info,
        }
        return _Capture(step, tensors, st, fields)

    def _fork_snapshot(self, cap: _Capture) -> bool:
        """Whether to snapshot by fork: the child's copy-on-write view of memory is the
        snapshot, so the training thread is blocked only for the fork (page tables), not for a
        copy of every byte. Only for state that lives in host memory; CUDA state is copied to
        pinned buffers instead (the copy is asynchronous there)."""
        if self.async_mode == "thread" or not hasattr(os, "fork"):
            return False
        if dist.world() is not None:
            return False  # a forked child cannot join collectives (_save_dist enforces it)
        return self.async_mode == "fork" or (not any(
            t.is_pinned() for ts in cap.tensors.values() for t in ts.values()
        ) and not _has_cuda_state(self.model))

    def _wait_child(self, cap: _Capture, pid: int, err_fd: int) -> None:
        try:
            _, status = os.waitpid(pid, 0)
            with os.fdopen(err_fd, "rb") as f:
                message = f.read().decode(errors="replace")
            code = os.waitstatus_to_exitcode(status)
            if code == 0:
                self.last_saved = self.ckpt_dir / f"checkpoint-{cap.step}"
                # The child wrote and hashed it; the next forked child inherits this record.
                self._verified.add(verify(self.last_saved, Level.QUICK, self.key))
            elif code == _CHILD_SKIPPED:
                self.skipped_saves += 1  # the writer said why, in the log and to the supervisor
            else:
                self._error = CheckpointError(message or f"the checkpoint writer process ended "
                                              f"with status {code}")
        finally:
            runtime.heartbeat(step=cap.step, event="save_end")

    def _snapshot(self, cap: _Capture) -> _Capture:
        """Copy tensors into reused CPU buffers so training can go on while they are written."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        pin = torch.cuda.is_available()
        for stem, ts in cap.tensors.items():
            out[stem] = {}
            for name, t in ts.items():
                buf = self._buffers.get((stem, name))
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                    self._buffers[(stem, name)] = buf
                buf.copy_(t, non_blocking=pin)
                out[stem][name] = buf
        if pin:
            torch.cuda.synchronize()
        return replace(cap, tensors=out)

    def _skip(self, step: int, reason: str) -> None:
        """A checkpoint that was not written: count it, say why, and tell the supervisor (it
        records a `save_skipped` event, and warns when the run ends unsaved)."""
        self.skipped_saves += 1
        log.warning("checkpoint at step %d not saved (%s); skipping this checkpoint, earlier "
                    "checkpoints are intact, training goes on", step, reason)
        runtime.heartbeat(step=step, event="save_skipped", reason=reason)

    def _make_room(self, nbytes: int) -> str | None:
        """None when `nbytes` fit (after pruning if needed); else why the save must be skipped."""
        try:
            filemode.make_dir(self.ckpt_dir, filemode.from_env())
        except OSError as e:
            if e.errno not in _STORAGE_ERRNOS and not isinstance(e, PermissionError):
                raise
            return f"cannot create {self.ckpt_dir}: {e.strerror}"
        need = nbytes + (1 << 20)
        if free_bytes(self.ckpt_dir) >= need:
            return None
        # Make room for the new one: keep one fewer than the policy says (never the newest).
        keep = None if self.policy.keep is None else max(1, self.policy.keep - 1)
        tighter = retention.RetentionPolicy(keep=keep, keep_best=self.policy.keep_best,
                                            metric=self.policy.metric, mode=self.policy.mode,
                                            milestone_every=self.policy.milestone_every)
        report = prune(self.ckpt_dir, tighter, key=self.key, verified=self._verified)
        _log_retention(report, "low on disk: ", logging.WARNING)
        free = free_bytes(self.ckpt_dir)
        if free >= need:
            return None
        return (f"no room: it needs about {need / 2**20:.1f} MiB and {self.ckpt_dir} has "
                f"{free / 2**20:.1f} MiB free; free some space or lower keep")

    def _write(self, cap: _Capture) -> Path | None:
        if cap.world is not None:
            path = dist_ckpt.write(self, cap)
            if path is not None:
                self.last_saved, self._last_save_step = path, cap.step
                if cap.world.leader:
                    self._apply_retention()
            return path
        pending = None
        try:
            pending = PendingCheckpoint(self.ckpt_dir, cap.step, fsync=self.fsync,
                                        hash_alg=hashing.alg_for(self.key))
            for stem in _FILES:
                blobs = [to_blob(n, t) for n, t in cap.tensors[stem].items()]
                pending.write_tensors(f"{stem}.safetensors", blobs)
                faults.on_save_write(cap.step)
            pending.write_bytes("state.json", json.dumps(cap.state_json).encode())
            path = pending.commit(cap.fields, self.key)
        except OSError as e:
            if pending is not None:
                pending.abort()
            if e.errno not in _STORAGE_ERRNOS:
                raise
            self._skip(cap.step, os.strerror(e.errno))
            return None
        except BaseException:
            if pending is not None:
                pending.abort()
            raise
        self.last_saved, self._last_save_step = path, cap.step
        self._apply_retention()
        return path

    def _write_bg(self, cap: _Capture) -> None:
        try:
            self._write(cap)
        except BaseException as e:  # surfaced on the next save()/close(), never dropped
            self._error = e
        finally:
            runtime.heartbeat(step=cap.step, event="save_end")

    def _wait_inflight(self) -> None:
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None
            self._inflight_step = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"the background checkpoint save failed: {err}") from err

    def _apply_retention(self) -> None:
        protect = frozenset({self._inflight_step} - {None})
        if self.last_saved is not None:
            # Hashed from the very bytes it wrote a moment ago: counts as fully verified, so
            # retention re-reads only checkpoints this process did not write (or that changed).
            self._verified.add(verify(self.last_saved, Level.QUICK, self.key))
        report = prune(self.ckpt_dir, self.policy, key=self.key, protect=protect,
                       verified=self._verified)
        _log_retention(report, "retention: ", logging.INFO)


def _log_retention(report: PruneReport, prefix: str, removal_level: int) -> None:
    for v in report.failed_full:
        log.warning("%s%s passes the quick check but fails full verification (%s): not "
                    "counted as a good checkpoint", prefix, v.path.name, v.describe())
    for r in report.removed:
        log.log(removal_level, "%sremoved %s (%s)", prefix, r.path.name, r.reason)
    log.info("%skept %s", prefix, "; ".join(f"{v.path.name}: {report.why.get(v.path, '')}"
                                            for v in report.kept) or "none")


_CHILD_SKIPPED = 3
_STATE_LIMIT = 1 << 30  # state.json: JSON of the non-tensor state, never near this


def _read_state(path: Path, m: dict[str, Any], alg: str) -> dict[str, Any]:
    """state.json, which every rtrain checkpoint has: only if the manifest lists it."""
    if "state.json" not in m["files"]:
        raise LoadError("the manifest does not list state.json, which every rtrain checkpoint "
                        "has: it is not a loadable rtrain checkpoint")
    raw = read_listed(path, "state.json", m, alg, limit=_STATE_LIMIT)
    try:
        st = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise LoadError(f"state.json is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(st, dict):
        raise LoadError("state.json is not a JSON object")
    scale = st.get("lr_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < 1e30:
        raise LoadError(f"state.json's lr_scale {scale!r} is not a positive number")
    return st


def _report_bad_checkpoint(path: str, reason: str) -> None:
    """Tell the supervisor that the checkpoint it chose cannot be loaded, and exit: it skips
    that one and relaunches from the one before (contract 2, `bad_checkpoint`)."""
    name = Path(path).name
    log.error("cannot resume from %s: %s", name, reason)
    try:
        runtime.write_exit_record(FailureKind.BAD_CHECKPOINT.value, f"{name}: {reason}",
                                  checkpoint=path)
    except OSError as e:  # the exit code still tells
        log.warning("could not write the exit record: %s", e)
    raise SystemExit(EXIT_BAD_CHECKPOINT)


def _has_cuda_state(model: torch.nn.Module | None) -> bool:
    return model is not None and any(p.is_cuda for p in model.parameters())


def _fork_writer(ck: Checkpointer, cap: _Capture) -> tuple[int, int]:
    """Fork a process that writes and commits `cap` from its copy-on-write memory.

    The child runs only file I/O, hashing and JSON (no torch ops, no imports, no locks another
    thread could hold) and leaves with os._exit, so forking a threaded process is safe here.
    """
    import warnings

    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "process is multi-threaded"
        pid = os.fork()
    if pid:
        os.close(w)
        return pid, r
    code = 0
    try:
        os.close(r)
        if ck._write(cap) is None:
            os.write(w, f"checkpoint at step {cap.step} not saved (storage error or no "
                        "space); earlier checkpoints are intact, training goes on".encode())
            code = _CHILD_SKIPPED
    except BaseException as e:
        os.write(w, f"{type(e).__name__}: {e}".encode(errors="replace"))
        code = 1
    finally:
        os._exit(code)


def _number(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


def _environment(model: torch.nn.Module | None) -> dict[str, Any]:
    device = "cpu"
    if model is not None:
        p = next(iter(model.parameters()), None)
        device = p.device.type if p is not None else "cpu"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": device, "rtrain": supervisor.__version__,
            "host": socket.gethostname()}


def _environment_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    return [f"environment changed since the checkpoint: {k} {saved[k]} -> {now[k]}"
            for k in ("python", "torch", "cuda", "rtrain", "device")
            if k in saved and saved[k] != now.get(k)]


