"""The pickle scan is an allow-list (supervisor/ckpt/pickle_scan.py): a checkpoint whose pickle
names anything beyond what `torch.save` and the supported formats write is not resumable, with
the name in the reason; what real checkpoints hold still verifies; and the walk's cost is
bounded by the pickle's size (memo, stack) and by time. In-process, nothing ever unpickled."""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import pathlib
import pickle
import pickletools
import pydoc
import random
import struct
import time
import tracemalloc
import zipfile
from collections import Counter, OrderedDict, defaultdict

import numpy as np
import pytest
import torch

from rtrain.checkpoint.verify import Level
from rtrain.supervisor.ckpt import foreign, pickle_scan, torchzip


class Pager:
    """pydoc.pipepager(text, cmd) runs `cmd` in a shell."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pydoc.pipepager, ("x", f"touch '{self.marker}'"))


class Profiled:
    """cProfile.run(statement) executes the statement."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (cProfile.run, (f"open({str(self.marker)!r}, 'w')",))


def _resolve_then_call(marker: pathlib.Path) -> bytes:
    """pkgutil.resolve_name('os:system') returns os.system; the pickle then calls it."""
    def text(s: str) -> bytes:
        raw = s.encode()
        return b"X" + struct.pack("<I", len(raw)) + raw

    return (b"\x80\x02}(X\x08\x00\x00\x00iter_numK\x05X\x01\x00\x00\x00x"
            b"cpkgutil\nresolve_name\n" + text("os:system") + b"\x85R"
            + text(f"touch '{marker}'") + b"\x85Ru.")


def _torch_file(path: pathlib.Path, pkl: bytes) -> pathlib.Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/version", "3\n")
    return path


@pytest.mark.parametrize(("make", "named"), [
    (lambda m: pickle.dumps({"iter_num": 5, "x": Pager(m)}, protocol=2), "pydoc.pipepager"),
    (lambda m: pickle.dumps({"iter_num": 5, "x": Pager(m)}, protocol=4), "pydoc.pipepager"),
    (lambda m: pickle.dumps({"iter_num": 5, "x": Profiled(m)}, protocol=2), "cProfile.run"),
    (lambda m: pickle.dumps({"iter_num": 5, "x": Profiled(m)}, protocol=5), "cProfile.run"),
    (_resolve_then_call, "pkgutil.resolve_name"),
])
def test_each_bypass_of_the_deny_list_is_refused_naming_its_global(tmp_path, make, named):
    marker = tmp_path / "pwned"
    pkl = make(marker)
    with pytest.raises(pickle_scan.PickleRefused, match=rf"the pickle calls {named} when loaded"):
        pickle_scan.scan(pkl)
    v = foreign.verify_path(_torch_file(tmp_path / "ckpt.pt", pkl), Level.FULL)
    assert not v.ok and f"the pickle calls {named}" in v.reason and "\n" not in v.reason
    assert not marker.exists()


def test_a_scripts_own_class_makes_the_file_not_resumable():
    data = (b"\x80\x02cmytrain.config\nTrainConfig\nq\x00)\x81q\x01}q\x02"
            b"X\x04\x00\x00\x00stepq\x03K\x07sb.")
    with pytest.raises(pickle_scan.PickleRefused, match=r"calls mytrain\.config\.TrainConfig"):
        pickle_scan.scan(data)


def test_python2_spellings_are_judged_as_the_loader_resolves_them():
    # Below protocol 3 the loader maps __builtin__ to builtins: eval is eval either way.
    with pytest.raises(pickle_scan.PickleRefused, match=r"__builtin__\.eval"):
        pickle_scan.scan(b"\x80\x02c__builtin__\neval\nX\x01\x00\x00\x001\x85R.")
    assert pickle_scan.scan(b"\x80\x02c__builtin__\nset\n]\x85R.").globals_named == 1
    # From protocol 3 on the loader maps nothing: __builtin__ does not exist there.
    with pytest.raises(pickle_scan.PickleRefused, match=r"__builtin__\.set"):
        pickle_scan.scan(b"\x80\x03c__builtin__\nset\n]\x85R.")
    # A dotted name reaching past an allowed class is not that class.
    with pytest.raises(pickle_scan.PickleRefused, match=r"collections\.OrderedDict\.fromkeys"):
        pickle_scan.scan(b"\x80\x04\x8c\x0bcollections\x8c\x14OrderedDict.fromkeys\x93.")


def test_torch_storage_from_bytes_is_refused():
    # It loads nested bytes with weights_only=False: torch.save never writes it.
    data = pickle.dumps(torch.ones(2), protocol=2)  # plain pickle, not torch.save
    with pytest.raises(pickle_scan.PickleRefused, match=r"torch\.storage\._load_from_bytes"):
        pickle_scan.scan(data)


def _states() -> dict:
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd.step()
    scheds = [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10),
              torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10),
              torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
              torch.optim.lr_scheduler.SequentialLR(
                  opt, [torch.optim.lr_scheduler.LinearLR(opt),
                        torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)], [2]),
              torch.optim.lr_scheduler.ReduceLROnPlateau(opt)]
    return {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "sgd": sgd.state_dict(),
        "schedulers": [s.state_dict() for s in scheds],
        "scaler": torch.amp.GradScaler("cpu").state_dict(),
        # timm and the imagenet example save their argparse args.
        "args": argparse.Namespace(lr=0.1, output=pathlib.Path("/out"),
                                   started=datetime.datetime(2026, 1, 2, 3, 4)),
        # HF Trainer's rng_state.pth and accelerate's random_states_0.pkl.
        "python": random.getstate(), "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
        "np_scalar": np.float64(1.5), "np_array": np.arange(3), "set": {1, 2},
        "frozenset": frozenset([1]), "complex": 1j, "slice": slice(1, 2), "bytes": b"xx",
        "bytearray": bytearray(b"x"), "ordered": OrderedDict(a=1), "counter": Counter("ab"),
        "defaultdict": defaultdict(list), "date": datetime.date(2026, 1, 2),
        "delta": datetime.timedelta(1), "device": torch.device("cpu"), "size": torch.Size([2]),
        "dtype": torch.bfloat16, "param": torch.nn.Parameter(torch.ones(1)),
        "bf16": torch.ones(2, dtype=torch.bfloat16), "int8": torch.ones(2, dtype=torch.int8),
        "best_val_loss": torch.tensor(1.0), "iter_num": 42,
    }


@pytest.mark.parametrize(("protocol", "legacy"), [(2, False), (4, False), (2, True)])
def test_what_real_checkpoints_hold_still_verifies(tmp_path, protocol, legacy):
    path = tmp_path / "ckpt.pt"
    torch.save(_states(), path, pickle_protocol=protocol,
               _use_new_zipfile_serialization=not legacy)
    checked = torchzip.inspect(path, full=True)
    assert (checked.step, checked.step_key) == (42, "iter_num")
    v = foreign.verify_path(path, Level.FULL)
    assert v.ok, v.reason


def test_lightning_hyper_parameters_verify(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.utilities.parsing import AttributeDict

    path = tmp_path / "epoch=0-step=4.ckpt"
    torch.save({"epoch": 0, "global_step": 4, "pytorch-lightning_version": pl.__version__,
                "state_dict": torch.nn.Linear(2, 2).state_dict(),
                "hyper_parameters": AttributeDict(lr=0.1, layers=[2, 2])}, path)
    assert torchzip.inspect(path, full=True).step == 4


def test_training_args_bin_is_not_judged_by_the_allow_list(tmp_path):
    """A Trainer never loads training_args.bin to resume: the script's TrainingArguments class
    (transformers', TRL's, the user's own) does not make the checkpoint unresumable."""
    _torch_file(tmp_path / "training_args.bin",
                b"\x80\x02ctransformers.training_args\nTrainingArguments\n)\x81}b.")
    with pytest.raises(torchzip.TorchFileError, match="TrainingArguments"):
        torchzip.check(tmp_path / "training_args.bin", full=True)
    assert torchzip.check(tmp_path / "training_args.bin", full=True, any_global=True) == ""


# ------------------------------------------------------------------ bounded work

def test_a_memo_flood_is_walked_in_memory_bounded_by_its_size():
    # 50k memo puts (7 bytes each): pickle's own ratio is far below the limit, so it verifies,
    # holding a pointer per entry instead of an object.
    n = 50_000
    data = (b"\x80\x04]" + b"".join(b"Nr" + struct.pack("<I", i) + b"0" for i in range(n))
            + b".")
    tracemalloc.start()
    try:
        pickle_scan.scan(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(data), peak  # the deny-list's walk held about 120 bytes an entry


def test_more_memo_entries_than_pickle_writes_is_refused():
    data = b"\x80\x04]" + b"N\x940" * 400_000 + b"."  # an entry every 3 bytes
    with pytest.raises(pickle_scan.PickleRefused, match="memoizes more than"):
        pickle_scan.scan(data)


def test_memo_entries_out_of_order_are_refused_before_they_cost_memory():
    data = (b"\x80\x04]" + b"".join(b"Nr" + struct.pack("<I", 7 * i + 3) + b"0"
                                     for i in range(70_000)) + b".")
    with pytest.raises(pickle_scan.PickleRefused, match="memo entries out of order"):
        pickle_scan.scan(data)


def test_a_stack_deeper_than_any_checkpoint_is_refused():
    data = b"\x80\x04" + b"(" * (pickle_scan.MAX_STACK + (1 << 17)) + b"t."
    with pytest.raises(pickle_scan.PickleRefused, match=r"more than .* items at once"):
        pickle_scan.scan(data)


def test_the_walk_gives_up_after_its_time(monkeypatch):
    monkeypatch.setattr(pickle_scan, "MAX_SECONDS", 0.0)
    with pytest.raises(pickle_scan.PickleRefused, match="takes more than 0 s to check"):
        pickle_scan.scan(b"\x80\x04]" + b"N0" * 100_000 + b".")


def test_an_opcode_flood_costs_a_small_constant_per_opcode():
    """Measured against merely listing the opcodes with pickletools (what the deny-list's walk
    was built on, 2.6 us an opcode in the finding), in CPU time so a loaded machine does not
    count: the whole walk takes less than the listing alone, for the same 2M opcodes."""
    data = b"\x80\x04]" + b"N0" * 1_000_000 + b"."
    began = time.process_time()
    for _ in pickletools.genops(data):
        pass
    listing = time.process_time() - began
    began = time.process_time()
    pickle_scan.scan(data)
    assert time.process_time() - began < listing


def test_a_truncated_stream_or_bytes_are_no_pickle():
    with pytest.raises(pickle_scan.PickleRefused, match="not a readable pickle"):
        pickle_scan.scan(pickle.dumps({"a": 1})[:-4])
    with pytest.raises(pickle_scan.PickleRefused, match="not a readable pickle"):
        pickle_scan.scan(b"\x80\x04\xff.")
    stream = io.BytesIO(pickle.dumps(1, protocol=2) + pickle.dumps({"step": 3}, protocol=2))
    assert pickle_scan.scan(stream).step is None
    assert pickle_scan.scan(stream).step == 3  # the first walk left the stream after its STOP
