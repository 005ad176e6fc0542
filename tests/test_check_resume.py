"""`rtrain check-resume`: the comparison and the causes (tables), the worker's evidence (in this
process), and the command on real scripts (slow: each run is a process that imports torch)."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import blob, build_checkpoint
from harness import CHILDREN, REPO, invoke_rtrain
from torch import nn

import rtrain
from rtrain.checkpoint import manifest
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.supervisor.checkresume import causes as why
from rtrain.supervisor.checkresume.compare import Contents, Tensor, compare, read, tensor_difference
from rtrain.supervisor.core.protocol import ENV_CHECK_RESUME, ENV_CKPT_DIR
from rtrain.worker.checkresume import check_order

# ------------------------------------------------------------------ the comparison


def t(dtype: str, values, np_dtype) -> Tensor:
    a = np.asarray(values, np_dtype)
    return Tensor(dtype, a.shape, a.tobytes())


def test_same_bytes_are_identical_and_a_changed_float_says_by_how_much():
    a = t("F32", [1.0, 2.0, 3.0, 4.0], np.float32)
    assert tensor_difference(a, t("F32", [1.0, 2.0, 3.0, 4.0], np.float32)) is None
    how = tensor_difference(a, t("F32", [1.0, 2.0, 3.0, 4.5], np.float32))
    rel = 0.5 / np.linalg.norm([1, 2, 3, 4])
    assert how == f"max abs diff 0.5, relative L2 {rel:.3g} (1 of 4 elements)"


def test_bfloat16_integers_other_dtypes_and_same_values_in_other_bytes():
    bf = lambda xs: Tensor("BF16", (len(xs),), struct.pack(  # noqa: E731
        f"<{len(xs)}H", *(struct.unpack("<I", struct.pack("<f", x))[0] >> 16 for x in xs)))
    assert tensor_difference(bf([1.0, 2.0]), bf([1.0, 3.0])).startswith("max abs diff 1,")
    assert tensor_difference(t("I64", [5, 7], np.int64), t("I64", [5, 4], np.int64)) == \
        "1 of 2 elements differ, max abs diff 3"
    assert tensor_difference(Tensor("F8_E4M3", (2,), b"\x01\x02"),
                             Tensor("F8_E4M3", (2,), b"\x01\x03")) == "1 of 2 bytes differ"
    assert tensor_difference(t("F32", [0.0], np.float32), t("F32", [-0.0], np.float32)) == \
        "same values, other bytes (NaN payloads or signed zeros)"
    assert tensor_difference(t("F32", [0.0], np.float32), t("F64", [0.0], np.float64)) == \
        "F32 [1] vs F64 [1]"


def test_compare_lists_tensors_in_file_order_then_state_and_what_one_side_lacks():
    a = Contents(4, {"model.safetensors: w": t("F32", [1.0], np.float32),
                     "extra.safetensors: rng/torch_cpu": t("U8", [1, 2], np.uint8)},
                 {"state.json: sampler.position": 8, "state.json: lr": 0.1})
    b = Contents(4, {"model.safetensors: w": t("F32", [1.0], np.float32),
                     "extra.safetensors: rng/torch_cpu": t("U8", [1, 3], np.uint8),
                     "extra.safetensors: new": t("U8", [1], np.uint8)},
                 {"state.json: sampler.position": 16, "state.json: lr": 0.1})
    c = compare(a, b)
    assert c.compared == 5 and not c.identical
    assert [(d.name, d.how) for d in c.differences] == [
        ("extra.safetensors: rng/torch_cpu", "1 of 2 elements differ, max abs diff 1"),
        ("extra.safetensors: new", "only in the resumed run"),
        ("state.json: sampler.position", "8 vs 16")]
    assert compare(a, a).identical


def test_read_takes_a_committed_checkpoint_apart(tmp_path):
    tensors = {"model.safetensors": [blob("fc.weight", np.arange(6, dtype=np.float32)),
                                     blob("step", np.array(3, np.int64))]}
    a = read(build_checkpoint(tmp_path / "a", 3, tensors=tensors))
    assert a.step == 3
    assert set(a.tensors) == {"model.safetensors: fc.weight", "model.safetensors: step"}
    assert np.frombuffer(a.tensors["model.safetensors: fc.weight"].data, np.float32)[5] == 5.0
    assert a.state["state.json: step"] == 3 and a.state["manifest: samples_seen"] == 96
    b = read(build_checkpoint(tmp_path / "b", 3, tensors=tensors))
    assert compare(a, b).identical
    tensors["model.safetensors"][0] = blob("fc.weight", np.arange(6, dtype=np.float32) * 2)
    c = compare(a, read(build_checkpoint(tmp_path / "c", 3, tensors=tensors)))
    assert [d.name for d in c.differences] == ["model.safetensors: fc.weight"]


# ------------------------------------------------------------------ the causes

CAUSES = [
    # (evidence, the kinds named, in order)
    (why.Evidence(differs=False, moved_after_step={"torch": 3}), []),
    (why.Evidence(differs=True), [why.CauseKind.UNKNOWN]),
    (why.Evidence(differs=True, moved_after_step={"torch": 12}, first_moved_step=1),
     [why.CauseKind.DRAWN_AFTER_STEP]),
    (why.Evidence(differs=True, reproducible=False, moved_after_step={"data": 2}),
     [why.CauseKind.NOT_REPRODUCIBLE, why.CauseKind.DRAWN_AFTER_STEP]),
    (why.Evidence(differs=True, restored=False), [why.CauseKind.NOT_RESTORED]),
    (why.Evidence(differs=True, loaders_not_handed=("DataLoader: 3 of 10 batches taken",),
                  sampler_with_workers=True),
     [why.CauseKind.LOADER_NOT_HANDED, why.CauseKind.SAMPLER_WITH_WORKERS]),
    (why.Evidence(differs=True, reseeded=("train.py:9 torch.manual_seed",),
                  rng_modules=("2 (Dropout p=0.2)",)), [why.CauseKind.RESEEDED]),
    (why.Evidence(differs=True, rng_modules=("2 (Dropout p=0.2)",)),
     [why.CauseKind.DROPOUT_RNG]),
    # Dropout is not blamed when a cause that explains the difference was found.
    (why.Evidence(differs=True, rng_modules=("2 (Dropout p=0.2)",),
                  moved_after_step={"torch": 1}), [why.CauseKind.DRAWN_AFTER_STEP]),
    (why.Evidence(differs=True, device="cuda", cudnn_benchmark=True),
     [why.CauseKind.NONDETERMINISTIC]),
    (why.Evidence(differs=True, device="cuda", deterministic=True), [why.CauseKind.UNKNOWN]),
]


@pytest.mark.parametrize(("evidence", "kinds"), CAUSES)
def test_likely_causes(evidence, kinds):
    assert [c.kind for c in why.likely_causes(evidence)] == kinds


def test_the_reasons_name_what_was_seen():
    ev = why.Evidence(differs=True, moved_after_step={"torch": 12, "data": 12},
                      first_moved_step=1, reseeded=("train.py:9 torch.manual_seed",),
                      rng_modules=("2 (Dropout p=0.2)",))
    text = " | ".join(c.reason for c in why.likely_causes(ev))
    assert "torch's RNG and the loader (a batch taken) moved between optimizer.step() and " \
           "maybe_save() (from step 1)" in text
    assert "the RNG is seeded after ckpt.restore() (train.py:9 torch.manual_seed)" in text
    assert "2 (Dropout p=0.2) draw other masks" in text


def test_merge_takes_the_union_and_ignores_what_it_does_not_understand():
    ev = why.merge([{"moved_after_step": {"torch": 2}, "first_moved_step": 5,
                     "rng_modules": ["2 (Dropout p=0.2)"], "device": "cpu"},
                    {"moved_after_step": {"torch": 4, "data": "x"}, "first_moved_step": 3,
                     "reseeded": ["a.py:1 torch.seed"], "device": "cuda"},
                    None, "junk", {"loaders_not_handed": "not a list"}],
                   differs=True, reproducible=None, restored=True)
    assert ev.moved_after_step == {"torch": 4} and ev.first_moved_step == 3
    assert ev.reseeded == ("a.py:1 torch.seed",) and ev.rng_modules == ("2 (Dropout p=0.2)",)
    assert ev.device == "cuda" and ev.loaders_not_handed == ()


# ------------------------------------------------------------------ the worker's evidence


@pytest.mark.parametrize("value", ['{"stop_at": 3}', '{"stop": "kill"}', "[1]",
                                   '{"stop_at": -1, "stop": "kill"}',
                                   '{"stop_at": 2, "stop": "nap"}', '{"entropy": -1}',
                                   '{"entropy": "7"}'])
def test_a_bad_order_is_refused(monkeypatch, value):
    monkeypatch.setenv(ENV_CHECK_RESUME, value)
    with pytest.raises(ValueError, match=ENV_CHECK_RESUME):
        check_order.plan()


def test_the_original_runs_share_their_entropy_and_a_resumed_run_draws_its_own(tmp_path):
    from rtrain.supervisor.checkresume.check import Options, command

    opts = Options("train.py", args=("--out", "{ckpt_dir}"), settings={"steps": 8},
                   python="py")
    caller = {"PATH": "/bin", "RTRAIN_FAULTS": "kill@3", "RTRAIN_SIGNING_KEY": "k"}
    orders = {}
    for run, order, resume_from in [("straight", None, None),
                                    ("kill", {"stop_at": 4, "stop": "kill"}, None),
                                    ("resumed", None, tmp_path / "kill" / "checkpoint-4")]:
        argv, env = command(opts, tmp_path / run, caller, order=order, resume_from=resume_from)
        assert argv == ["py", "train.py", "--out", str(tmp_path / run / "checkpoints")]
        assert "RTRAIN_FAULTS" not in env and env["RTRAIN_SIGNING_KEY"] == "k"
        orders[run] = (json.loads(env[ENV_CHECK_RESUME]), env.get("PYTHONHASHSEED"))
    (straight, seed), (kill, kill_seed), (resumed, resumed_seed) = orders.values()
    assert straight["entropy"] == kill["entropy"] and seed == kill_seed == str(kill["entropy"])
    assert kill["stop_at"] == 4 and kill["stop"] == "kill"
    assert resumed == {} and resumed_seed is None
    # The caller's own hash seed holds for every run.
    _, env = command(opts, tmp_path / "straight", {**caller, "PYTHONHASHSEED": "0"})
    assert env["PYTHONHASHSEED"] == "0"


def test_the_entropy_seeds_python_and_numpy_and_nothing_without_it(monkeypatch):
    saved = random.getstate(), np.random.get_state()
    try:
        py, npy = random.Random(11), np.random.RandomState(11)
        monkeypatch.setenv(ENV_CHECK_RESUME, '{"entropy": 11}')
        check_order.seed_entropy()
        assert (random.random(), np.random.random()) == (py.random(), npy.random())
        for value in ("{}", '{"entropy": "bad"}'):  # no entropy: the generators go on
            monkeypatch.setenv(ENV_CHECK_RESUME, value)
            check_order.seed_entropy()
            assert (random.random(), np.random.random()) == (py.random(), npy.random())
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])


def _train(ckpt_dir, steps, *, prefetch, start_seed=None):
    """The loop of tests/children/resume_order.py, in this process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.25), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = rtrain.Checkpointer(model=model, optimizer=opt, every=2)
    step = ckpt.restore()
    if start_seed is not None:
        torch.manual_seed(start_seed)
    x = torch.randn(3, 4)
    while step < steps:
        if not prefetch:
            x = torch.randn(3, 4)
        model(x).pow(2).mean().backward()
        opt.step()
        if prefetch:
            x = torch.randn(3, 4)
        step += 1
        ckpt.maybe_save(step)
    ckpt.close()
    step, path = list_checkpoints(ckpt_dir)[0]
    return step, manifest.load(path)["info"]["check_resume"]


@pytest.mark.usefixtures("unsupervised")
def test_the_worker_records_a_batch_drawn_after_the_optimizer_step(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CHECK_RESUME, "{}")
    monkeypatch.setenv(ENV_CKPT_DIR, str(tmp_path / "right"))
    step, ev = _train(tmp_path / "right", 5, prefetch=False)
    assert step == 5  # close() saved the last step, off the every-2 schedule
    assert ev["moved_after_step"] == {} and ev["boundaries"] == 5
    assert ev["rng_modules"] == ["1 (Dropout p=0.25)"] and ev["device"] == "cpu"
    assert ev["restored_step"] is None and ev["stopped"] is None
    monkeypatch.setenv(ENV_CKPT_DIR, str(tmp_path / "prefetch"))
    step, ev = _train(tmp_path / "prefetch", 5, prefetch=True)
    assert ev["moved_after_step"] == {"torch": 5} and ev["first_moved_step"] == 1


@pytest.mark.usefixtures("unsupervised")
def test_the_worker_records_seeding_after_a_restore(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CHECK_RESUME, "{}")
    monkeypatch.setenv(ENV_CKPT_DIR, str(tmp_path))
    _, ev = _train(tmp_path, 3, prefetch=False, start_seed=7)
    assert ev["reseeded"] == []  # a fresh start may seed: nothing was restored
    step, ev = _train(tmp_path, 6, prefetch=False, start_seed=7)
    assert step == 6 and ev["restored_step"] == 3
    assert len(ev["reseeded"]) == 1
    assert ev["reseeded"][0].startswith("test_check_resume.py:")
    assert ev["reseeded"][0].endswith(" torch.manual_seed")


@pytest.mark.usefixtures("unsupervised")
def test_a_checkpointer_writing_elsewhere_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CHECK_RESUME, "{}")
    monkeypatch.setenv(ENV_CKPT_DIR, str(tmp_path / "given"))
    with pytest.raises(Exception, match="RTRAIN_CKPT_DIR"):
        rtrain.Checkpointer(model=nn.Linear(2, 2), ckpt_dir=tmp_path / "own")


def test_usage_errors_exit_2_in_one_line(tmp_path):
    r = invoke_rtrain("check-resume", "no_such.py", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == "rtrain: error: no_such.py: no such script\n"
    (tmp_path / "t.py").write_text("")
    r = invoke_rtrain("check-resume", "t.py", "--at", "0", cwd=tmp_path)
    assert r.returncode == 2 and "--at 0" in r.stderr and "Traceback" not in r.stderr


def test_the_cli_hands_over_the_script_its_arguments_and_the_settings(tmp_path, monkeypatch):
    from rtrain.supervisor.checkresume import check as cr

    seen = []

    def fake(opts, say):
        seen.append(opts)
        return cr.Report(opts.script, 10, (), None, (), tmp_path, False)

    monkeypatch.setattr(cr, "check_resume", fake)
    (tmp_path / "rtrain.toml").write_text("[settings]\nbatch_size = 8\nsteps = 100\n")
    r = invoke_rtrain("check-resume", "train.py", "--at", "4", "--stop", "signal", "--set",
                      "steps=10", "--", "--lr", "0.1", "--out", "{ckpt_dir}", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == "check-resume train.py: uninterrupted to step 10\n" \
        "resumes exactly\n"
    [o] = seen
    assert (o.script, o.args, o.at, o.stops) == ("train.py", ("--lr", "0.1", "--out",
                                                             "{ckpt_dir}"), 4, ("signal",))
    assert o.settings == {"batch_size": 8, "steps": 10} and o.cwd == tmp_path


# ------------------------------------------------------------------ the command, real runs


def check(*args, cwd=REPO, tmp=None, timeout=120):
    """`rtrain check-resume ARGS`; a work dir it makes goes under `tmp` (TMPDIR), not the
    machine's temp dir."""
    from harness import run_rtrain

    env = {"TMPDIR": str(tmp)} if tmp is not None else None
    return run_rtrain("check-resume", *args, cwd=cwd, env=env, timeout=timeout)


@pytest.mark.slow
def test_check_resume_says_the_vision_example_resumes_exactly(tmp_path):
    work = tmp_path / "work"
    r = check("examples/vision/train.py", "--config", "examples/vision/rtrain.toml",
              "--set", "steps=10", "--set", "samples=256", "--set", "batch_size=8",
              "--set", "resolution=16", "--set", "save_every=3", "--set", "log_every=100",
              "--work-dir", str(work))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stopped at step 5 by a save, then SIGKILL, resumed to the end: identical" in r.stdout
    assert "stopped at step 5 by SIGTERM (save, exit 75), resumed to the end: identical" \
        in r.stdout
    assert r.stdout.rstrip().endswith(f"resumes exactly\nwork dir kept: {work} (each run's "
                                      "logs and checkpoints)")
    # The runs were what they say: each resumed run restored step 5 and ended at step 10.
    for stop in ("kill", "signal"):
        step, path = list_checkpoints(work / stop / "checkpoints")[0]
        assert step == 10
        assert manifest.load(path)["info"]["check_resume"]["restored_step"] == 5
    assert "resumed at step 5" in (work / "signal" / "resume.log").read_text()


@pytest.mark.slow
@pytest.mark.soak  # check-resume end to end: the vision example's test; the causes: unit tests
def test_a_prefetched_batch_is_named(tmp_path):
    r = check(str(CHILDREN / "resume_order.py"), "--stop", "kill", "--json", "--",
              "--prefetch", cwd=tmp_path, tmp=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["exact"] is False and out["reproducible"] is True
    [stop] = out["stops"]
    assert stop["stop_step"] == 6 and stop["differences"][0]["name"].startswith(
        "model.safetensors: ")
    assert [c["kind"] for c in out["causes"]] == ["drawn_after_step"]
    assert "torch's RNG moved between optimizer.step() and maybe_save()" in \
        out["causes"][0]["reason"]
    kept = Path(out["work_dir"])  # kept, to look at: every run's checkpoints and logs
    assert kept.parent == tmp_path and (kept / "kill" / "stop.log").is_file()
    assert sorted(p.name for p in kept.iterdir()) == ["kill", "repeat", "straight"]


@pytest.mark.slow
@pytest.mark.soak  # a named cause is the default tier's with the prefetch
def test_dropout_with_the_rng_seeded_after_restore_names_the_rng(tmp_path):
    r = check(str(CHILDREN / "resume_order.py"), "--stop", "signal", "--", "--reseed",
              cwd=tmp_path, tmp=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "stopped at step 6 by SIGTERM (save, exit 75), resumed to the end: " in r.stdout
    assert "does not resume exactly; likely causes:\n  - the RNG is seeded after " \
           "ckpt.restore() (resume_order.py:37 torch.manual_seed)" in r.stdout
    assert "the model's 2 (Dropout p=0.2) draw other masks" in r.stdout
    assert "second uninterrupted run: identical to the first" in r.stdout


@pytest.mark.slow
def test_a_script_without_the_worker_library_is_one_line_exit_2(tmp_path):
    (tmp_path / "plain.py").write_text("print('training without rtrain')\n")
    r = check("plain.py", cwd=tmp_path, tmp=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    [line] = [ln for ln in r.stderr.splitlines() if ln.startswith("rtrain: error:")]
    assert "saved no checkpoint where check-resume asked (RTRAIN_CKPT_DIR): the script must " \
           "use rtrain.Checkpointer" in line
