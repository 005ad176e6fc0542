"""A checkpoint whose files hash right but whose state.json is malformed (a field missing, a
value of the wrong type: a hand edit with its hash recomputed, another version's layout): the
schema check names it (`checkpoint/state_schema.py`), full verification reports it corrupt, a
restore run by hand falls back to the checkpoint before, and under rtrain the worker reports
`bad_checkpoint` so the next attempt resumes from the one before. A failure while applying a
checkpoint that passed the schema is a bad checkpoint too; one that does not fit the model
stays what it was."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hostile import relist

import rtrain
from rtrain.checkpoint import state_schema as schema
from rtrain.checkpoint.verify import Level, Status, verify
from rtrain.supervisor.ckpt import foreign
from rtrain.supervisor.commands.inspecting import inspect_dir
from rtrain.supervisor.core.errors import CorruptCheckpoint, ExitCode, StateMismatch

pytestmark = pytest.mark.usefixtures("unsupervised")


def _parts(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    sampler = rtrain.ResumableSampler(10, seed=3)
    return model, opt, sched, sampler


def _checkpointer(ckpt_dir, parts, verify="full"):
    model, opt, sched, sampler = parts
    return rtrain.Checkpointer(model=model, optimizer=opt, scheduler=sched, loader=sampler,
                               ckpt_dir=ckpt_dir, keep=None,
                               restoring=rtrain.Restoring(verify=verify))


def _train_and_save(ckpt_dir, steps=(1, 2)):
    parts = _parts()
    model, opt, sched, _ = parts
    ck = _checkpointer(ckpt_dir, parts)
    weights = {}
    for step in steps:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
        ck.save(step, extra={"note": "kept", "t": torch.arange(3)})
        weights[step] = model.weight.detach().clone()
    ck.close()
    return weights


def _state(ckpt) -> dict:
    return json.loads((ckpt / "state.json").read_text())


def _edit_state(ckpt, edit) -> None:
    """Change state.json and recompute its hash in the manifest, as anyone who can write the
    dir can: the checkpoint verifies at every level but its content is malformed."""
    st = _state(ckpt)
    edit(st)
    relist(ckpt, "state.json", json.dumps(st).encode())


@pytest.fixture
def saved(tmp_path):
    ckpts = tmp_path / "ckpt"
    return ckpts, _train_and_save(ckpts)


# ---------------------------------------------------------------- the schema, as a table


def test_what_the_worker_writes_passes_the_schema(saved):
    ckpts, _ = saved
    newest = ckpts / "checkpoint-2"
    st = _state(newest)
    assert {"rng", "optimizer", "scheduler", "sampler", "extra"} <= st.keys()
    m = json.loads((newest / "manifest.json").read_text())
    assert schema.problems(st, step=2, extra_tensors=set(m["tensors"]["extra.safetensors"]),
                           optimizer_tensors=set(m["tensors"]["optimizer.safetensors"])) == []


def _drop(*path):
    def edit(st):
        for key in path[:-1]:
            st = st[key]
        del st[path[-1]]
    return edit


def _set(value, *path):
    def edit(st):
        for key in path[:-1]:
            st = st[key]
        st[path[-1]] = value
    return edit


CASES = [
    ("rng emptied", _set({}, "rng"), "field 'rng.python' is missing"),
    ("numpy words cut", lambda st: st["rng"]["numpy"][1].pop(), "'rng.numpy' is not numpy"),
    ("python state a string", _set("x", "rng", "python"), "'rng.python' is not python"),
    ("step missing", _drop("step"), "field 'step' is missing"),
    ("step of another checkpoint", _set(7, "step"), "the manifest's step is 2"),
    ("epoch negative", _set(-1, "epoch"), "field 'epoch' is -1"),
    ("lr_scale a string", _set("1", "lr_scale"), "field 'lr_scale'"),
    ("position a string", _set("3", "sampler", "position"), "field 'sampler.position' is '3'"),
    ("shuffle a number", _set(1, "sampler", "shuffle"), "'sampler.shuffle' is 1"),
    ("sampler field missing", _drop("sampler", "samples_seen"),
     "'sampler.samples_seen' is missing"),
    ("param groups a map", _set({}, "optimizer", "param_groups"), "'optimizer.param_groups'"),
    ("plain state missing", _drop("optimizer", "plain_state"),
     "'optimizer.plain_state' is missing"),
    ("scheduler a list", _set([1], "scheduler"), "field 'scheduler' is [1], not a map"),
    ("loader of no known kind", _set({"kind": "x"}, "loader"), "'loader.kind'"),
    ("a dangling tensor reference", _set({"__tensor__": "gone#9"}, "extra"),
     "refers to tensor 'gone#9'"),
    ("a tuple tag not a list", _set({"__tuple__": 3}, "extra"), "a tuple that is not a list"),
    ("a float tag not a number", _set({"__float__": "abc"}, "scheduler"), "float tag"),
    ("not an object", None, "is not a JSON object"),
]


@pytest.mark.parametrize("name,edit,expected", CASES, ids=[c[0] for c in CASES])
def test_each_malformed_field_is_named(saved, name, edit, expected):
    ckpts, _ = saved
    newest = ckpts / "checkpoint-2"
    m = json.loads((newest / "manifest.json").read_text())
    st = copy.deepcopy(_state(newest))
    if edit is None:
        st = [st]
    else:
        edit(st)
    with pytest.raises(schema.StateSchemaError, match=r"^state\.json ") as e:
        schema.check(st, step=2, extra_tensors=set(m["tensors"]["extra.safetensors"]),
                     optimizer_tensors=set(m["tensors"]["optimizer.safetensors"]))
    assert expected in str(e.value)


def test_unknown_fields_and_optional_ones_are_allowed():
    assert schema.problems({"step": 3}, step=3) == []
    assert schema.problems({"step": 3, "added_by_a_newer_rtrain": {"x": 1}, "scaler": {}}) == []
    assert len(schema.problems({"step": True})) == 1  # a bool is not a step


# ---------------------------------------------------------------- verification and inspect


def test_full_verification_and_inspect_report_a_malformed_state_json(saved):
    ckpts, _ = saved
    newest = ckpts / "checkpoint-2"
    _edit_state(newest, _set({}, "rng"))
    assert verify(newest, Level.QUICK).ok  # sizes and names: the file is listed as it is
    v = verify(newest, Level.FULL)
    assert v.status is Status.CORRUPT and "field 'rng.python' is missing" in v.reason
    report = inspect_dir(ckpts, verify=Level.FULL)
    assert [(e.verdict.path.name, e.verdict.ok) for e in report.entries] == [
        ("checkpoint-2", False), ("checkpoint-1", True)]
    assert report.resume.verdict.path.name == "checkpoint-1"
    # The launch's pick passes over it too, with the reason.
    sel = foreign.select_resume_any_format(ckpts, Level.FULL)
    assert sel.chosen.path.name == "checkpoint-1"
    assert "rng.python" in sel.skipped[0].reason


# ---------------------------------------------------------------- restore


@pytest.mark.parametrize("level", ["quick", "full"])
def test_run_by_hand_a_malformed_newest_is_skipped_for_the_one_before(saved, level, caplog):
    ckpts, weights = saved
    _edit_state(ckpts / "checkpoint-2", _set({}, "rng"))
    parts = _parts(seed=5)
    assert _checkpointer(ckpts, parts, verify=level).restore() == 1
    assert torch.equal(parts[0].weight, weights[1])
    assert "skipping checkpoint-2" in caplog.text and "rng.python" in caplog.text


def _under_rtrain(monkeypatch, tmp_path, chosen):
    status = tmp_path / "attempt"
    status.mkdir()
    monkeypatch.setenv("RTRAIN_RESUME_FROM", str(chosen))
    monkeypatch.setenv("RTRAIN_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RTRAIN_STATUS", str(status))
    return status


@pytest.mark.parametrize("edit,reason", [
    (_set({}, "rng"), "field 'rng.python' is missing"),
    (_set("3", "sampler", "position"), "field 'sampler.position'"),
    # Passes the schema (a scheduler's state is the scheduler's business), refused by
    # LambdaLR.load_state_dict while applying: a bad checkpoint, not a start-up failure.
    (_set(5, "scheduler", "lr_lambdas"), "cannot apply: TypeError"),
])
def test_under_rtrain_a_malformed_checkpoint_is_a_bad_checkpoint(saved, tmp_path, monkeypatch,
                                                                  edit, reason):
    ckpts, _ = saved
    bad = ckpts / "checkpoint-2"
    _edit_state(bad, edit)
    status = _under_rtrain(monkeypatch, tmp_path, bad)
    with pytest.raises(SystemExit) as e:
        _checkpointer(ckpts, _parts(seed=5)).restore()
    assert e.value.code == ExitCode.BAD_CHECKPOINT
    rec = json.loads((status / "exit-rank0.json").read_text())
    assert rec["kind"] == "bad_checkpoint" and rec["extra"]["checkpoint"] == str(bad)
    assert rec["reason"].startswith("checkpoint-2: cannot ") and reason in rec["reason"]


def test_an_apply_failure_by_hand_is_a_corrupt_checkpoint_with_the_reason(saved):
    ckpts, _ = saved
    _edit_state(ckpts / "checkpoint-2", _set(5, "scheduler", "lr_lambdas"))
    with pytest.raises(CorruptCheckpoint, match="cannot apply: TypeError"):
        _checkpointer(ckpts, _parts(seed=5)).restore(ckpts / "checkpoint-2")


def test_a_checkpoint_that_does_not_fit_the_data_stays_a_mismatch(saved, tmp_path, monkeypatch):
    """Another dataset size is the run's fault, not the checkpoint's: an older one would not
    fit either, so it is not skipped for it (a start-up failure, as a model that does not fit)."""
    ckpts, _ = saved
    _under_rtrain(monkeypatch, tmp_path, ckpts / "checkpoint-2")
    model, opt, sched, _ = _parts(seed=5)
    other = (model, opt, sched, rtrain.ResumableSampler(11, seed=3))
    with pytest.raises(StateMismatch, match="the dataset has 11 samples") as e:
        _checkpointer(ckpts, other).restore()
    assert isinstance(e.value, ValueError)  # what callers caught before
    assert not (tmp_path / "attempt" / "exit-rank0.json").exists()
