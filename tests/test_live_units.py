"""The live state in one process (worker/memtier/live.py) and rtrain's seal of it
(supervisor/memtier/live_seal.py): the parameters and optimizer state move into mapped files and
train on bit for bit; the mark exists exactly outside the optimizer's step; a change outside it,
overlapping tensors or a replaced state are handled; a sealed directory is a snapshot that
verifies and restores, tied weights included; what must not be sealed is not."""

from __future__ import annotations

import copy
import json
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

import rtrain
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.core.protocol import LIVE_DIR, LIVE_MARK
from rtrain.supervisor.memtier import live_seal
from rtrain.worker.memtier import live as live_mod

KEY = b"k" * 32


class Tied(torch.nn.Module):
    """A language model's tied input embedding and output projection, and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.out = torch.nn.Linear(16, 50, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(ids)))


def _pair(tied: bool = False):
    torch.manual_seed(0)
    m = Tied() if tied else torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32),
                                                torch.nn.Linear(32, 4))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _loss(m, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    if isinstance(m, Tied):
        return torch.nn.functional.cross_entropy(m(torch.randint(0, 50, (12,), generator=g)),
                                                 torch.randint(0, 50, (12,), generator=g))
    return m(torch.randn(12, 8, generator=g)).pow(2).mean()


def _step(m, opt, step: int) -> None:
    opt.zero_grad()
    _loss(m, step).backward()
    opt.step()


def _ckpt(m, opt, tmp_path, every: int = 1000, **kw):
    return rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck", every=None,
                               saving=rtrain.Saving(memory=every), **kw)


def _train(ck, m, opt, steps) -> None:
    for step in steps:
        _step(m, opt, step)
        ck.maybe_save(step)


def _mapped(t: torch.Tensor, shm) -> bool:
    """Whether `t`'s bytes lie in a shared mapping of a live file under `shm`."""
    with open("/proc/self/maps") as f:
        for line in f:
            if str(shm / LIVE_DIR) in line and line.split()[1].endswith("s"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= t.data_ptr() < hi:
                    return True
    return False


def _mark(shm) -> dict | None:
    path = shm / LIVE_DIR / LIVE_MARK
    return json.loads(path.read_text()) if path.exists() else None


def test_the_state_moves_into_shared_memory_and_trains_on_bit_for_bit(tmp_path, shm):
    m, opt = _pair()
    twin, twin_opt = copy.deepcopy(m), None
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    ck = _ckpt(m, opt, tmp_path)
    _train(ck, m, opt, range(1, 3))
    assert not any(_mapped(p, shm) for p in m.parameters())  # observed first (OBSERVE)
    _train(ck, m, opt, range(3, 9))
    assert all(_mapped(p, shm) for p in m.parameters())
    assert all(_mapped(v, shm) for st in opt.state.values() for v in st.values())
    assert _mark(shm)["step"] == 8
    for step in range(1, 9):
        _step(twin, twin_opt, step)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(),
                                                 twin.state_dict().values(), strict=True))
    for a, b in zip(opt.state.values(), twin_opt.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    ck.close()
    assert not (shm / LIVE_DIR).exists()
    assert not any(_mapped(p, shm) for p in m.parameters())  # back in the process's memory
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(),
                                                 twin.state_dict().values(), strict=True))


def test_the_mark_is_gone_while_the_optimizer_steps(tmp_path, shm):
    m, opt = _pair()
    ck = _ckpt(m, opt, tmp_path)
    _train(ck, m, opt, range(1, 5))
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append(_mark(shm)))  # after the tier's own
    _train(ck, m, opt, range(5, 7))
    assert seen == [None, None]
    assert _mark(shm)["step"] == 6
    ck.close()


def test_a_change_outside_the_optimizer_step_turns_it_off_and_unmaps(tmp_path, shm, caplog):
    m, opt = _pair()
    ck = _ckpt(m, opt, tmp_path)
    _train(ck, m, opt, range(1, 5))
    assert _mark(shm) is not None
    with torch.no_grad():
        next(m.parameters()).mul_(0.5)  # a weight change between the boundary and the step
    _step(m, opt, 5)
    live = ck._memory.live
    assert live.off is not None and "outside optimizer.step()" in live.off
    assert not (shm / LIVE_DIR).exists()
    assert not any(_mapped(p, shm) for p in m.parameters())
    assert "live state off" in caplog.text
    ck.maybe_save(5)  # training goes on, without it
    assert not (shm / LIVE_DIR).exists()
    ck.close()


def test_parameters_that_overlap_leave_it_off(tmp_path, shm):
    base = torch.zeros(10)
    m = torch.nn.Module()
    m.a, m.b = torch.nn.Parameter(base[:6]), torch.nn.Parameter(base[4:])
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ck = _ckpt(m, opt, tmp_path)
    for step in range(1, 6):
        opt.zero_grad()
        (m.a.sum() + m.b.pow(2).sum()).backward()
        opt.step()
        ck.maybe_save(step)
    assert "shares its bytes" in ck._memory.live.off
    assert not (shm / LIVE_DIR).exists()
    ck.close()


def test_a_replaced_optimizer_state_is_adopted_again(tmp_path, shm):
    m, opt = _pair()
    twin = copy.deepcopy(m)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    ck = _ckpt(m, opt, tmp_path)
    _train(ck, m, opt, range(1, 6))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors, same values
    _train(ck, m, opt, range(6, 12))
    assert ck._memory.live.off is None
    assert all(_mapped(v, shm) for st in opt.state.values() for v in st.values())
    for step in range(1, 12):
        _step(twin, twin_opt, step)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(),
                                                 twin.state_dict().values(), strict=True))
    ck.close()


@pytest.mark.parametrize("key", [None, KEY])
def test_a_sealed_directory_is_a_snapshot_that_verifies_and_restores(tmp_path, shm, key):
    """Tied weights (one slot, the second name filled as it is sealed), BatchNorm buffers,
    a signing key: the snapshot verifies in full and a new process state restores from it."""
    m, opt = _pair(tied=True)
    ck = _ckpt(m, opt, tmp_path, signing_key=key)
    _train(ck, m, opt, range(1, 7))
    assert _mark(shm)["step"] == 6
    want = {k: v.clone() for k, v in m.state_dict().items()}
    want_opt = copy.deepcopy(opt.state_dict())
    sealed = live_seal.seal(shm, key)  # as rtrain does once the writer is gone
    assert sealed is not None and sealed.step == 6 and not (shm / LIVE_DIR).exists()
    assert verify(sealed.path, Level.FULL, key).ok
    saved = load_file(sealed.path / "model.safetensors")
    assert saved.keys() == want.keys()
    assert all(torch.equal(saved[k], v) for k, v in want.items())
    assert torch.equal(saved["out.weight"], saved["emb.weight"])
    ck.close()

    m2, opt2 = _pair(tied=True)
    ck2 = rtrain.Checkpointer(model=m2, optimizer=opt2, ckpt_dir=tmp_path / "ck2", signing_key=key)
    assert ck2.restore(sealed.path) == 6
    assert all(torch.equal(m2.state_dict()[k], v) for k, v in want.items())
    got = opt2.state_dict()["state"]
    for i, st in want_opt["state"].items():
        assert all(torch.equal(got[i][k], v) for k, v in st.items())
    ck2.close()


def _live_dir(tmp_path, shm):
    m, opt = _pair()
    ck = _ckpt(m, opt, tmp_path)
    _train(ck, m, opt, range(1, 6))
    return ck


def test_no_mark_is_never_sealed(tmp_path, shm):
    ck = _live_dir(tmp_path, shm)
    ck._memory.live.stepping()  # the optimizer's step began: no whole step in the directory
    assert live_seal.seal(shm, None) is None
    assert not (shm / LIVE_DIR).exists() and list_checkpoints(shm) == []


@pytest.mark.slow  # another process, as the writer still running
def test_a_writer_still_running_is_left_alone(tmp_path, shm):
    ck = _live_dir(tmp_path, shm)
    mark = shm / LIVE_DIR / LIVE_MARK
    with subprocess.Popen(["sleep", "30"]) as other:
        mark.write_text(json.dumps({**json.loads(mark.read_text()), "pid": other.pid}))
        assert live_seal.seal(shm, None) is None
        assert mark.exists()
        other.kill()
    ck.close()


def test_a_file_of_the_wrong_size_is_refused_and_removed(tmp_path, shm):
    _live_dir(tmp_path, shm)
    with open(shm / LIVE_DIR / "optimizer.safetensors", "ab") as f:
        f.write(b"\0")
    with pytest.raises(live_seal.NotSealed, match=r"optimizer\.safetensors holds"):
        live_seal.seal(shm, None)
    assert not (shm / LIVE_DIR).exists() and list_checkpoints(shm) == []


def test_a_snapshot_as_new_makes_the_seal_needless(tmp_path, shm):
    m, opt = _pair()
    ck = _ckpt(m, opt, tmp_path, every=1)  # a snapshot at every step
    _train(ck, m, opt, range(1, 6))
    ck._memory.wait()
    assert live_seal.seal(shm, None) is None
    assert [s for s, _ in list_checkpoints(shm)] == [5]
    assert not (shm / LIVE_DIR).exists()


def test_constants_agree():
    assert live_mod.MARK == LIVE_MARK


def test_an_earlier_timelines_snapshots_give_way_to_the_sealed_step(tmp_path, shm):
    """Snapshots up to step 9 from before a rollback; the relaunch from step 0 is killed at
    step 5 with its state live: the seal replaces nothing of its own and removes step 9, so
    the newest snapshot is the state the run is really at."""
    m, opt = _pair()
    ck = _ckpt(m, opt, tmp_path, every=1)
    _train(ck, m, opt, range(1, 10))
    ck.close()
    assert [s for s, _ in list_checkpoints(shm)] == [9]
    m2, opt2 = _pair()
    ck2 = _ckpt(m2, opt2, tmp_path / "again")
    _train(ck2, m2, opt2, range(1, 6))
    want = {k: v.clone() for k, v in m2.state_dict().items()}
    sealed = live_seal.seal(shm, None)
    assert sealed is not None and sealed.step == 5
    assert [s for s, _ in list_checkpoints(shm)] == [5]
    saved = load_file(sealed.path / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in want.items())
    ck2.close()


def test_two_optimizer_steps_between_boundaries_keep_it_on(tmp_path, shm):
    m, opt = _pair()
    ck = _ckpt(m, opt, tmp_path)
    for step in range(1, 8):
        _step(m, opt, 2 * step)
        _step(m, opt, 2 * step + 1)
        ck.maybe_save(step)
    assert ck._memory.live.off is None and _mark(shm)["step"] == 7
    ck.close()


def test_a_background_disk_save_writes_the_boundarys_state_not_what_the_next_steps_made(
        tmp_path, shm, monkeypatch):
    """A forked writer sees shared memory change under it (no copy-on-write there): with the
    state live, the background save copies it instead. The writer is slowed here (in the
    child too: the fork copies the patch) while two more steps change the state. An explicit
    save(): one the schedule calls for goes to rtrain under the tier."""
    from rtrain.checkpoint import safetensors_io

    write = safetensors_io.write_file

    def slow(*a, **kw):
        time.sleep(0.4)
        return write(*a, **kw)

    m, opt = _pair()
    ck = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck", every=None,
                             saving=rtrain.Saving(async_mode="auto"))  # the tier by default
    _train(ck, m, opt, range(1, 6))
    assert ck._memory.live.adopted
    monkeypatch.setattr(safetensors_io, "write_file", slow)
    _step(m, opt, 6)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    ck.save(6)  # the disk save of step 6, in the background
    ck.maybe_save(6)
    _train(ck, m, opt, range(7, 9))
    ck.close()
    saved = load_file(tmp_path / "ck" / "checkpoint-6" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in want.items())


def test_a_handed_disk_save_keeps_the_mark_until_its_snapshot_committed(tmp_path, shm,
                                                                       monkeypatch):
    """With `memory=` left out, the disk save of step 6 is a snapshot rtrain persists. Its
    commit is slowed here: the next optimizer step waits for it before the mark of step 6 goes,
    so at every moment step 6 is whole in memory, marked or committed (a kill inside that
    optimizer step would otherwise find neither)."""
    from rtrain.checkpoint.commit import PendingCheckpoint

    commit, seen = PendingCheckpoint.commit, []

    def slow(self, *a, **kw):
        if self.ckpt_dir == shm and self.step == 6:
            time.sleep(0.3)  # the training thread reaches optimizer.step() meanwhile
            seen.append((_mark(shm) or {}).get("step"))
        return commit(self, *a, **kw)

    m, opt = _pair()
    ck = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck", every=6)
    _train(ck, m, opt, range(1, 6))
    assert ck._memory.live.adopted
    monkeypatch.setattr(PendingCheckpoint, "commit", slow)
    _train(ck, m, opt, range(6, 8))
    ck.close()
    assert seen == [6]
    assert 6 in dict(list_checkpoints(shm)) or ck._memory.last_step == 6
    assert list_checkpoints(tmp_path / "ck") == []  # rtrain writes the disk saves
