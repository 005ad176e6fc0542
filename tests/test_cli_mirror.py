"""`rtrain inspect URL` and `rtrain prune URL` (supervisor/mirror/url_commands.py)."""

from __future__ import annotations

import json

import pytest
from conftest import build_checkpoint
from harness import run_rtrain

from rtrain.supervisor.mirror.store import open_mirror


def filled(url: str, tmp_path) -> None:
    mirror = open_mirror(url)
    for step in (100, 200, 300):
        mirror.upload(build_checkpoint(tmp_path / "local", step, metrics={"loss": 1 / step}))
    mirror.fs.pipe_file(mirror.path("checkpoint-50", "state.json"), b"{}")  # a dead upload


@pytest.fixture
def url(tmp_path):
    u = f"file://{tmp_path}/mirror"
    filled(u, tmp_path)
    return u


def flip_remote_byte(url: str, member: str = "state.json", name: str = "checkpoint-300"):
    mirror = open_mirror(url)
    path = mirror.path(name, member)
    data = mirror.fs.cat_file(path)
    mirror.fs.pipe_file(path, data[:-1] + bytes([data[-1] ^ 1]))


def test_inspect_lists_the_mirror(rtrain, url):
    r = rtrain("inspect", url)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"{url}: 4 checkpoints, verified quick"
    assert [ln.split()[:2] for ln in lines[2:5]] == [["*", "300"], ["200", "2"], ["100", "1"]]
    assert "incomplete: no manifest.json (the upload did not finish)" in lines[5]
    assert lines[-1].startswith("* resume would pick checkpoint-300")


def test_inspect_json_names_urls(rtrain, url):
    r = rtrain("inspect", url, "--json")
    out = json.loads(r.stdout)
    assert out["ckpt_dir"] == url and out["resume"] == f"{url}/checkpoint-300"
    assert [c["step"] for c in out["checkpoints"]] == [300, 200, 100, 50]
    assert out["checkpoints"][0]["metrics"] == {"loss": 1 / 300}


def test_full_verification_finds_a_flipped_byte_quick_does_not(rtrain, url):
    flip_remote_byte(url)
    assert rtrain("inspect", url, "--verify", "quick").stdout.count(" ok") == 3
    r = rtrain("inspect", url, "--verify", "full")
    assert r.returncode == 1
    assert "corrupt: file 'state.json': hash mismatch" in r.stdout
    assert "resume would pick checkpoint-200" in r.stdout


def test_one_remote_checkpoint_in_detail(rtrain, url):
    flip_remote_byte(url)
    r = rtrain("inspect", f"{url}/checkpoint-300", "--verify", "full")
    assert r.returncode == 1
    assert r.stdout.splitlines()[0] == f"{url}/checkpoint-300"
    files = r.stdout.split("\nfiles:\n", 1)[1].split("\ntensors:\n")[0]
    rows = {ln.split()[0]: ln for ln in files.splitlines()}
    assert rows["state.json"].endswith("hash mismatch")
    assert rows["model.safetensors"].endswith("ok")
    assert "fc.weight" in r.stdout  # tensors from the manifest


def test_a_missing_remote_checkpoint_is_a_usage_error(rtrain, url):
    r = rtrain("inspect", f"{url}/checkpoint-7")
    assert r.returncode == 2 and "no checkpoint at" in r.stderr


def test_prune_dry_run_then_prune(rtrain, url):
    r = rtrain("prune", url, "--keep", "1", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "would remove  checkpoint-200" in r.stdout and "would remove  checkpoint-50 " \
        in r.stdout
    assert len(open_mirror(url).list()) == 4
    r = rtrain("prune", url, "--keep", "1", "--milestone-every", "100")
    assert r.returncode == 0
    assert [c.step for c in open_mirror(url).list()] == [300, 200, 100]
    r = rtrain("prune", url, "--keep", "1")
    assert [c.step for c in open_mirror(url).list()] == [300]


def test_prune_does_not_rely_on_a_checkpoint_that_fails(rtrain, url):
    flip_remote_byte(url)
    rtrain("prune", url, "--keep", "1", "--verify", "full")
    assert [c.step for c in open_mirror(url).list()] == [300, 200]


def test_prune_refuses_keep_best_and_one_checkpoint(rtrain, url):
    r = rtrain("prune", url, "--keep", "1", "--keep-best", "1", "--metric", "loss")
    assert r.returncode == 2 and "--keep-best is not available for a mirror" in r.stderr
    r = rtrain("prune", f"{url}/checkpoint-300", "--keep", "1")
    assert r.returncode == 2 and "is one checkpoint" in r.stderr


@pytest.mark.slow
def test_inspect_and_prune_an_s3_mirror(rtrain, s3_mirror, tmp_path):
    url, _ = s3_mirror
    filled(url, tmp_path)
    r = rtrain("inspect", url, "--verify", "full")
    assert r.returncode == 1  # the dead upload counts as failed, as a local one does
    assert r.stdout.splitlines()[0] == f"{url}: 4 checkpoints, verified full"
    assert "resume would pick checkpoint-300" in r.stdout
    r = rtrain("prune", url, "--keep", "2")
    assert r.returncode == 0, r.stderr
    assert [c.step for c in open_mirror(url).list()] == [300, 200]


@pytest.mark.slow
def test_an_unreachable_mirror_is_one_line(s3_mirror, tmp_path):
    url, env = s3_mirror
    r = run_rtrain("inspect", url, env={**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
                   timeout=120)
    assert r.returncode == 1
    assert r.stderr.startswith(f"rtrain: error: mirror {url}: cannot list")
    assert len(r.stderr.splitlines()) == 1


@pytest.mark.slow
def test_fsspec_loads_only_for_a_url(tmp_path, url):
    build_checkpoint(tmp_path / "ckpts", 1)

    def imported(target: str) -> set[str]:
        r = run_rtrain("inspect", target, env={"PYTHONPROFILEIMPORTTIME": "1"})
        assert r.returncode == 0, r.stderr
        return {ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines() if "|" in ln}

    local = imported(str(tmp_path / "ckpts"))
    assert "rtrain.supervisor.commands.inspecting" in local  # the trace works
    assert not {m for m in local if m.split(".")[0] in ("fsspec", "s3fs", "botocore",
                                                         "aiobotocore", "boto3")}
    assert not {m for m in local if m.startswith((
        "rtrain.supervisor.mirror.store", "rtrain.supervisor.mirror.backend",
        "rtrain.supervisor.mirror.transfer",
        "rtrain.supervisor.mirror.url_commands"))}
    assert "fsspec" in imported(url)
