"""A process group's parts committed as one disk checkpoint (supervisor/memtier/persist.py,
`persist_group`; parts.group_manifest): every part's files under one manifest signed with the
run's key, the layout a collective save writes; parts that do not make one step refused."""

from __future__ import annotations

import pytest
from conftest import make_part

from rtrain.checkpoint import hashing, parts, runid
from rtrain.checkpoint import manifest as mf
from rtrain.checkpoint.layout import checkpoint_name
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.memtier import persist

KEY = hashing.derive_key(b"the run's key")
RUN = "1" * 32  # make_part's run


def _group(memory_dir, step=5, world=3, key=None, **kw):
    for rank in range(world):  # rank 0 the replicated state, every rank its RNG
        make_part(memory_dir, rank, world, step, key=key, model=rank == 0, **kw)
    found = parts.list_parts(memory_dir, key)
    return [parts.pick(found, step, r) for r in range(world)]


@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
def test_the_parts_of_a_whole_step_commit_as_one_checkpoint(tmp_path, key):
    group = _group(tmp_path / "mem", key=key)
    done = persist.persist_group(group, tmp_path / "ck", key, fsync=False)
    assert done.path == tmp_path / "ck" / checkpoint_name(5) and not done.already
    v = verify(done.path, Level.FULL, key)
    assert v.ok, v.reason
    m = v.manifest
    assert sorted(m["files"]) == ["model.safetensors", "rng-rank0.safetensors",
                                  "rng-rank1.safetensors", "rng-rank2.safetensors", "state.json"]
    assert m["info"]["world_size"] == 3 and m["info"]["layout"] == "replicated"
    assert "rank" not in m["info"] and "part" not in m["info"]
    assert ("signature" in m) == (key is not None)
    # A part's own files only once: rank 1's and 2's model files are not rank 0's.
    assert (done.path / "rng-rank2.safetensors").read_bytes() == (
        group[2].path / "rng-rank2.safetensors").read_bytes()
    again = persist.persist_group(group, tmp_path / "ck", key, fsync=False)
    assert again.already


def test_a_part_changed_in_memory_is_refused_and_nothing_committed(tmp_path):
    group = _group(tmp_path / "mem")
    f = group[1].path / "rng-rank1.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(persist.SnapshotRefused, match=r"rng-rank1\.safetensors"):
        persist.persist_group(group, tmp_path / "ck", None, fsync=False)
    assert [p.name for p in (tmp_path / "ck").iterdir()] == []


@pytest.mark.parametrize("change, why", [
    (lambda ms: ms.pop(), "not 0..2 once each"),
    (lambda ms: ms[1].update(step=6), "differ in step"),
    (lambda ms: ms[2].update(hash_alg="sha256"), "differ in hash_alg"),
    (lambda ms: ms[1].update(run="9" * 32), "differ in run"),
    (lambda ms: ms[1]["files"].update({"model.safetensors": ms[0]["files"]["model.safetensors"]}),
     "listed by two parts"),
])
def test_parts_that_do_not_make_one_step_are_refused(tmp_path, change, why):
    ms = [mf.load(p.path) for p in _group(tmp_path / "mem")]
    change(ms)
    with pytest.raises(parts.NotOneStep, match=why):
        parts.group_manifest(ms)


def test_a_group_step_refused_at_the_attempts_end_is_said_and_discarded(tmp_path):
    from rtrain.supervisor.memtier.tier import MemoryTierDir

    mem, ck = tmp_path / "mem", tmp_path / "ck"
    ck.mkdir()
    runid.write(ck, RUN)
    group = _group(mem, run=RUN)
    f = group[2].path / "rng-rank2.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    seen: list = []
    tier = MemoryTierDir(ck, None, lambda kind, **kw: seen.append((kind, kw)), lambda s: None,
                         path=mem)
    assert tier.commit_newest(None, "attempt ended") is None
    (kind, ev), = seen
    assert kind == "snapshot_refused" and "rng-rank2.safetensors" in ev["reason"], ev
    assert parts.list_parts(mem, None) == [] and list(ck.iterdir()) == [ck / ".rtrain-run"]
