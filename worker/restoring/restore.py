"""Restoring: pick a checkpoint, read it verified, then apply it to the training objects.

Reading and applying are apart: every file is read once, hashed as it is read and compared
with the manifest (`Source.read`) before anything touches the model (`apply`), so a checkpoint
that fails to load leaves the model as it was. Which checkpoint, and what happens when it
cannot be loaded, is `Checkpointer.restore`'s contract:
- chosen by rtrain (RTRAIN_RESUME_FROM): verified quickly (the supervisor verified it fully a
  moment ago); on failure the worker reports `bad_checkpoint` and exits (`report_bad_checkpoint`);
- run by hand, one process: the newest that verifies and loads, older ones on failure
  (`Source.first_loadable`);
- under torch.distributed: rank 0 picks and verifies, every rank loads that one (`Source.agree`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rtrain.checkpoint import crypt, hashing, state_schema
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.parts import OWN
from rtrain.checkpoint.verified_read import LoadError, read_listed
from rtrain.checkpoint.verify import STATE_LIMIT, Level, Verdict, select_rtrain_resume, verify
from rtrain.supervisor.core.errors import (
    CheckpointError,
    CorruptCheckpoint,
    ExitCode,
    KeyMismatch,
    StateMismatch,
)
from rtrain.supervisor.core.protocol import ENV_MEMORY_DIR, ENV_RESUME_FROM, ENV_RUN_DIR
from rtrain.supervisor.decide.failures import FailureKind
from rtrain.worker import dist, runtime
from rtrain.worker.memtier import memory_resume
from rtrain.worker.saving import dist_ckpt
from rtrain.worker.saving.capture import Components
from rtrain.worker.saving.save_target import FILES
from rtrain.worker.settings import current as current_settings
from rtrain.worker.trainstate import hyperparams, state
from rtrain.worker.trainstate.tensors import decode, dtype_code, load_listed

log = logging.getLogger(__name__)

_STATE_LIMIT = STATE_LIMIT


@dataclass
class Loaded:
    """A checkpoint read and verified, not yet applied."""

    path: Path
    manifest: dict[str, Any]
    state: dict[str, Any]  # state.json
    tensors: dict[str, dict[str, torch.Tensor]]  # file stem -> name -> tensor
    rng: tuple[dict[str, torch.Tensor], dict[str, Any]] | None
    layout: str  # "sharded" or "replicated" (dist_ckpt.check_world)
    alg: str  # the manifest's file hash
    extra: Any  # the user's extras, decoded
    enc: crypt.EncryptionKey | None = None  # opens the files of an encrypted checkpoint


@dataclass(frozen=True)
class Source:
    """Where checkpoints are found and how they are checked and read."""

    ckpt_dir: Path
    verify_level: Level
    key: bytes | None
    allow_resize: bool
    map_location: str | torch.device
    enc: crypt.EncryptionKey | None = None
    """The encryption key (RTRAIN_ENCRYPTION_KEY); an encrypted checkpoint needs the one it
    was saved with."""

    def find(self, path: str | os.PathLike | None, w: dist.World | None,
             parts: Components) -> Loaded | None:
        """The checkpoint to resume from, read and verified; None to start fresh."""
        if w is None and path is None and not os.environ.get(ENV_RESUME_FROM):
            return self.first_loadable(parts)
        if w is not None and path is None and memory_resume.allowed():
            loaded = self.from_memory(w, parts)  # collective: every rank takes part
            if loaded is not None:
                return loaded
        found = self.agree(path, w)
        return None if found is None else self.read(*found, w, parts)

    def from_memory(self, w: dist.World, parts: Components) -> Loaded | None:
        """The group's resume from the memory tier's parts (worker/memtier/memory_resume.py), or
        None: no step whole on every node as new as the disk's, or a part that did not read on some
        rank (then every rank goes to the disk tier together)."""
        found = memory_resume.this_runs_parts(self.key)
        step = memory_resume.agree(w, found)
        if step is None:
            return None
        loaded, why = None, ""
        try:
            leader, own = memory_resume.parts_for(found, step, w.rank)
            loaded = self.read(leader.path, leader.manifest, w, parts,
                               rng_from=(own.path, own.manifest))
        except Exception as e:  # every rank must reach the all-reduce below
            why = getattr(e, "reason", None) or f"{type(e).__name__}: {e}"
        if not dist.all_ok(loaded is not None):
            log.warning("the memory snapshot of step %d did not load on every rank%s: the "
                        "group resumes from the disk tier", step, f" ({why})" if why else "")
            return None
        peer = dist.any_of([leader.origin != OWN or own.origin != OWN])[0]
        log.info("resuming from the memory snapshot of step %d", step)
        if w.leader:
            runtime.heartbeat(step=step, event="snapshot",
                              snapshot={"resumed": step, "origin": "peer" if peer else "node"})
        return loaded

    def agree(self, path: str | os.PathLike | None, w: dist.World | None
              ) -> tuple[Path, dict[str, Any]] | None:
        if w is not None:  # rank 0 picks and verifies; every rank loads that one
            return dist_ckpt.agree(lambda: self.pick(path), w)
        chosen = self.pick(path)
        return None if chosen is None else (chosen.path, chosen.manifest)

    def pick(self, path: str | os.PathLike | None) -> Verdict | None:
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

    def first_loadable(self, parts: Components) -> Loaded | None:
        """Run by hand: the newest checkpoint that verifies and loads; older ones on failure.

        One this process's key cannot open is passed over only for an older one written as
        this process writes (encrypted under its key, plaintext without one): a checkpoint of
        another key dropped into the dir. Otherwise the first KeyMismatch is raised: the
        run's own checkpoints need another key, and a fresh start would hide it."""
        if os.environ.get(ENV_RUN_DIR):
            return None  # supervised without RTRAIN_RESUME_FROM: the supervisor chose a fresh start
        locked: list[KeyMismatch] = []
        for _, p in list_checkpoints(self.ckpt_dir):
            v = verify(p, self.verify_level, self.key)
            if not v.ok:
                log.warning("skipping %s: %s", p.name, v.describe())
                continue
            try:
                loaded = self.read(v.path, v.manifest, None, parts)
            except KeyMismatch as e:
                locked.append(e)
                continue
            except CorruptCheckpoint as e:
                log.warning("skipping %s: %s", p.name, e.reason)
                continue
            if locked and not self._written_as_now(loaded.manifest):
                raise locked[0]
            for e in locked:
                log.warning("skipping %s: %s", Path(e.path).name, e.reason)
            return loaded
        if locked:
            raise locked[0]
        return None

    def _written_as_now(self, m: dict[str, Any]) -> bool:
        entry = m.get("encryption")
        if self.enc is None:
            return entry is None
        return isinstance(entry, dict) and entry.get("key_fingerprint") == self.enc.fingerprint

    def read(self, path: Path, m: dict[str, Any], w: dist.World | None,
             parts: Components, rng_from: tuple[Path, dict[str, Any]] | None = None
             ) -> Loaded:
        """Read everything a restore needs from `path`, verified; nothing is applied yet, so a
        checkpoint that fails here leaves the model as it was. KeyMismatch (before any file is
        read) when it is encrypted and this process has no key or another one. `rng_from`:
        this rank's RNG lies in another checkpoint (its memory-tier part)."""
        try:
            problem = crypt.key_problem(m, self.enc)
        except crypt.CryptError as e:
            raise CorruptCheckpoint(str(path), f"cannot load: {e}") from None
        if problem is not None:
            raise KeyMismatch(str(path), problem)
        try:
            alg = hashing.manifest_alg(m, self.key)
            info = m.get("info") if isinstance(m.get("info"), dict) else {}
            layout = dist_ckpt.check_world(info, w, parts.is_sharded(), self.allow_resize,
                                           path.name)
            st = read_state(path, m, alg, self.enc)
            tensors = {stem: self._load_tensors(path, stem, m, alg) for stem in FILES}
            check_state(st, m, tensors, sharded=layout == "sharded")
            rng_path, rng_m = rng_from or (path, m)
            if rng_from is not None and (problem := crypt.key_problem(rng_m, self.enc)):
                raise KeyMismatch(str(rng_path), problem)
            rng = dist_ckpt.load_rank_rng(rng_path, rng_m, st, tensors["extra"],
                                          w.rank if w else 0,
                                          hashing.manifest_alg(rng_m, self.key), self.enc)
            if rng is not None and (bad := state_schema.rng_problems(rng[1], "rng")):
                raise LoadError(f"this rank's RNG state: {'; '.join(bad)}")
            try:
                extra = decode(st.get("extra", {}), tensors["extra"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise LoadError(f"state.json's extras refer to what extra.safetensors does not "
                                f"hold ({type(e).__name__}: {e})") from None
        except (LoadError, hashing.HashAlgError) as e:
            raise CorruptCheckpoint(str(path), f"cannot load: {e}") from None
        return Loaded(path, m, st, tensors, rng, layout, alg, extra, self.enc)

    def _load_tensors(self, path: Path, stem: str, m: dict[str, Any], alg: str
                      ) -> dict[str, torch.Tensor]:
        name = f"{stem}.safetensors"
        if name not in m["files"]:
            return {}
        handed = handed_over_from_memory(path)
        tensors, _ = load_listed(path, name, m, alg, self.enc, hashed_already=handed,
                                 map_data=handed and stem == "model")
        # RNG states must stay on the CPU; the rest may go straight to the training device.
        device = torch.device("cpu" if stem == "extra" else self.map_location)
        if device.type == "cpu":
            return tensors
        return {k: v.to(device) for k, v in tensors.items()}


def handed_over_from_memory(path: Path) -> bool:
    """`path` is the memory-tier snapshot rtrain chose (RTRAIN_RESUME_FROM inside
    RTRAIN_MEMORY_DIR). rtrain points there only at a snapshot whose every byte it hashed
    before this attempt started (as it sealed it from the live state, or in place; its copy to
    the checkpoint dir may run beside this read), in a directory of this user alone: its
    tensor files are read without hashing again (supervisor/memtier/tier.py)."""
    mem, chosen = os.environ.get(ENV_MEMORY_DIR), os.environ.get(ENV_RESUME_FROM)
    if not mem or not chosen:
        return False
    here = path.resolve()
    return here == Path(chosen).resolve() and here.parent == Path(mem).resolve()


def read_state(path: Path, m: dict[str, Any], alg: str,
               enc: crypt.EncryptionKey | None = None) -> dict[str, Any]:
    """state.json, which every rtrain checkpoint has: only if the manifest lists it."""
    if "state.json" not in m["files"]:
        raise LoadError("the manifest does not list state.json, which every rtrain checkpoint "
                        "has: it is not a loadable rtrain checkpoint")
    raw = read_listed(path, "state.json", m, alg, limit=_STATE_LIMIT, enc=enc)
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


def check_state(st: dict[str, Any], m: dict[str, Any],
                tensors: dict[str, dict[str, torch.Tensor]], sharded: bool = False) -> None:
    """state.json against its schema (`checkpoint/state_schema.py`), its tensor references against
    the tensors read, before anything is applied: a field missing or of the wrong type (a hand
    edit whose hash was recomputed, another version's layout) is a checkpoint that cannot be
    loaded, not a KeyError half-way through applying it. A sharded checkpoint keeps its
    optimizer state in DCP's files, so its references are not looked up here."""
    try:
        state_schema.check(st, step=m["step"], extra_tensors=set(tensors["extra"]),
                           optimizer_tensors=None if sharded else set(tensors["optimizer"]))
    except state_schema.StateSchemaError as e:
        raise LoadError(str(e)) from None


def apply_all(loaded: Loaded, parts: Components, allow_pickle: bool, lr_scale: float
              ) -> tuple[list[hyperparams.Change], float]:
    """`apply`, `apply_lr_scale`, `apply_rng`: the checkpoint into the training objects.
    Returns the hyper-parameters it replaced and the lr_scale now in force.

    A checkpoint that verified and passed the schema can still fail here: a value the schema
    cannot judge (a scheduler's state its load_state_dict refuses, a tensor of the wrong shape
    for a scaler or a generator). That is a checkpoint that cannot be loaded (CorruptCheckpoint:
    under rtrain a `bad_checkpoint` exit, the next attempt resumes from the one before), not a
    start-up failure. Two kinds pass as they are: StateMismatch (the checkpoint does not fit
    this model, optimizer or data: an older one would not fit either) and running out of
    memory while loading."""
    try:
        changes = apply(loaded, parts, allow_pickle)
        lr_scale = apply_lr_scale(loaded, parts, lr_scale)
        apply_rng(loaded, parts)
    except (CheckpointError, torch.cuda.OutOfMemoryError, MemoryError):
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError,
            OverflowError) as e:
        raise CorruptCheckpoint(str(loaded.path), f"cannot apply: {type(e).__name__}: "
                                f"{str(e)[:300]}") from None
    return changes, lr_scale


def apply(loaded: Loaded, parts: Components, allow_pickle: bool) -> list[hyperparams.Change]:
    """Load `loaded` into the training objects; `apply_lr_scale`, then `apply_rng`, follow.
    Returns the optimizer hyper-parameters the checkpoint replaced (judged later:
    worker/trainstate/hyperparams.py)."""
    st, tensors = loaded.state, loaded.tensors
    changes: list[hyperparams.Change] = []
    if loaded.layout == "sharded":
        try:
            dist_ckpt.load_sharded(loaded.path, loaded.manifest, loaded.alg, parts.model,
                                   parts.optimizer, allow_pickle, loaded.enc)
        except LoadError as e:
            raise CorruptCheckpoint(str(loaded.path), f"cannot load: {e}") from None
    elif parts.model is not None:
        _load_model(loaded, parts)
    if parts.optimizer is not None and loaded.layout != "sharded":
        if "optimizer" not in st:
            raise StateMismatch("the checkpoint holds no optimizer state but an optimizer "
                                "was given: pass optimizer=None to load weights only")
        changes = state.load_optimizer(parts.optimizer, parts.model, tensors["optimizer"],
                                       st["optimizer"])
    if parts.scheduler is not None and "scheduler" in st:
        parts.scheduler.load_state_dict(decode(st["scheduler"], tensors["extra"]))
    if parts.scaler is not None and st.get("scaler"):
        parts.scaler.load_state_dict(decode(st["scaler"], tensors["extra"]))
    if parts.data is not None:
        parts.data.load_state_dict(st, tensors["extra"])
    return changes


def apply_rng(loaded: Loaded, parts: Components) -> None:
    if loaded.rng is None:
        return
    state.load_rng(*loaded.rng)
    if parts.data is not None:
        parts.data.restored()  # sampler-only: undo the next iter(loader)'s global draw


def _load_model(loaded: Loaded, parts: Components) -> None:
    """Check what the file holds (read, not what the manifest claims) against the model, and
    the optimizer's tensors against their parameters, before anything is copied."""
    model, tensors = parts.model, loaded.tensors
    assert model is not None
    m = loaded.manifest
    info = m.get("info") if isinstance(m.get("info"), dict) else {}
    saved = {n: [dtype_code(t.dtype), list(t.shape)] for n, t in tensors["model"].items()}
    trainable_only = bool(info.get("trainable_only"))
    for w in state.check_model(model.state_dict(), saved, trainable_only):
        log.warning("%s", w)
    if parts.optimizer is not None:
        state.check_optimizer(parts.optimizer, model, tensors["optimizer"])
    if trainable_only:
        _check_frozen(parts, info.get("frozen_fingerprint"))
    state.load_model(model, tensors["model"])


def _check_frozen(parts: Components, saved_fp: str | None) -> None:
    if parts.model is None or saved_fp is None:
        return
    fp = state.content_fingerprint(state.frozen_tensors(parts.model))
    if fp != saved_fp:
        raise StateMismatch("the frozen base model differs from the one this trainable-only "
                            "checkpoint was trained on: load the same base weights first")
    parts.frozen.fingerprint = fp


def apply_lr_scale(loaded: Loaded, parts: Components, current: float) -> float:
    """After a non-finite loss the supervisor sets `lr_scale` (for scripts without an `lr`
    knob): scale the restored learning rates by what is new since the checkpoint. Returns the
    lr_scale now in force (`current` when the setting is unusable)."""
    saved_scale = float(loaded.state.get("lr_scale", 1.0))
    wanted = current_settings().get("lr_scale", saved_scale)
    if not isinstance(wanted, (int, float)) or isinstance(wanted, bool) or wanted <= 0:
        return current
    scale = float(wanted)
    ratio = scale / saved_scale
    if ratio == 1.0 or parts.optimizer is None:
        return scale
    for group in parts.optimizer.param_groups:
        for key in ("lr", "initial_lr"):
            if isinstance(group.get(key), float):
                group[key] *= ratio
    for attr in ("base_lrs", "_last_lr"):
        values = getattr(parts.scheduler, attr, None)
        if isinstance(values, list):
            setattr(parts.scheduler, attr, [v * ratio for v in values])
    log.warning("learning rate scaled by %g (lr_scale %g, checkpoint had %g)", ratio, scale,
                saved_scale)
    return scale


def report_bad_checkpoint(path: str, reason: str) -> None:
    """Tell the supervisor that the checkpoint it chose cannot be loaded, and exit: it skips
    that one and relaunches from the one before (contract 2, `bad_checkpoint`)."""
    name = Path(path).name
    log.error("cannot resume from %s: %s", name, reason)
    try:
        runtime.write_exit_record(FailureKind.BAD_CHECKPOINT.value, f"{name}: {reason}",
                                  checkpoint=path)
    except OSError as e:  # the exit code still tells
        log.warning("could not write the exit record: %s", e)
    raise SystemExit(ExitCode.BAD_CHECKPOINT)


def environment_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    return [f"environment changed since the checkpoint: {k} {saved[k]} -> {now[k]}"
            for k in ("python", "torch", "cuda", "rtrain", "device")
            if k in saved and saved[k] != now.get(k)]
