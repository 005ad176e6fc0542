"""rtrain.worker.data.position, rtrain.worker.data.sampler and rtrain.worker.data.sample_rng in one
process (no DataLoader workers)."""

import json
import pickle

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import rtrain
from rtrain.worker.data import position
from rtrain.worker.data.sampler import SampleIndex


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The indices a fresh ResumableSampler hands out in `epoch`, in order."""
    sampler = rtrain.ResumableSampler(num_samples, seed=seed)
    sampler.set_epoch(epoch)
    return [int(i) for i in sampler]


def dataset(n=20):
    return TensorDataset(torch.arange(n))


def test_sample_seed_depends_on_seed_epoch_and_index():
    s = rtrain.sample_seed(3, epoch=1, seed=7)
    assert s == rtrain.sample_seed(SampleIndex(3, 1, 7))
    assert 0 <= s < 2**63
    others = {rtrain.sample_seed(4, epoch=1, seed=7), rtrain.sample_seed(3, epoch=2, seed=7),
              rtrain.sample_seed(3, epoch=1, seed=8)}
    assert s not in others and len(others) == 3
    with pytest.raises(TypeError, match="epoch"):
        rtrain.sample_seed(3)


def test_sample_index_is_an_int_that_travels_with_its_epoch():
    i = SampleIndex(5, 2, 9)
    j = pickle.loads(pickle.dumps(i))
    assert j == 5 and (j.epoch, j.seed) == (2, 9) and [10, 11, 12, 13, 14, 15][j] == 15
    assert torch.arange(10)[j].item() == 5


def test_seeded_is_per_sample_and_puts_the_global_state_back():
    before = torch.get_rng_state()
    with rtrain.seeded(SampleIndex(1, 0, 0)):
        a = torch.rand(3)
    with rtrain.seeded(SampleIndex(1, 0, 0)):
        b = torch.rand(3)
    with rtrain.seeded(SampleIndex(2, 0, 0)):
        c = torch.rand(3)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), before)
    g = rtrain.sample_generator(SampleIndex(1, 0, 0))
    assert torch.equal(torch.rand(3, generator=g), a)


def stream(loader, batches):
    it = iter(loader)
    return [int(v) for _ in range(batches) for v in next(it)[0]]


def test_position_is_what_the_loop_took_and_resumes_there(tmp_path):
    sampler = rtrain.ResumableSampler(20, seed=3)
    loader = DataLoader(dataset(), batch_size=4, sampler=sampler)
    ck = rtrain.Checkpointer(loader=loader, ckpt_dir=tmp_path, every=1)
    first = stream(loader, 2)
    sampler.position = 17  # as a prefetching loader leaves it: handed out, never consumed
    ck.save(2)
    state = json.loads((tmp_path / "checkpoint-2" / "state.json").read_text())["sampler"]
    assert (state["epoch"], state["position"], state["samples_seen"]) == (0, 8, 8)

    s2 = rtrain.ResumableSampler(20, seed=3)
    loader2 = DataLoader(dataset(), batch_size=4, sampler=s2)
    assert rtrain.Checkpointer(loader=loader2, ckpt_dir=tmp_path).restore() == 2
    rest = stream(loader2, 3)
    whole = epoch_order(20, 3, 0)
    assert first + rest == whole
    assert [int(v) for v in next(iter(loader2))[0]] == epoch_order(20, 3, 1)[:4]


def test_drop_last_remainder_ends_the_epoch():
    sampler = rtrain.ResumableSampler(10, seed=0)
    loader = DataLoader(dataset(10), batch_size=4, sampler=sampler, drop_last=True)
    pos = position.track(loader=loader)
    assert len(list(loader)) == 2
    assert (pos.epoch, pos.position, pos.samples_seen) == (1, 0, 8)


def test_iter_of_a_watched_loader_leaves_the_global_generator_alone(tmp_path):
    loader = DataLoader(dataset(), batch_size=4, sampler=rtrain.ResumableSampler(20))
    rtrain.Checkpointer(loader=loader, ckpt_dir=tmp_path)
    before = torch.get_rng_state()
    next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)


def test_loader_errors_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="ResumableSampler"):
        position.track(loader=DataLoader(dataset(), batch_size=4, shuffle=True))
    with pytest.raises(ValueError, match="in_order"):
        position.track(loader=DataLoader(dataset(), sampler=rtrain.ResumableSampler(20),
                                     num_workers=1, in_order=False))
    loader = DataLoader(dataset(), sampler=rtrain.ResumableSampler(20))
    position.track(loader=loader)
    with pytest.raises(ValueError, match="already"):
        position.track(loader=loader)


@pytest.mark.parametrize(("n", "shuffle", "drop_last"),
                         [(10, True, False), (11, True, False), (11, False, False),
                          (11, True, True)])
def test_distributed_sampler_splits_as_torch_does(n, shuffle, drop_last):
    for rank in (0, 1, 2):
        ours = rtrain.DistributedResumableSampler(n, num_replicas=3, rank=rank, seed=5,
                                                  shuffle=shuffle, drop_last=drop_last)
        theirs = DistributedSampler(range(n), num_replicas=3, rank=rank, seed=5,
                                    shuffle=shuffle, drop_last=drop_last)
        for epoch in (0, 1):
            theirs.set_epoch(epoch)
            assert [int(i) for i in ours] == list(theirs)
            assert ours.epoch == epoch + 1


def test_distributed_position_is_per_rank_and_refuses_another_world_mid_epoch():
    s = rtrain.DistributedResumableSampler(11, num_replicas=2, rank=1, seed=5)
    it = iter(s)
    taken = [int(next(it)) for _ in range(3)]
    state = s.state_dict()
    s2 = rtrain.DistributedResumableSampler(11, num_replicas=2, rank=1, seed=5)
    s2.load_state_dict(state)
    assert taken + [int(i) for i in s2] == [int(i) for i in
                                            rtrain.DistributedResumableSampler(
                                                11, num_replicas=2, rank=1, seed=5)]
    with pytest.raises(ValueError, match="same world size"):
        rtrain.DistributedResumableSampler(11, num_replicas=3, rank=1).load_state_dict(state)


def test_a_new_iter_hands_out_again_what_was_fetched_but_not_taken():
    sampler = rtrain.ResumableSampler(20, seed=1)
    loader = DataLoader(dataset(), batch_size=4, sampler=sampler)
    position.track(loader=loader)
    first = stream(loader, 2)
    sampler.position = 15  # a prefetching loader's sampler, ahead of the loop
    assert first + stream(loader, 3) == epoch_order(20, 1, 0)


def test_any_loader_with_state_dict_is_saved_as_json(tmp_path):
    class Stream:  # not a DataLoader: a loader with its own state, as some libraries have
        def __init__(self):
            self.pos = 0

        def __iter__(self):
            while self.pos < 6:
                self.pos += 1
                yield torch.tensor([self.pos])

        def state_dict(self):
            return {"pos": self.pos, "mark": torch.tensor([7])}

        def load_state_dict(self, state):
            self.pos = state["pos"]
            assert torch.equal(state["mark"], torch.tensor([7]))

    a = Stream()
    ck = rtrain.Checkpointer(loader=a, ckpt_dir=tmp_path)
    it = iter(a)
    assert [int(next(it)), int(next(it))] == [1, 2]
    ck.save(1)
    b = Stream()
    rtrain.Checkpointer(loader=b, ckpt_dir=tmp_path).restore()
    assert [int(x) for x in b] == [3, 4, 5, 6]
