"""A changed world size, end to end: a run checkpointed by 2 ranks resumes under `rtrain launch`
at 1 and at 4 ranks (gloo, CPU), for replicated (DDP) and sharded (FSDP2, DCP resharding) state.

Every tensor of the loaded state, gathered onto rank 0, equals the one saved; the sampler
position is the saved one; and the step after the resume matches the 2-rank run's own next step
(the effective batch is kept: fewer ranks accumulate more micro-batches, children/dist_resize.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from harness import CHILDREN, events, launch, run_rtrain
from test_dist_resume import _fsdp_available

pytestmark = pytest.mark.slow


def _flat(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flat(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def _state(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def _run(tmp: Path, name: str, ranks: int, ckpt_dir: Path, *flags: str):
    r = launch(tmp / name, "--ckpt-dir", str(ckpt_dir), "--nproc-per-node", str(ranks),
               str(CHILDREN / "dist_resize.py"), str(tmp / name), "5", "4", *flags,
               timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.parametrize(("layout", "sizes"), [
    ("fsdp", (1,)),
    # Four ranks on a 2-core machine take a minute and more: the growing case, and DDP's.
    pytest.param("fsdp", (1, 4), marks=pytest.mark.soak),
    pytest.param("ddp", (1, 4), marks=pytest.mark.soak),
])
def test_checkpoint_of_2_ranks_resumes_at_another_size(tmp_path, layout, sizes):
    flags = ()
    if layout == "fsdp":
        why = _fsdp_available()
        if why:
            pytest.skip(why)
        flags = ("--fsdp",)
    ck = tmp_path / "ck2"
    _run(tmp_path, "w2", 2, ck, *flags)  # checkpoint-4, then step 5
    saved, after = _state(tmp_path / "w2-step4.pt"), _state(tmp_path / "w2-step5.pt")
    assert saved["world"] == 2 and saved["position"] == 32  # 4 steps of 8 samples
    insp = run_rtrain("inspect", str(ck / "checkpoint-4"))
    assert insp.returncode == 0, insp.stderr
    want_layout = "sharded" if layout == "fsdp" else "replicated"
    assert f"world size  2 ranks, {want_layout}\n" in insp.stdout, insp.stdout

    for ranks in sizes:
        mine = tmp_path / f"ck{ranks}"
        shutil.copytree(ck, mine)
        name = f"w{ranks}"
        _run(tmp_path, name, ranks, mine, *flags)
        (launch_ev,) = events(tmp_path / name, "launch")
        assert launch_ev["resume_from"].endswith("checkpoint-4")
        (changed,) = events(tmp_path / name, "world_size_changed")
        assert (changed["world_size"], changed["saved_world_size"]) == (ranks, 2), changed
        assert changed["checkpoint"] == "checkpoint-4"
        loaded = _state(tmp_path / f"{name}-loaded.pt")
        assert loaded["world"] == ranks and loaded["step"] == 4
        assert (loaded["position"], loaded["epoch"]) == (saved["position"], saved["epoch"])
        a, b = dict(_flat(saved["model"])), dict(_flat(loaded["model"]))
        a.update(_flat(saved["optim"], "optim"))
        b.update(_flat(loaded["optim"], "optim"))
        assert a.keys() == b.keys()
        tensors = 0
        for k, v in a.items():
            if isinstance(v, torch.Tensor):
                tensors += 1
                assert v.dtype == b[k].dtype and torch.equal(v, b[k]), (ranks, k)
            else:
                assert v == b[k], (ranks, k)
        assert tensors >= 4 + 2 * 4  # 4 parameters, each with 2 Adam moments (and steps)
        # The next step at this world size is the 2-rank run's next step: the same global
        # batch (the same samples, the same mean gradient), up to float summation order.
        nxt = _state(tmp_path / f"{name}-step5.pt")
        for k, v in after["model"].items():
            assert torch.allclose(v, nxt["model"][k], atol=1e-6, rtol=1e-5), (ranks, k)
        assert nxt["position"] == after["position"] == 40
