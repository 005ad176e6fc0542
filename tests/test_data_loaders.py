"""torchdata's StatefulDataLoader (state stored without pickle) and IterableDatasets (their own
state_dict, or fast-forward with a warning) resume bitwise-exact with worker sharding."""

import json

import pytest
from data_split import split_vs_whole, whole

pytest.importorskip("torchdata.stateful_dataloader")


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "deaths"), [
    pytest.param("0", (5, 13), marks=pytest.mark.soak, id="0"),
    pytest.param("2", (5, 13), marks=pytest.mark.soak, id="2"),
    pytest.param("2", (5,), id="2-mid-epoch"),  # the default tier's: one resume, mid-epoch
])
def test_stateful_dataloader_map_style(tmp_path, workers, deaths):
    # One uninterrupted run for every map-style case: the worker count changes no value.
    reference = whole(["--loader", "stateful", "--workers", "0"])
    assert split_vs_whole(tmp_path, ["--loader", "stateful", "--workers", workers],
                          deaths, reference=reference) is None
    # Its state is in state.json (tensors, if any, in extra.safetensors): nothing pickled.
    (ckpt,) = sorted((tmp_path / "split").glob("checkpoint-*"))[-1:]
    state = json.loads((ckpt / "state.json").read_text())
    assert state["loader"]["kind"] == "stateful_dataloader"
    assert not [p for p in ckpt.iterdir() if p.suffix in (".pt", ".pkl", ".bin")]


@pytest.mark.slow
@pytest.mark.soak  # the loader matrix
def test_stateful_dataloader_iterable_with_own_state_and_sharding(tmp_path):
    args = ["--loader", "stateful", "--data", "stream", "--workers", "2"]
    assert split_vs_whole(tmp_path, args, (5, 13)) is None


@pytest.mark.slow
@pytest.mark.soak  # an iterable resumed exactly: test_iterable_fast_forward_with_sharding_warns
def test_iterable_with_own_state_no_workers(tmp_path):
    assert split_vs_whole(tmp_path, ["--data", "stream", "--workers", "0"], (5, 13)) is None
    state = json.loads((tmp_path / "split" / "checkpoint-18" / "state.json").read_text())
    assert "dataset" in state["loader"]


@pytest.mark.slow
def test_iterable_fast_forward_with_sharding_warns(tmp_path):
    runs = []
    assert split_vs_whole(tmp_path, ["--data", "iterable", "--workers", "2"], (5,),
                          runs=runs) is None
    # The second process resumed from checkpoint-3 (mid-epoch): three batches read again and
    # dropped, and said so; three epoch ends followed in it.
    assert "skipped the 3 batches consumed before the checkpoint" in runs[1].stderr
