"""`rtrain export`: a checkpoint's model weights (and, asked, its optimizer state) as one
`.safetensors` file or a plain `torch.save` state dict, for inference or another tool.

The source is verified fully first (`foreign.verify_path`: hashes for rtrain's format, CRC-32s
and headers for the others) and a damaged one is refused with the verifier's reason; a
directory of checkpoints exports the one a launch would resume from. Then one of two ways:

- `copy`, torch-free, in this process: safetensors out of safetensors in (rtrain's model and
  optimizer files, a Trainer's model.safetensors or shards). A new header over the same bytes
  (`checkpoint/st_concat.py`), each rtrain file hashed against its manifest as it is copied.
- `torch`, in `python -m rtrain.worker.export.convert` (`worker/export/convert.py`): every export
  to a torch.save file and every source that is a pickle, which is loaded with
  `torch.load(weights_only=True)` only. rtrain stays torch-free; the child runs the worker that
  ships with this rtrain.

Either way the output is written to a temp file beside OUT, fsynced, then published: renamed
over OUT with --force, else linked to OUT's name, which fails if OUT appeared meanwhile. An
existing OUT is never replaced without --force, and OUT may not be where a launch would take
it for a checkpoint (inside the checkpoint, or a checkpoint-like name beside it).
"""

from __future__ import annotations

import enum
import errno
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtrain.checkpoint import crypt, hashing
from rtrain.checkpoint.layout import parse_step
from rtrain.checkpoint.verify import Level, Selection, Verdict
from rtrain.supervisor.ckpt import foreign, hf_trainer
from rtrain.supervisor.core import isolated
from rtrain.supervisor.core.errors import CheckpointError, ExitCode, RtrainError, UsageError
from rtrain.supervisor.core.untrusted_text import safe

FORMATS = ("safetensors", "torch")
SUFFIXES = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}
OPTIMIZER_PREFIX = "optimizer/"
# safetensors' own convention for files of torch tensors (transformers checks it on load).
METADATA = {"format": "pt"}


class Way(str, enum.Enum):
    COPY = "copy"  # torch-free, in this process: safetensors from safetensors
    TORCH = "torch"  # in `python -m rtrain.worker.export.convert`


@dataclass(frozen=True)
class Plan:
    """How one export is made. `copy`: the checkpoint's safetensors `files` (name, tensor
    prefix) concatenated here, with state.json's optimizer entry in the metadata when
    `optimizer_meta`. `torch`: `request` for rtrain.worker.export.convert."""

    how: Way
    files: tuple[tuple[str, str], ...] = ()
    optimizer_meta: bool = False
    request: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Exported:
    out: Path
    format: str
    verdict: Verdict
    selection: Selection | None  # when CHECKPOINT was a directory of checkpoints
    optimizer: bool
    tensors: int
    size: int
    notes: tuple[str, ...] = ()


def format_of(out: Path, fmt: str | None) -> str:
    """--format, else OUT's suffix."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise UsageError(f"unknown format {fmt!r}: use safetensors or torch")
        return fmt
    found = SUFFIXES.get(out.suffix.lower())
    if found is None:
        raise UsageError(f"cannot tell the format from {safe(out.name)!s}: name it "
                         ".safetensors or .pt, or pass --format safetensors|torch")
    return found


def plan(verdict: Verdict, fmt: str, optimizer: bool, weight_files: list[str] | None = None,
         has_optimizer_pt: bool = False) -> Plan:
    """The way to export `verdict`'s checkpoint: pure, from the verdict, the request and, for a
    Trainer dir, what the caller found in it (its weight files, whether it has optimizer.pt).
    Raises CheckpointError when it holds nothing to export."""
    name = safe(verdict.path.name)
    if verdict.format == foreign.Format.RTRAIN.value:
        m = verdict.manifest or {}
        info = m.get("info") if isinstance(m.get("info"), dict) else {}
        if info.get("layout") == "sharded":
            raise CheckpointError(f"{name}: its model is in DCP shards (FSDP/DTensor), which "
                                  "rtrain export does not read: load it with the Checkpointer "
                                  "and save model.state_dict()")
        files = m.get("files", {})
        table = m.get("tensors") if isinstance(m.get("tensors"), dict) else {}
        if "model.safetensors" not in files or table.get("model.safetensors") == {}:
            raise CheckpointError(f"{name}: no model weights found (model.safetensors is "
                                  f"{'empty' if 'model.safetensors' in files else 'not listed'})")
        if optimizer and "optimizer.safetensors" not in files:
            raise CheckpointError(f"{name}: holds no optimizer state to export: leave out "
                                  "--optimizer")
        if fmt == "safetensors":
            parts = (("model.safetensors", ""),)
            if optimizer:
                parts += (("optimizer.safetensors", OPTIMIZER_PREFIX),)
            return Plan(Way.COPY, parts, optimizer_meta=optimizer)
        return Plan(Way.TORCH, request={"source": "rtrain"})
    if verdict.format == foreign.Format.HF_TRAINER.value:
        files = weight_files or []
        if not files:
            note = (verdict.info or {}).get("note") or "no weights file"
            raise CheckpointError(f"{name}: no model weights found that rtrain reads ({note})")
        if optimizer and not has_optimizer_pt:
            raise CheckpointError(f"{name}: holds no optimizer state to export (no "
                                  "optimizer.pt): leave out --optimizer")
        if fmt == "safetensors" and not optimizer and all(f.endswith(".safetensors")
                                                          for f in files):
            return Plan(Way.COPY, tuple((f, "") for f in files))
        return Plan(Way.TORCH, request={"source": "hf", "files": files,
                                      "optimizer_file": "optimizer.pt" if optimizer else None})
    return Plan(Way.TORCH, request={"source": "pickle"})


def export_checkpoint(*, checkpoint: Path, out: Path, fmt: str | None, optimizer: bool,
                      force: bool, key: bytes | None) -> Exported:
    """Verify `checkpoint` (or pick the newest that verifies in a directory of them), then
    write its export to `out`, atomically."""
    _check_out_place(out, force)
    fmt = format_of(out, fmt)
    verdict, selection = resolve(checkpoint, key)
    _check_out_apart(out, verdict.path)
    weights = _hf_weights(verdict) if verdict.format == foreign.Format.HF_TRAINER.value else None
    how = plan(verdict, fmt, optimizer, weights, (verdict.path / "optimizer.pt").is_file())
    tmp = out.parent / f".{out.name}.rtrain-export-{os.getpid()}-{os.urandom(4).hex()}.tmp"
    try:
        if how.how is Way.COPY:
            count, notes = _copy(verdict, how, tmp, key), ()
        else:
            request = {**how.request, "path": str(verdict.path), "out": str(tmp),
                       "format": fmt, "optimizer": optimizer, "metadata": METADATA}
            result = run_worker(request)
            count, notes = int(result.get("tensors", 0)), tuple(result.get("notes", ()))
        _publish(tmp, out, force, _source_mode(verdict, weights))
    finally:
        tmp.unlink(missing_ok=True)
    return Exported(out, fmt, verdict, selection, optimizer, count, os.stat(out).st_size,
                    _notes(verdict) + notes)


def _notes(verdict: Verdict) -> tuple[str, ...]:
    info = (verdict.manifest or {}).get("info")
    if isinstance(info, dict) and info.get("trainable_only"):
        return ("only the trainable parameters (saved with trainable_only=True): load the "
                "same base weights first",)
    return ()


# ---------------------------------------------------------------- the source

def resolve(checkpoint: Path, key: bytes | None) -> tuple[Verdict, Selection | None]:
    """The checkpoint to export, verified fully: `checkpoint` itself, or for a directory of
    checkpoints the newest that verifies (as a launch would pick it)."""
    from rtrain.supervisor.commands.inspecting import is_checkpoint_dir

    if not os.path.lexists(checkpoint):
        raise UsageError(f"no checkpoint at {safe(str(checkpoint))}")
    if is_checkpoint_dir(checkpoint) or (checkpoint.is_dir() and foreign.is_hf_dir(checkpoint)):
        verdict = foreign.verify_path(checkpoint, Level.FULL, key)
        if not verdict.ok:
            raise CheckpointError(f"{safe(checkpoint.name)} failed full verification: "
                                  f"{safe(verdict.describe())}; not exported")
        return _exportable(verdict), None
    sel = foreign.select_resume_any_format(checkpoint, Level.FULL, key)
    if sel.chosen is None:
        if sel.skipped:
            newest = sel.skipped[0]
            raise CheckpointError(f"no checkpoint in {safe(str(checkpoint))} passes full "
                                  f"verification (newest: {safe(newest.path.name)}: "
                                  f"{safe(newest.describe())})")
        raise UsageError(f"no checkpoint in {safe(str(checkpoint))}")
    return _exportable(sel.chosen), sel


# Saves of other libraries that rtrain recognises to resume from but does not export.
_NOT_EXPORTED = {foreign.Format.ACCELERATE.value, foreign.Format.DEEPSPEED.value,
                 foreign.Format.DCP.value}


def _exportable(verdict: Verdict) -> Verdict:
    if verdict.format in _NOT_EXPORTED:
        raise UsageError(f"{safe(verdict.path.name)} is a {verdict.format} save, which rtrain "
                         "resumes from but does not export: export it with its library")
    return verdict


def _hf_weights(verdict: Verdict) -> list[str]:
    try:
        return hf_trainer.weight_files(verdict.path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{safe(verdict.path.name)}: "
                              f"{safe(getattr(e, 'strerror', None) or str(e))}") from None


def _source_mode(verdict: Verdict, weights: list[str] | None) -> int:
    """The permission bits of the file the weights come from (as cp keeps them): a private
    checkpoint gives a private export."""
    src = verdict.path
    if verdict.format == foreign.Format.RTRAIN.value:
        src = src / "model.safetensors"
    elif weights:
        src = src / weights[0]
    try:
        return os.stat(src).st_mode & 0o666
    except OSError:
        return 0o600


# ---------------------------------------------------------------- the output

def _check_out_place(out: Path, force: bool) -> None:
    if out.is_dir():
        raise UsageError(f"{safe(str(out))} is a directory: name the file to write, e.g. "
                         f"{safe(str(out / 'model.safetensors'))}")
    if not out.parent.is_dir():
        raise UsageError(f"no directory {safe(str(out.parent))} to write {safe(out.name)} in")
    if os.path.lexists(out) and not force:
        raise UsageError(f"{safe(str(out))} exists: pass --force to replace it")


def _check_out_apart(out: Path, source: Path) -> None:
    """OUT must not replace or join a checkpoint: not inside the checkpoint, and beside it
    not under a name a launch would list as a checkpoint (it would resume from the export)."""
    real_out = out.parent.resolve() / out.name
    real_src = source.resolve()
    if real_out == real_src or real_src in real_out.parents:
        raise UsageError(f"{safe(str(out))} is inside the checkpoint {safe(source.name)}: "
                         "write the export elsewhere")
    if real_out.parent == real_src.parent and (
            out.name.endswith(foreign.FILE_SUFFIXES) or parse_step(out.name) is not None):
        raise UsageError(f"{safe(str(out))} would sit beside {safe(source.name)} in its "
                         "checkpoint directory, where a launch would take it for a checkpoint:"
                         " write it elsewhere")


def _publish(tmp: Path, out: Path, force: bool, mode: int) -> None:
    try:
        os.chmod(tmp, mode)
        if force:
            os.replace(tmp, out)
        else:
            try:
                os.link(tmp, out)  # never replaces: fails if OUT appeared since the check
            except FileExistsError:
                raise UsageError(f"{safe(str(out))} exists: pass --force to replace it"
                                 ) from None
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                if os.path.lexists(out):  # no hard links here: check, then rename
                    raise UsageError(f"{safe(str(out))} exists: pass --force to replace it"
                                     ) from None
                os.rename(tmp, out)
        dfd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except UsageError:
        raise
    except OSError as e:
        raise UsageError(f"cannot write {safe(str(out))}: {e.strerror or e}") from None


def _copy(verdict: Verdict, how: Plan, tmp: Path, key: bytes | None) -> int:
    """safetensors from rtrain's or a Trainer's safetensors files, torch-free."""
    from rtrain.checkpoint import st_concat
    from rtrain.checkpoint.verified_read import LoadError, open_listed, read_listed

    root, name = verdict.path, safe(verdict.path.name)
    metadata = dict(METADATA)
    try:
        if verdict.format == foreign.Format.RTRAIN.value:
            m = verdict.manifest or {}
            enc = crypt.load_encryption_key()
            problem = crypt.key_problem(m, enc)
            if problem is not None:
                raise CheckpointError(f"{name}: {problem}")
            alg = hashing.manifest_alg(m, key)
            if how.optimizer_meta:
                state = json.loads(read_listed(root, "state.json", m, alg, enc=enc))
                if not isinstance(state, dict) or "optimizer" not in state:
                    raise CheckpointError(f"{name}: holds no optimizer state to export: "
                                          "leave out --optimizer")
                metadata["optimizer"] = json.dumps(state["optimizer"], separators=(",", ":"))
            parts = [st_concat.Part(f"{name}/{f}", _opener(open_listed, root, f, m, alg, enc),
                                    prefix) for f, prefix in how.files]
        else:
            parts = [st_concat.Part(f"{name}/{f}", _opener(_plain, root / f), prefix)
                     for f, prefix in how.files]
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise UsageError(f"cannot write beside {safe(str(tmp.parent))}: "
                             f"{e.strerror or e}") from None
        try:
            return st_concat.concat(parts, fd, metadata).tensors
        finally:
            os.close(fd)
    except (LoadError, ValueError, crypt.CryptError, hashing.HashAlgError) as e:
        raise CheckpointError(f"{name}: cannot export: {safe(str(e))}") from None
    except OSError as e:
        raise CheckpointError(f"{name}: cannot read: {e.strerror or e}") from None


def _opener(fn: Any, *args: Any) -> Any:
    return lambda: fn(*args)


def _plain(path: Path) -> Any:
    from rtrain.checkpoint.st_concat import PlainFile
    from rtrain.checkpoint.verify import check_member_name

    return PlainFile(check_member_name(path.parent, path.name))


# ---------------------------------------------------------------- the torch side

def run_worker(request: dict[str, Any]) -> dict[str, Any]:
    """Run `rtrain.worker.export.convert` with the same interpreter, isolated (core/
    isolated.py: not a module of the working directory, nor of PYTHONPATH, is imported); its
    one JSON line, or the error it reports (exit code kept)."""
    proc = subprocess.run(isolated.module_argv("rtrain.worker.export.convert",
                                               json.dumps(request)),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          check=False)
    result = _last_json(proc.stdout)
    if result is not None and result.get("ok") is True:
        return result
    if result is not None:
        reason = safe(str(result.get("reason", "refused")))
        if result.get("exit") == ExitCode.USAGE:
            raise UsageError(reason)
        raise CheckpointError(reason)
    if "No module named 'torch'" in proc.stderr:
        raise UsageError(f"this export needs torch, which {safe(sys.executable)} cannot "
                         "import: install torch beside rtrain (safetensors from rtrain's "
                         "format needs none; PYTHONPATH is not read by rtrain's helpers)")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    raise RtrainError(f"the export process failed (exit {proc.returncode}): "
                      f"{safe(lines[-1] if lines else 'no output')}")


def _last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "ok" in obj:
            return obj
    return None


# ---------------------------------------------------------------- output text

def render(e: Exported) -> str:
    from rtrain.supervisor.commands.inspect_render import human_size

    v = e.verdict
    lines = []
    if e.selection is not None:
        for s in e.selection.skipped:
            lines.append(f"skipped {safe(s.path.name)}: {safe(s.describe())}")
        lines.append(f"picked {safe(v.path.name)}: the newest checkpoint that verifies")
    step = f"step {v.step}" if v.step is not None and v.step >= 0 else "step unknown"
    what = "model weights and optimizer state" if e.optimizer else "model weights"
    lines.append(f"exported the {what} of {safe(v.path.name)} ({v.format or 'rtrain'}, {step}, "
                 "verified full)")
    lines += [f"note: {safe(n)}" for n in e.notes]
    lines.append(f"wrote {safe(str(e.out))} ({e.format}, {e.tensors} tensors, "
                 f"{human_size(e.size)})")
    return "\n".join(lines)
