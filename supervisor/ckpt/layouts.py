"""Foreign checkpoint directories of known layouts, each one save, verified as a whole.

A save of these libraries is a directory of several files; resuming needs all of them, so a
directory is one checkpoint and the files in it are never checkpoints of their own:

- **accelerate** `save_state` (`step_N/`, `epoch_N/`, `checkpoints/checkpoint_N/` with automatic
  naming): the model (`model.safetensors`, `pytorch_model.bin`, `model_1.safetensors`, ... for
  more models), `optimizer.bin`, `scheduler.bin`, then `random_states_<rank>.pkl`, written after
  the model and optimizer (so a directory without `random_states_0.pkl` is a save cut short).
- **DeepSpeed** `save_checkpoint` (`global_stepN/` holding `mp_rank_00_model_states.pt` and the
  ZeRO optimizer shards), and the `latest` file beside them naming the newest tag: DeepSpeed
  writes it after the tag's files, so it is the commit record. A tag dir newer than the one
  `latest` names is a save that did not finish; a `latest` that names anything but a tag dir
  beside it (`../../etc`, an absolute path, a link) is refused, and each dir is judged alone.
- **DCP** (`torch.distributed.checkpoint`, torchtitan's `step-N/`): `.metadata`, written last,
  and the `*.distcp` data files.

Every file is checked without executing anything: torch.save files (`.bin`, `.pt`, `.pkl`) as
`torchzip` does (zip structure, CRCs at full, the pickle walked, never loaded), safetensors
headers against sizes, DCP's `.metadata` pickle walked. Hugging Face Trainer dirs are
`hf_trainer`'s; this module reuses its per-file report.
"""

from __future__ import annotations

import enum
import os
import re
import stat
from pathlib import Path

from rtrain.checkpoint import safeio
from rtrain.supervisor.ckpt import hf_trainer, pickle_scan
from rtrain.supervisor.ckpt.hf_trainer import FileResult, Report


class Layout(str, enum.Enum):
    ACCELERATE = "accelerate"
    DEEPSPEED = "deepspeed"
    DCP = "dcp"


# The names these libraries give a save. No leading zeros, as for rtrain's own names.
_N = r"(0|[1-9]\d*)"
_DIR_NAMES = re.compile(rf"^(?:(?:step|epoch|checkpoint)_{_N}|global_step{_N}|step-{_N})$")
LATEST = "latest"
DCP_METADATA = ".metadata"
_RANDOM_STATES = re.compile(r"^random_states_\d+\.pkl$")
# save_state names the first model's and optimizer's files plainly, the others `_<i>`; a
# sharded model has an index.
_ACCELERATE_WEIGHTS = re.compile(r"^(?:model(?:_\d+)?\.safetensors|pytorch_model(?:_\d+)?\.bin|"
                                 r"model\.safetensors\.index\.json|"
                                 r"pytorch_model\.bin\.index\.json)$")
_ACCELERATE_OPTIMIZER = re.compile(r"^optimizer(?:_\d+)?\.bin$")
# A `latest` file holds a tag of a few dozen bytes; anything larger is not DeepSpeed's.
_MAX_LATEST = 4096
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# DCP's .metadata is a pickle of the tensors' chunk table: large for a big model, bounded here
# as torchzip bounds a data.pkl.
_MAX_METADATA = 256 << 20
_TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")


def dir_step(name: str) -> int | None:
    """The step a save directory's name states (`step_40`, `epoch_2`, `global_step40`,
    `step-40`, `checkpoint_3`), if it has a layout's name."""
    m = _DIR_NAMES.match(name)
    if m is None:
        return None
    return int(next(g for g in m.groups() if g is not None))


def _names(path: Path) -> set[str]:
    try:
        with os.scandir(path) as entries:
            return {e.name for e in entries}
    except OSError:
        return set()


def layout_of(path: Path) -> Layout | None:
    """Which layout a directory without rtrain's manifest.json is a save of, by its files and
    name; None when it is none of them (a Trainer's is `hf_trainer.looks_like`)."""
    if not path.is_dir() or path.is_symlink():
        return None
    names = _names(path)
    if DCP_METADATA in names or any(n.endswith(".distcp") for n in names):
        return Layout.DCP
    if path.name.startswith("global_step") or any(n.endswith("model_states.pt") for n in names):
        return Layout.DEEPSPEED
    if names & {hf_trainer.TRAINER_STATE, "training_args.bin"}:
        return None  # a Trainer's, whatever it is named
    if (dir_step(path.name) is not None or "optimizer.bin" in names
            or any(_RANDOM_STATES.match(n) for n in names)):
        return Layout.ACCELERATE
    return None


# ------------------------------------------------------------------ DeepSpeed's `latest`


def read_latest(root: Path) -> tuple[str | None, str]:
    """DeepSpeed's `latest` in `root`: (the tag it names, "") or (None, why it is refused);
    (None, "") when there is none."""
    path = root / LATEST
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, ""
    except OSError as e:
        return None, f"{LATEST!r} cannot be read ({e.strerror or e})"
    if not stat.S_ISREG(st.st_mode):
        return None, f"{LATEST!r} is not a regular file (a link or a FIFO): refused"
    if st.st_size > _MAX_LATEST:
        return None, f"{LATEST!r} is {st.st_size} bytes, not a tag: refused"
    try:
        raw = safeio.read_limited(path, _MAX_LATEST)
        tag = raw.decode("utf-8").strip()
    except (OSError, ValueError) as e:
        return None, f"{LATEST!r} cannot be read ({getattr(e, 'strerror', None) or e})"
    if not tag:
        return None, f"{LATEST!r} is empty (a save cut short while writing it)"
    if not _TAG.match(tag) or tag in (".", ".."):
        return None, (f"{LATEST!r} names {tag[:80]!r}, not a checkpoint dir beside it "
                      "(outside the checkpoint dir): refused, never followed")
    target = root / tag
    if target.is_symlink() or not target.is_dir():
        return None, f"{LATEST!r} names {tag!r}, which is not a directory here"
    return tag, ""


# ------------------------------------------------------------------ checking a save


def _check_file(root: Path, name: str, report: Report, full: bool) -> None:
    if name.endswith(".safetensors"):
        hf_trainer.check_safetensors(root, name, report)
    elif name.endswith(".json"):
        hf_trainer.load_json(root, name, report)
    elif name.endswith(_TORCH_SUFFIXES):
        hf_trainer.check_torch(root, name, report, full)


def _files(root: Path, report: Report) -> list[str] | None:
    try:
        with os.scandir(root) as entries:
            # Links are checked by name: check_member_name refuses one that leads out.
            return sorted(e.name for e in entries
                          if not e.name.startswith(".") and not e.is_dir(follow_symlinks=False))
    except OSError as e:
        report.fail(f"cannot read: {e.strerror or e}")
        return None


def _check_accelerate(root: Path, names: list[str], report: Report, full: bool) -> None:
    if not any(_ACCELERATE_WEIGHTS.match(n) for n in names):
        report.files.append(FileResult("model.safetensors", None, "missing"))
        report.fail("no model weights (model.safetensors or pytorch_model.bin): not a "
                    "complete save_state", incomplete=True)
    if not any(_ACCELERATE_OPTIMIZER.match(n) for n in names):
        report.files.append(FileResult("optimizer.bin", None, "missing"))
        report.fail("file 'optimizer.bin' is missing")
    if not any(_RANDOM_STATES.match(n) for n in names):
        report.files.append(FileResult("random_states_0.pkl", None, "missing"))
        # save_state writes the random states after the model and optimizer.
        report.fail("file 'random_states_0.pkl' is missing: a save cut short", incomplete=True)
    for name in names:
        _check_file(root, name, report, full)


def _check_deepspeed(root: Path, names: list[str], report: Report, full: bool) -> None:
    if not any(n.endswith("model_states.pt") for n in names):
        report.files.append(FileResult("mp_rank_00_model_states.pt", None, "missing"))
        report.fail("no *model_states.pt: not a complete DeepSpeed save", incomplete=True)
    for name in names:
        _check_file(root, name, report, full)
    tag, why = read_latest(root.parent)
    mine, theirs = dir_step(root.name), None if tag is None else dir_step(tag)
    if mine is not None and theirs is not None and mine > theirs:
        report.fail(f"newer than {tag!r}, which {LATEST!r} names: a save that did not "
                    "finish (DeepSpeed writes latest last)", incomplete=True)
    elif why:
        report.info["note"] = f"{LATEST!r} refused: this dir checked alone"


def _check_dcp(root: Path, names: list[str], report: Report, full: bool) -> None:
    data = [n for n in names if n.endswith(".distcp")]
    meta = root / DCP_METADATA
    try:
        raw = safeio.read_limited(meta, _MAX_METADATA)
    except FileNotFoundError:
        report.files.append(FileResult(DCP_METADATA, None, "missing"))
        report.fail(f"no {DCP_METADATA} (DCP writes it last): a save cut short",
                    incomplete=True)
        raw = None
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        report.files.append(FileResult(DCP_METADATA, None, why))
        report.fail(f"file {DCP_METADATA!r}: {why}")
        raw = None
    if raw is not None:
        try:
            pickle_scan.scan(raw, what=DCP_METADATA)
            report.files.append(FileResult(DCP_METADATA, len(raw), "ok"))
        except pickle_scan.PickleRefused as e:
            report.files.append(FileResult(DCP_METADATA, len(raw), str(e)))
            report.fail(str(e))
    if not data:
        report.fail("no *.distcp data files", incomplete=True)
    for name in data:
        try:
            st = safeio.check_regular(root / name, follow_symlinks=False)
        except (OSError, ValueError) as e:
            why = getattr(e, "strerror", None) or str(e)
            report.files.append(FileResult(name, None, why))
            report.fail(f"file {name!r}: {why}")
            continue
        if st.st_size == 0:
            report.files.append(FileResult(name, 0, "empty"))
            report.fail(f"file {name!r} is empty")
        else:
            report.files.append(FileResult(name, st.st_size, "ok"))
    for name in names:
        if not name.endswith(".distcp"):
            _check_file(root, name, report, full)


_CHECKS = {Layout.ACCELERATE: _check_accelerate, Layout.DEEPSPEED: _check_deepspeed,
           Layout.DCP: _check_dcp}


def check(path: str | os.PathLike, layout: Layout, *, full: bool) -> Report:
    """Check every file of one save; the first failure is the report's problem."""
    root = Path(path)
    report = Report()
    names = _files(root, report)
    if names is None:
        return report
    _CHECKS[layout](root, names, report, full)
    report.step = dir_step(root.name)
    try:
        report.info.setdefault("created", max(
            (os.lstat(root / n).st_mtime for n in names), default=os.lstat(root).st_mtime))
    except OSError:
        pass
    report.info["step"] = report.step
    return report
