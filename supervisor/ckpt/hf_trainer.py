"""Hugging Face Trainer checkpoints (`<output_dir>/checkpoint-<N>/`), checked without unpickling.

The Trainer writes, in this order: the model (`model.safetensors`, shards
`model-0000x-of-0000y.safetensors` with `model.safetensors.index.json`, `pytorch_model.bin`, or a
PEFT `adapter_model.*`), `training_args.bin`, `optimizer.pt` + `scheduler.pt` (+ `scaler.pt`),
`rng_state*.pth`, and last `trainer_state.json`. A directory without `trainer_state.json` is
therefore a save that did not finish. rtrain's own checkpoints share the name `checkpoint-<N>`;
they hold `manifest.json` instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtrain.checkpoint import safeio, safetensors_io
from rtrain.checkpoint.verify import check_member_name
from rtrain.supervisor.ckpt import torchzip

TRAINER_STATE = "trainer_state.json"
SAFE_WEIGHTS = ("model.safetensors", "adapter_model.safetensors")
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = ("pytorch_model.bin", "adapter_model.bin")
BIN_INDEX = "pytorch_model.bin.index.json"
# Files only a Trainer writes: enough to call a directory without trainer_state.json an
# unfinished Trainer save rather than an unfinished rtrain one.
MARKERS = (TRAINER_STATE, "training_args.bin", "config.json", "adapter_config.json",
           *SAFE_WEIGHTS, SAFE_INDEX, *BIN_WEIGHTS, BIN_INDEX)
# trainer_state.json grows with log_history (a line per logging step); a long run's is a few MiB.
MAX_JSON = 64 << 20


@dataclass
class FileResult:
    name: str
    size: int | None
    status: str  # "ok", "missing", or why it fails
    note: str = ""


@dataclass
class Report:
    """Per-file results of one Trainer checkpoint; the first failure is the verdict's reason."""

    files: list[FileResult] = field(default_factory=list)
    step: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    problem: str = ""  # an empty string when everything checked passed
    incomplete: bool = False

    def fail(self, reason: str, *, incomplete: bool = False) -> None:
        if not self.problem:
            self.problem, self.incomplete = reason, incomplete


def looks_like(path: Path) -> bool:
    """Whether a directory without manifest.json holds any file only a Trainer writes."""
    return any((path / name).exists() for name in MARKERS)


def _size(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _check_safetensors(root: Path, name: str, report: Report) -> dict[str, Any] | None:
    try:
        header = safetensors_io.read_header(check_member_name(root, name))
    except FileNotFoundError:
        report.files.append(FileResult(name, None, "missing"))
        report.fail(f"file {name!r} is missing")
        return None
    except (OSError, ValueError) as e:
        why = (getattr(e, "strerror", None) or str(e)).removeprefix("is ")
        report.files.append(FileResult(name, _size(root / name), why))
        report.fail(f"file {name!r}: {why}")
        return None
    report.files.append(FileResult(name, _size(root / name), "ok"))
    return header


def _check_torch(root: Path, name: str, report: Report, full: bool) -> None:
    # training_args.bin pickles the script's TrainingArguments (transformers', TRL's, the
    # user's own subclass): the Trainer never loads it to resume, so its classes are not judged
    # by the allow-list (its structure and size are). Every file a resume loads is.
    any_global = name == "training_args.bin"
    try:
        note = torchzip.check(check_member_name(root, name), full=full, any_global=any_global)
    except FileNotFoundError:
        report.files.append(FileResult(name, None, "missing"))
        report.fail(f"file {name!r} is missing")
        return
    except (OSError, ValueError) as e:
        why = (getattr(e, "strerror", None) or str(e)).removeprefix("is ")
        report.files.append(FileResult(name, _size(root / name), why))
        report.fail(f"file {name!r}: {why}")
        return
    report.files.append(FileResult(name, _size(root / name), "ok", note))


def _load_json(root: Path, name: str, report: Report) -> Any:
    path = root / name
    try:
        obj = safeio.parse_json(safeio.read_limited(check_member_name(root, name), MAX_JSON,
                                                    follow_symlinks=True))
    except FileNotFoundError:
        report.files.append(FileResult(name, None, "missing"))
        return None
    except (OSError, ValueError) as e:  # ManifestError (a link leading out) is a ValueError
        why = (str(e) if isinstance(e, ValueError) else str(e.strerror or e)).removeprefix("is ")
        report.files.append(FileResult(name, _size(path), why))
        report.fail(f"file {name!r}: {why}")
        return None
    report.files.append(FileResult(name, _size(path), "ok"))
    return obj


def _check_index(root: Path, index_name: str, report: Report, full: bool) -> None:
    """Sharded weights: the index parses and every shard it names is there and sound."""
    index = _load_json(root, index_name, report)
    if index is None:
        return
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                   for v in weight_map.values()):
        report.fail(f"file {index_name!r}: no weight_map of tensor -> shard file")
        return
    for shard in sorted(set(weight_map.values())):
        if "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            report.fail(f"file {index_name!r} names shard {shard!r} outside the checkpoint")
            return
        if shard.endswith(".safetensors"):
            header = _check_safetensors(root, shard, report)
            if header is None:
                continue
            expected = {t for t, s in weight_map.items() if s == shard}
            absent = sorted(expected - header.keys())
            if absent:
                report.fail(f"shard {shard!r} lacks tensors the index puts there: "
                            f"{', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''}")
        else:
            _check_torch(root, shard, report, full)


def _engine_dirs(root: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(root) if e.is_dir()
                      and (e.name.startswith("global_step") or "fsdp" in e.name))
    except OSError:
        return []


def _check_weights(root: Path, names: set[str], report: Report, full: bool) -> None:
    if SAFE_INDEX in names:
        _check_index(root, SAFE_INDEX, report, full)
    elif BIN_INDEX in names:
        _check_index(root, BIN_INDEX, report, full)
    else:
        found = [n for n in (*SAFE_WEIGHTS, *BIN_WEIGHTS) if n in names]
        if not found and _engine_dirs(root):
            # DeepSpeed (global_step*/) and FSDP (*fsdp*/) keep weights in their own layout,
            # which rtrain does not read: pass with a note rather than reject a sound save.
            report.info["note"] = f"weights in {', '.join(_engine_dirs(root))}/: not checked"
        elif not found:
            report.fail("no model weights (model.safetensors, a sharded index, "
                        "pytorch_model.bin or adapter_model.*)")
        for name in found:
            if name.endswith(".safetensors"):
                _check_safetensors(root, name, report)
            else:
                _check_torch(root, name, report, full)


def _read_state(root: Path, report: Report, dir_step: int | None) -> None:
    state = _load_json(root, TRAINER_STATE, report)
    if state is None:
        if not report.problem:
            report.fail(f"no {TRAINER_STATE}: a Trainer save that did not finish",
                        incomplete=True)
        return
    step = state.get("global_step") if isinstance(state, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        report.fail(f"{TRAINER_STATE} has no global_step")
        return
    if dir_step is not None and step != dir_step:
        report.fail(f"{TRAINER_STATE} says global_step {step} but the directory is "
                    f"checkpoint-{dir_step}")
        return
    report.step = step
    history = state.get("log_history")
    losses = [e for e in (history if isinstance(history, list) else [])
              if isinstance(e, dict) and "loss" in e]
    metrics = {"loss": losses[-1]["loss"]} if losses else {}
    if isinstance(state.get("best_metric"), (int, float)):
        metrics["best_metric"] = state["best_metric"]
    settings = {k: state[k] for k in ("train_batch_size", "max_steps", "num_train_epochs")
                if k in state}
    report.info = {"step": step, "epoch": state.get("epoch"), "metrics": metrics,
                   "settings": settings, "created": os.stat(root / TRAINER_STATE).st_mtime}


def check(path: str | os.PathLike, *, full: bool, dir_step: int | None = None) -> Report:
    """Check every file of one Trainer checkpoint; the report lists each with its state."""
    root = Path(path)
    report = Report()
    try:
        names = {e.name for e in os.scandir(root) if e.is_file()}
    except OSError as e:
        report.fail(f"cannot read: {e.strerror or e}")
        return report
    _read_state(root, report, dir_step)
    _check_weights(root, names, report, full)
    has_opt, has_sched = "optimizer.pt" in names, "scheduler.pt" in names
    if has_opt != has_sched and not _engine_dirs(root):  # DeepSpeed keeps its optimizer inside
        # Both or neither (save_only_model): one alone is a save cut short or a file removed.
        missing = "scheduler.pt" if has_opt else "optimizer.pt"
        report.files.append(FileResult(missing, None, "missing"))
        report.fail(f"file {missing!r} is missing")
    others = sorted(n for n in names if n.endswith((".pt", ".pth")) or n == "training_args.bin")
    for name in others:
        _check_torch(root, name, report, full)
    for name in sorted(n for n in names if n.endswith(".json")
                       and n not in (TRAINER_STATE, SAFE_INDEX, BIN_INDEX)):
        _load_json(root, name, report)  # config.json and the like: parseable
    if not has_opt and not _engine_dirs(root):
        report.info["note"] = "model only (no optimizer.pt): optimizer state starts fresh"
    return report


def weight_files(path: str | os.PathLike) -> list[str]:
    """The files that hold a (checked) Trainer checkpoint's model weights, as `check` chose
    them: the shards a sharded index names, else the single weights file, safetensors first.
    Empty when there are none (DeepSpeed or FSDP layouts). Raises ValueError or OSError for an
    index that cannot be read."""
    root = Path(path)
    for index in (SAFE_INDEX, BIN_INDEX):
        if (root / index).exists():
            obj = safeio.parse_json(safeio.read_limited(check_member_name(root, index),
                                                        MAX_JSON, follow_symlinks=True))
            weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map")
            return sorted(set(map(str, weight_map.values())))
    return [n for n in (*SAFE_WEIGHTS, *BIN_WEIGHTS) if (root / n).is_file()][:1]


# The same per-file checks and report rows for the other directory layouts (layouts.py).
check_safetensors = _check_safetensors
check_torch = _check_torch
load_json = _load_json
