"""Foreign checkpoints recognised by content and layout (ckpt/foreign.py, ckpt/layouts.py), on
files written in each trainer's own way (children/layouts_train.py's writers; accelerate's
save_state itself): one candidate per save, its step, resume's pick, and the bad input refused
with a one-line reason, never run, the save before used. No process is started."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import posix
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from harness import CHILDREN

from rtrain.checkpoint.verify import Level, Status
from rtrain.supervisor.ckpt import foreign
from rtrain.supervisor.commands import inspecting

sys.path.insert(0, str(CHILDREN))
import layouts_train as W  # the layouts' writers, shared with the end-to-end test

HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None


class Evil:
    # posix.system, os.system's own: conftest's guard replaces os.system in fast tests.
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (posix.system, (f"touch '{self.marker}'",))


def evil_zip(path: Path, marker: Path) -> None:
    """torch.save's layout, a pickle whose load would run a command."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"epoch": 99, "x": Evil(str(marker))},
                                                    protocol=2))
        z.writestr("archive/version", "3\n")


def accelerate_save(out: Path, step: int) -> Path:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model, opt = W.model_and_opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.save_state(str(out / f"step_{step}"))
    return out / f"step_{step}"


def write(layout: str, out: Path, saves: int = 3) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model, opt = W.model_and_opt()
    for e in range(1, saves + 1):
        if layout == "imagenet":
            W.save_imagenet(str(out), e, model, opt, is_best=e == 1)
        elif layout == "timm":
            W.save_timm(str(out), e, model, opt, metric=1.0 / e)
        elif layout == "deepspeed":
            W.save_deepspeed(str(out), e, model, opt)
        elif layout == "composer":
            W.save_composer(str(out), e, e * 3, model, opt)
        elif layout == "dcp":
            W.save_dcp(str(out), e, model, opt)
        elif layout == "accelerate":
            accelerate_save(out, e)


# layout -> (the listing, newest first: (name, step)), and resume's pick is the first.
LISTINGS = {
    # model_best.pth.tar is a copy of an older save: an export, never listed.
    "imagenet": [("checkpoint.pth.tar", 4)],
    # last.pth.tar and model_best.pth.tar are hard links of checkpoint-3.pth.tar: one save.
    "timm": [("checkpoint-3.pth.tar", 3), ("checkpoint-2.pth.tar", 2)],
    "deepspeed": [("global_step3", 3), ("global_step2", 2), ("global_step1", 1)],
    # latest-rank0.pt, a link to the newest, is not a save of its own.
    "composer": [("ep3-ba9-rank0.pt", 9), ("ep2-ba6-rank0.pt", 6), ("ep1-ba3-rank0.pt", 3)],
    "dcp": [("step-3", 3), ("step-2", 2), ("step-1", 1)],
    "accelerate": [("step_3", 3), ("step_2", 2), ("step_1", 1)],
}


@pytest.mark.parametrize("layout", list(LISTINGS))
def test_one_candidate_per_save_with_its_step_and_the_pick(layout, tmp_path, rtrain):
    if layout == "accelerate" and not HAS_ACCELERATE:
        pytest.skip("accelerate not installed (pip install -e '.[dev]')")
    out = tmp_path / "out"
    write(layout, out)
    verdicts = foreign.verify_all(out, Level.FULL)
    assert [(v.path.name, v.step) for v in verdicts] == LISTINGS[layout]
    assert all(v.ok for v in verdicts), [v.describe() for v in verdicts]
    assert foreign.select_resume_any_format(out).chosen.path.name == LISTINGS[layout][0][0]
    r = rtrain("inspect", str(out))
    assert r.returncode == 0, r.stderr
    assert f"{len(LISTINGS[layout])} checkpoint" in r.stdout.splitlines()[0]
    assert f"resume would pick {LISTINGS[layout][0][0]} " in r.stdout
    listing = json.loads(rtrain("inspect", str(out), "--json").stdout)
    assert [(c["name"], c["step"], c["resume"], c["status"]) for c in listing["checkpoints"]] \
        == [(n, s, i == 0, "ok") for i, (n, s) in enumerate(LISTINGS[layout])]


@pytest.mark.skipif(not HAS_ACCELERATE, reason="accelerate not installed (pip install -e '.[dev]')")
def test_inspect_of_one_accelerate_save_lists_its_files_not_loose_checkpoints(tmp_path, rtrain):
    step = accelerate_save(tmp_path, 80)
    r = rtrain("inspect", str(step))
    assert r.returncode == 0, r.stderr
    assert "format      accelerate" in r.stdout
    for name in ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        assert name in r.stdout
    assert "resume would pick" not in r.stdout


@pytest.mark.parametrize("name", ["checkpoint.pth.tar", "weights.tar", "ckpt", "state.model",
                                  "model.bin", "x.pth"])
@pytest.mark.parametrize("legacy", [False, True])
def test_a_torch_save_file_is_a_candidate_whatever_its_name(tmp_path, name, legacy):
    torch.save({"epoch": 7, "w": torch.zeros(2)}, tmp_path / name,
               _use_new_zipfile_serialization=not legacy)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "data.tar").write_bytes(b"ustar" * 100)  # a tarball: not torch.save's bytes
    (tmp_path / "vocab").write_bytes(b"PK\x03\x04" + b"\0" * 60)  # a zip without data.pkl
    (v,) = foreign.verify_all(tmp_path, Level.FULL)
    assert (v.path.name, v.step, v.ok) == (name, 7, True)


def test_best_copies_and_temp_saves_are_never_candidates(tmp_path):
    for name in ("model_best.pth.tar", "best.pt", "ckpt_best.pth", "tmp.pth.tar"):
        torch.save({"epoch": 9}, tmp_path / name)
    torch.save({"epoch": 3}, tmp_path / "checkpoint.pth.tar")
    torch.save({"epoch": 9}, tmp_path / "best-step=9.ckpt")  # states a step: a save
    assert [(v.path.name, v.step) for v in foreign.verify_all(tmp_path)] == [
        ("best-step=9.ckpt", 9), ("checkpoint.pth.tar", 3)]


@pytest.mark.parametrize("name, step", [
    ("checkpoint-12.pth.tar", 12), ("step_40.pt", 40), ("epoch_3.pt", None),
    ("global_step40", 40), ("model-1000.pt", 1000), ("ep2-ba60-rank0.pt", 60),
    ("epoch=3-step=400.ckpt", 400), ("iter_num=5.pt", None), ("checkpoint.pth.tar", None),
    ("last.pth.tar", None),
])
def test_step_from_the_name(name, step):
    # An epoch in a file's name is not its step (epoch=3.ckpt beside step=400.ckpt); the
    # epoch_N directories of accelerate count their saves by it (layouts.dir_step).
    assert foreign.step_from_name(name) == step


# ------------------------------------------------------------------ bad input


def test_a_pth_tar_that_would_run_code_is_refused_never_run_the_one_before_used(tmp_path):
    write("timm", tmp_path, saves=3)
    marker = tmp_path / "pwned"
    evil_zip(tmp_path / "checkpoint-4.pth.tar", marker)
    sel = foreign.select_resume_any_format(tmp_path)
    assert sel.chosen.path.name == "checkpoint-3.pth.tar"
    (skipped,) = sel.skipped
    assert skipped.path.name == "checkpoint-4.pth.tar" and skipped.status is Status.CORRUPT
    assert "the pickle calls posix.system when loaded" in skipped.reason
    assert "\n" not in skipped.reason and not marker.exists()


@pytest.mark.skipif(not HAS_ACCELERATE, reason="accelerate not installed (pip install -e '.[dev]')")
@pytest.mark.parametrize("damage, reason", [
    ("missing optimizer", "file 'optimizer.bin' is missing"),
    ("missing random states", "file 'random_states_0.pkl' is missing: a save cut short"),
    ("evil scheduler", "file 'scheduler.bin': data.pkl: the pickle calls posix.system"),
    ("cut model", "file 'model.safetensors'"),
])
def test_a_step_dir_with_a_file_missing_or_unsafe_is_refused_the_one_before_used(
        tmp_path, damage, reason):
    accelerate_save(tmp_path, 1)
    bad = accelerate_save(tmp_path, 2)
    marker = tmp_path / "pwned"
    if damage == "missing optimizer":
        (bad / "optimizer.bin").unlink()
    elif damage == "missing random states":
        (bad / "random_states_0.pkl").unlink()
    elif damage == "evil scheduler":
        evil_zip(bad / "scheduler.bin", marker)
    else:
        with open(bad / "model.safetensors", "r+b") as f:
            f.truncate(os.path.getsize(bad / "model.safetensors") // 2)
    sel = foreign.select_resume_any_format(tmp_path)
    assert sel.chosen.path.name == "step_1" and sel.chosen.format == "accelerate"
    (skipped,) = sel.skipped
    assert skipped.path.name == "step_2" and reason in skipped.reason
    assert "\n" not in skipped.reason and not marker.exists()


@pytest.mark.parametrize("content", ["../../etc", "/etc", "global_step2/../../..", ""])
def test_a_latest_naming_anything_outside_is_refused_never_followed(tmp_path, content):
    write("deepspeed", tmp_path / "ck", saves=2)
    (tmp_path / "etc").mkdir()
    (tmp_path / "ck" / "latest").write_text(content)
    sel = foreign.select_resume_any_format(tmp_path / "ck")
    assert sel.chosen.path.name == "global_step2"  # each dir judged alone
    (skipped,) = sel.skipped
    assert skipped.path.name == "latest" and skipped.status is Status.CORRUPT
    assert "refused" in skipped.reason or "empty" in skipped.reason
    assert "\n" not in skipped.reason


def test_a_deepspeed_tag_newer_than_latest_is_a_save_that_did_not_finish(tmp_path):
    write("deepspeed", tmp_path, saves=3)
    (tmp_path / "latest").write_text("global_step2")  # killed before latest was rewritten
    sel = foreign.select_resume_any_format(tmp_path)
    assert sel.chosen.path.name == "global_step2"
    (skipped,) = sel.skipped
    assert skipped.status is Status.INCOMPLETE and "did not finish" in skipped.reason


def test_a_dcp_save_without_metadata_is_incomplete(tmp_path):
    write("dcp", tmp_path, saves=2)
    (tmp_path / "step-2" / ".metadata").unlink()
    sel = foreign.select_resume_any_format(tmp_path)
    assert sel.chosen.path.name == "step-1"
    assert sel.skipped[0].status is Status.INCOMPLETE


def test_a_torn_checkpoint_pth_tar_is_listed_and_refused(tmp_path):
    write("imagenet", tmp_path, saves=1)
    (tmp_path / "checkpoint.pth.tar").write_bytes(b"")
    (v,) = foreign.verify_all(tmp_path)
    assert v.path.name == "checkpoint.pth.tar" and v.reason == "empty file"


def test_inspect_of_one_layout_dir_is_one_checkpoint(tmp_path):
    write("deepspeed", tmp_path, saves=1)
    assert inspecting.is_checkpoint_dir(tmp_path / "global_step1")
    assert not inspecting.is_checkpoint_dir(tmp_path)


def test_starting_over_sets_aside_every_save_and_deepspeeds_latest(tmp_path):
    from rtrain.supervisor.ckpt import setaside

    write("deepspeed", tmp_path, saves=2)
    torch.save({"epoch": 1}, tmp_path / "weights.tar")  # by content: no dirs list it now
    done = setaside.set_aside(tmp_path, 0.0)
    assert sorted(done.names) == ["global_step1", "global_step2", "latest", "weights.tar"]
    assert not foreign.list_candidates(tmp_path)


@pytest.mark.skipif(not HAS_ACCELERATE, reason="accelerate not installed (pip install -e '.[dev]')")
def test_accelerate_automatic_naming_saves_are_candidates(tmp_path):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    model, opt = W.model_and_opt()
    model, opt = acc.prepare(model, opt)
    acc.save_state()
    acc.save_state()
    sel = foreign.select_resume_any_format(tmp_path / "checkpoints")
    assert sel.chosen.path.name == "checkpoint_1" and sel.chosen.format == "accelerate"
    assert [v.path.name for v in foreign.verify_all(tmp_path / "checkpoints")] == [
        "checkpoint_1", "checkpoint_0"]


def test_export_of_a_layout_save_is_a_one_line_usage_error(tmp_path, rtrain):
    write("deepspeed", tmp_path / "ck", saves=1)
    for source in (tmp_path / "ck", tmp_path / "ck" / "global_step1"):
        r = rtrain("export", str(source), str(tmp_path / "w.safetensors"))
        assert r.returncode == 2
        assert "global_step1 is a deepspeed save, which rtrain resumes from but does not " \
               "export" in r.stderr
    assert not (tmp_path / "w.safetensors").exists()
