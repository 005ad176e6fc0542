"""An out-of-memory failure mid-epoch under `rtrain launch`, with DataLoader workers: the relaunch
runs at half the batch size and twice the accumulation, and the samples trained on are still the
sampler's stream, each once, in order (the position is kept in samples, counted as consumed)."""

import pytest
from chaos_util import launch_chaos, starts, step_log, surviving, write_config
from harness import events

import rtrain

SETTINGS = {"batch_size": 8, "grad_accum": 1, "steps": 14, "samples": 64, "save_every": 3,
            "workers": 2}


@pytest.mark.slow
@pytest.mark.soak  # test_data_workers resumes mid-epoch with workers in the default tier
def test_oom_mid_epoch_with_workers_keeps_the_sample_stream(tmp_path):
    write_config(tmp_path / "rtrain.toml", SETTINGS)
    run = tmp_path / "run"
    # Dies at step 10; the newest checkpoint is step 9: sample 72, mid-way through epoch 1.
    r = launch_chaos(run, faults="oom@step=10,batch_size>4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [c["failure"] for c in events(run, "classification")] == ["oom_gpu"]
    sizes = [(e["settings"]["batch_size"], e["settings"]["grad_accum"])
             for e in events(run, "launch")]
    assert sizes == [(8, 1), (4, 2)]
    log = step_log(run)
    assert [s["start"] for s in starts(log)] == [0, 9]

    traj = surviving(log)
    assert sorted(traj) == list(range(1, 15))
    assert all((traj[s]["bs"], traj[s]["accum"]) == ((8, 1) if s <= 9 else (4, 2))
               for s in traj)
    stream = [i for s in range(1, 15) for i in traj[s]["ids"]]
    expected = []
    for epoch in range(2):  # the order a fresh sampler hands out, epoch after epoch
        sampler = rtrain.ResumableSampler(64, seed=7)
        sampler.set_epoch(epoch)
        expected += [int(i) for i in sampler]
    expected = expected[:len(stream)]
    assert stream == expected
    assert [traj[s]["first"] for s in range(1, 15)] == [8 * (s - 1) for s in range(1, 15)]
