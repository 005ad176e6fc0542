"""A compiled model across relaunches, with real processes and real compiles (inductor on the
CPU, gcc): a fresh node loads the checkpoint's compile cache and runs warm, ends bitwise where a
cold resume ends, and an untrusted cache never runs; under rtrain every attempt (the standby's
included) shares the run dir's cache."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bitwise import assert_bitwise_equal
from harness import CHILDREN, child_env, events, launch
from hostile import code_running_pickle, manifest, relist, write_manifest

from rtrain.worker.compilecache import compile_cache, compile_pack

SCRIPT = CHILDREN / "train_compiled.py"
KEY = "compile-cache-test-key"
# Inductor's own probes, off: on a fresh cache dir it compiles and loads a test program for each
# vector ISA the CPU lists (a third of a cold compile here), and by default starts a pool of
# compile workers that each import torch. Neither is what these tests are about (whether the
# checkpoint's cache is loaded, trusted, shared), and the graphs compiled, cached and looked up
# are the same with them off.
INDUCTOR_ENV = {"TORCHINDUCTOR_VEC_ISA_OK": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def run(ckpt_dir: Path, out: Path, cache: Path, *args: str, key: str | None = KEY
        ) -> tuple[dict, subprocess.CompletedProcess]:
    env = child_env(TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"),
                    **INDUCTOR_ENV)
    if key is not None:
        env["RTRAIN_SIGNING_KEY"] = key
    r = subprocess.run([sys.executable, str(SCRIPT), str(ckpt_dir), str(out), *args], env=env,
                       capture_output=True, text=True, timeout=240)
    report = json.loads(out.read_text()) if r.returncode == 0 else {}
    return report, r


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """Checkpoints 2 and 4 of a compiled run (signed), killed after step 4's save."""
    tmp = tmp_path_factory.mktemp("first")
    _, r = run(tmp / "ckpt", tmp / "out.json", tmp / "cache", "6", "--die-at", "4")
    assert r.returncode == 9, r.stderr[-3000:]
    assert manifest(tmp / "ckpt" / "checkpoint-4")["info"][compile_cache.INFO_KEY]["kernels"] > 0
    return tmp / "ckpt"


def plant_code(ckpt: Path, marker: Path) -> None:
    """An attacker's cache: every compiled graph of the real one replaced by a pickle that runs
    code when inductor looks it up, re-hashed into an unsigned manifest (as anyone who can
    write the checkpoint dir could)."""
    from torch.compiler._cache import CacheArtifactManager, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    torch_bytes, kernels = compile_pack.unpack((ckpt / compile_cache.FILE).read_bytes())
    arts = CacheArtifactManager.deserialize(torch_bytes)
    assert arts and arts["inductor"]
    evil = code_running_pickle(marker)
    arts["inductor"] = [dataclasses.replace(a, content=evil) for a in arts["inductor"]]
    s = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    s.extend(arts.items())
    relist(ckpt, compile_cache.FILE, compile_pack.pack(s.to_bytes(), kernels))
    m = manifest(ckpt)
    m.pop("signature")
    write_manifest(ckpt, m)


@pytest.mark.slow
def test_fresh_node_resumes_warm_bitwise_and_never_runs_an_untrusted_cache(tmp_path, first_run):
    # A fresh node: an empty cache dir, the shared checkpoint dir (signed): warm.
    warm_dir = tmp_path / "warm"
    shutil.copytree(first_run, warm_dir)
    warm, r = run(warm_dir, tmp_path / "warm.json", tmp_path / "cache-warm", "6")
    assert r.returncode == 0, r.stderr[-3000:]
    assert warm["inductor"].get("fxgraph_cache_hit", 0) >= 1, warm
    assert "fxgraph_cache_miss" not in warm["inductor"], warm
    # The same checkpoint with an attacker's cache, unsigned: ignored, compiled cold.
    cold_dir = tmp_path / "cold"
    shutil.copytree(first_run, cold_dir)
    marker = tmp_path / "pickle-ran"
    plant_code(cold_dir / "checkpoint-4", marker)
    cold, r = run(cold_dir, tmp_path / "cold.json", tmp_path / "cache-cold", "6", key=None)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not marker.exists()
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 1, cold
    # Loading the cache changed no number: both resumes end bitwise-identical.
    a, b = torch.load(tmp_path / "warm.json.pt"), torch.load(tmp_path / "cold.json.pt")
    assert_bitwise_equal(a["model"], b["model"], "model")
    assert_bitwise_equal(a["opt"], b["opt"], "optimizer")


@pytest.mark.soak
def test_the_planted_cache_does_run_code_when_trusted(tmp_path, first_run):
    """The control of the test above: the same planted cache, trusted (allow_pickle), runs its
    code at the compile, so it is the guard that stopped it there."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(first_run, ckpt)
    marker = tmp_path / "pickle-ran"
    plant_code(ckpt / "checkpoint-4", marker)
    run(ckpt, tmp_path / "out.json", tmp_path / "cache", "6", "--trust", key=None)
    assert marker.exists()


@pytest.mark.slow
def test_attempts_under_rtrain_share_the_run_dirs_compile_cache(tmp_path):
    run_dir, arm = tmp_path / "run", tmp_path / "arm"
    arm.touch()  # crash once, after the first save
    r = launch(run_dir, str(SCRIPT), "{ckpt_dir}", str(tmp_path / "out.json"), "5",
               "--arm", str(arm), env=INDUCTOR_ENV, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "out.json").read_text())
    # Attempt 1 resumed from checkpoint-2 and compiled nothing anew: the run dir's cache.
    assert report["inductor"].get("fxgraph_cache_hit", 0) >= 1, report
    assert "fxgraph_cache_miss" not in report["inductor"], report
    assert any((run_dir / "compile-cache" / "inductor").iterdir())
    launches = events(run_dir, "launch")
    assert [e["attempt"] for e in launches] == [0, 1]
    assert launches[1]["resume_from"] and launches[1]["standby"], launches[1]
    # The standby had imported inductor's compile path: the script names torch.compile.
    ready = events(run_dir, "standby_ready")
    assert ready and "torch._inductor.compile_fx" in ready[0]["modules"], ready
    # Unsigned: the checkpoint's own cache is not loaded, and the event says why.
    (ev,) = events(run_dir, "compile_cache")
    assert ev["attempt"] == 1 and ev["outcome"] == "ignored"
    assert "not signed" in ev["detail"]
