"""An unchanged script that keeps one `ckpt.pt` and rewrites it in place (children/inplace_ckpt.py)
under `rtrain launch --ckpt-dir out --resume-arg --init_from=resume`, with real kills: progress
is read from the file's content (its `iter_num`, its changed bytes), so default restart settings
see every kill after a save as progress; a kill mid-write, a malicious pickle or a directory in
its place is refused and rtrain's copy of the last verified content is put back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from harness import CHILDREN, events
from harness import launch as launch_run

SCRIPT = str(CHILDREN / "inplace_ckpt.py")


def run_inplace(tmp_path: Path, faults: str, max_iters: int, *extra: str,
                timeout: float = 120, extra_script: tuple[str, ...] = (),
                resume_arg: str = "--init_from=resume"):
    out = tmp_path / "out"
    r = launch_run(tmp_path / "run", "--ckpt-dir", str(out), "--resume-arg",
                   resume_arg, *extra, SCRIPT, "--", "--out_dir", str(out),
                   "--max_iters", str(max_iters), "--faults", faults, *extra_script,
                   timeout=timeout)
    starts = [int(s) for s in (out / "starts.txt").read_text().split()]
    return r, out, starts


@pytest.mark.slow
def test_killed_after_progress_four_times_finishes_on_default_settings(tmp_path):
    # Before content counted, the third kill ended the run: "crash loop: 3 consecutive
    # attempts ended without a newer verified checkpoint (newest: none (no checkpoint yet))".
    r, out, starts = run_inplace(tmp_path, "5:kill,10:kill,15:kill,20:kill", 25)
    assert r.returncode == 0, r.stderr
    assert (out / "done.json").exists()
    assert starts == [0, 5, 10, 15, 20]  # each attempt from the content the last one saved
    assert not events(tmp_path / "run", "give_up")
    launches = events(tmp_path / "run", "launch")
    assert [Path(e["resume_from"]).name if e["resume_from"] else None for e in launches] == [
        None, "ckpt.pt", "ckpt.pt", "ckpt.pt", "ckpt.pt"]


@pytest.mark.slow
@pytest.mark.soak  # progress by content is the default tier's with ckpt.pt
def test_lightning_last_ckpt_killed_after_progress_finishes_on_default_settings(tmp_path):
    # Lightning's last.ckpt, rewritten in place: its global_step is read from the pickle and
    # each new content is progress, so three kills (the crash-loop threshold) do not end it.
    r, out, starts = run_inplace(tmp_path, "5:kill,10:kill,15:kill", 20, extra_script=(
        "--lightning",))
    assert r.returncode == 0, r.stderr
    assert (out / "done.json").exists() and starts == [0, 5, 10, 15]
    launches = events(tmp_path / "run", "launch")
    assert [Path(e["resume_from"]).name if e["resume_from"] else None for e in launches] == [
        None, "last.ckpt", "last.ckpt", "last.ckpt"]


@pytest.mark.soak
def test_killed_twenty_times_at_random_moments_finishes(tmp_path):
    rng = random.Random(22)
    iters = sorted(rng.sample(range(5, 200, 5), 20))
    r, _, starts = run_inplace(tmp_path, ",".join(f"{i}:kill" for i in iters), 205,
                                 timeout=600)
    assert r.returncode == 0, r.stderr
    assert starts == [0, *iters]
    assert not events(tmp_path / "run", "give_up")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ckpt.pt",
                                  pytest.param("checkpoint.pth.tar", marks=pytest.mark.soak)])
def test_killed_mid_write_resumes_from_the_kept_copy_never_from_scratch(tmp_path, name):
    # iter 10's save is cut at 0 bytes, iter 20's half way: each relaunch restores the copy
    # rtrain took of the content before (iters 5 and 15) and the script resumes from it.
    # checkpoint.pth.tar: imagenet's main.py, handed the file by --resume (its model_best copy
    # of iter 5 is never a resume point).
    imagenet = name == "checkpoint.pth.tar"
    r, _, starts = run_inplace(
        tmp_path, "10:empty,20:half", 25, extra_script=("--imagenet",) if imagenet else (),
        resume_arg="--resume {checkpoint}" if imagenet else "--init_from=resume")
    assert r.returncode == 0, r.stderr
    assert starts == [0, 5, 15]
    restored = events(tmp_path / "run", "foreign_restored")
    assert [(Path(e["path"]).name, e["step"]) for e in restored] == [(name, 5), (name, 15)]
    assert restored[0]["reason"] == "empty file"
    assert "truncated" in restored[1]["reason"]
    assert f"{name} was torn (empty file); restored rtrain's copy of the content verified " \
           "at " in r.stderr
    assert f"(from {name}, restored from rtrain's copy)" in r.stderr
    kept = events(tmp_path / "run", "foreign_copy_kept")
    assert kept and all(e["bytes"] > 0 for e in kept)
    assert (tmp_path / "run" / "foreign-copy" / name).is_file()
    launches = events(tmp_path / "run", "launch")
    assert [Path(e["resume_from"]).name for e in launches[1:]] == [name, name]


@pytest.mark.slow
def test_malicious_pickle_and_directory_refused_never_run_copy_restored(tmp_path):
    r, out, starts = run_inplace(tmp_path, "10:evil,20:dir", 25)
    assert r.returncode == 0, r.stderr
    assert starts == [0, 5, 15]
    assert not (out / "pwned").exists()  # neither rtrain nor the script ran the reduce
    reasons = [e["reason"] for e in events(tmp_path / "run", "foreign_restored")]
    assert len(reasons) == 2
    assert "the pickle calls posix.system" in reasons[0]
    assert reasons[1] == "a directory where a file was expected"
    assert "ckpt.pt was refused (" in r.stderr
    assert [p.name for p in out.iterdir() if p.name.startswith(".ckpt.pt.refused-")]
