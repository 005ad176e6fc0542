"""Which checkpoint a relaunch resumes from, end to end with real processes (the bitwise
training script under `rtrain launch`):

- a newest checkpoint whose state.json was hand-edited (its hash recomputed, so it verifies)
  is passed over, by the launch's full verification or, under `verify = "quick"`, by the worker
  (a `bad_checkpoint` exit), and the run finishes from the checkpoint before;
- a run started over with `--resume never` where an earlier run left higher steps crashes and
  resumes from its own checkpoint, never the earlier run's;
- a newer checkpoint encrypted under another key is skipped with the reason; with no
  checkpoint the key opens, the launch stops with exit 2.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from harness import CHILDREN, events, launch

from rtrain.checkpoint import crypt, hashing
from rtrain.checkpoint.layout import EARLIER_PREFIX, list_checkpoints

pytestmark = pytest.mark.slow

SCRIPT = str(CHILDREN / "train_bitwise.py")


def _run(run, ckpts, out, total, *args, env=None, timeout=180):
    return launch(run, *args, SCRIPT, str(ckpts), str(out), str(total), "0", env=env,
                  timeout=timeout)


def _resumed(run) -> list[str | None]:
    return [e["resume_from"] and e["resume_from"].rsplit("/", 1)[1]
            for e in events(run, "launch")]


def _steps(ckpts) -> list[int]:
    return [s for s, _ in list_checkpoints(ckpts)]


@pytest.mark.parametrize("verify", [
    # The launch's own pick (full verification, the default) passing over this checkpoint is
    # tested in-process (test_state_schema.py, through the pick the launch calls), and end to
    # end for a newest checkpoint that fails verification (test_chaos_faults.py): soak here.
    pytest.param("full", marks=pytest.mark.soak),
    "quick",  # the worker meets it: bad_checkpoint, and the next attempt goes on
])
def test_a_hand_edited_state_json_is_passed_over_for_the_checkpoint_before(tmp_path, verify):
    run, out = tmp_path / "run", tmp_path / "out.pt"
    ckpts = run / "checkpoints"
    (tmp_path / "rtrain.toml").write_text(f'verify = "{verify}"\n')
    r = _run(run, ckpts, out, 9)
    assert r.returncode == 0, r.stderr
    assert _steps(ckpts) == [9, 6]
    newest = ckpts / "checkpoint-9"
    st = json.loads((newest / "state.json").read_text())
    st["rng"] = {}  # a field emptied, as a hand edit or another version might
    (newest / "state.json").write_text(json.dumps(st))
    m = json.loads((newest / "manifest.json").read_text())
    m["files"]["state.json"] = {"size": (newest / "state.json").stat().st_size,
                                "hash": hashing.hash_file(newest / "state.json", m["hash_alg"])}
    (newest / "manifest.json").write_text(json.dumps(m))

    before = len(events(run, "launch"))  # events.jsonl goes on across --fresh
    r = _run(run, ckpts, out, 12, "--fresh")
    assert r.returncode == 0, r.stderr
    assert torch.load(out)["step"] == 12
    skipped = events(run, "skipped_checkpoint")
    assert skipped and skipped[0]["path"].endswith("checkpoint-9")
    assert "field 'rng.python' is missing" in skipped[0]["reason"]
    if verify == "full":  # the launch's own verification passes over it
        assert _resumed(run)[before:] == ["checkpoint-6"]
    else:  # quick: the worker meets it, says bad_checkpoint, the next attempt goes on
        assert _resumed(run)[before:] == ["checkpoint-9", "checkpoint-6"]
        [c] = events(run, "classification")
        assert c["failure"] == "bad_checkpoint" and "rng.python" in c["reason"]


def test_a_crash_after_starting_over_resumes_from_the_new_run_not_the_earlier_one(tmp_path):
    ckpts, out = tmp_path / "ckpts", tmp_path / "out.pt"
    r = _run(tmp_path / "earlier", ckpts, out, 12, "--ckpt-dir", str(ckpts))
    assert r.returncode == 0, r.stderr
    assert _steps(ckpts) == [12, 9]

    run = tmp_path / "new"
    r = _run(run, ckpts, out, 6, "--ckpt-dir", str(ckpts), "--resume", "never",
             env={"RTRAIN_FAULTS": "crash@step=4"})  # after step 3's save, attempt 0 only
    assert r.returncode == 0, r.stderr
    assert _resumed(run) == [None, "checkpoint-3"]
    assert torch.load(out)["step"] == 6
    [aside] = events(run, "checkpoints_set_aside")
    assert aside["names"] == ["checkpoint-12", "checkpoint-9"]
    assert _steps(ckpts) == [6, 3]  # retention kept the new run's, not the earlier run's
    [moved] = ckpts.glob(f"{EARLIER_PREFIX}*")
    assert _steps(moved) == [12, 9]


KEY, OTHER = "3c" * 32, "5d" * 32


def test_a_newer_checkpoint_of_another_key_is_skipped_and_none_the_key_opens_stops(tmp_path):
    out = tmp_path / "out.pt"
    elsewhere = tmp_path / "other" / "checkpoints"
    r = _run(tmp_path / "other", elsewhere, out, 9, env={"RTRAIN_ENCRYPTION_KEY": OTHER})
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    r = _run(run, ckpts, out, 6, env={"RTRAIN_ENCRYPTION_KEY": KEY})
    assert r.returncode == 0, r.stderr
    shutil.copytree(elsewhere / "checkpoint-9", ckpts / "checkpoint-9")

    before = len(events(run, "launch"))  # events.jsonl goes on across --fresh
    r = _run(run, ckpts, out, 9, "--fresh", env={"RTRAIN_ENCRYPTION_KEY": KEY})
    assert r.returncode == 0, r.stderr
    assert _resumed(run)[before:] == ["checkpoint-6"]
    assert torch.load(out)["step"] == 9
    [skipped] = events(run, "skipped_checkpoint")
    other_fp = crypt.EncryptionKey.from_material(OTHER).fingerprint
    assert skipped["path"].endswith("checkpoint-9")
    assert skipped["reason"].startswith(f"wrong_key: encrypted with the key of fingerprint "
                                        f"{other_fp}")
    # A key that opens none of them: the run's own checkpoints, a wrong key: exit 2, one line.
    r = _run(run, ckpts, out, 12, "--fresh", env={"RTRAIN_ENCRYPTION_KEY": "7e" * 32})
    assert r.returncode == 2
    assert r.stderr.strip().startswith("rtrain: error: cannot resume from checkpoint-9: ")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
