"""The Checkpointer's arguments: the option groups, the old spellings (each still works, with a
DeprecationWarning naming the new one), and the reference that help() and the README show."""

import dataclasses
import importlib.util
import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import worker
from worker import legacy_args, options, runtime
from worker.checkpointer import Checkpointer
from worker.options import Every, Keep, Restoring, Saving

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("unsupervised")


def settings_of(ck):
    return ck.every, ck.keep, ck.saving, ck.restoring


def built(tmp_path, **kwargs):
    """A Checkpointer and the warnings its construction gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ck = Checkpointer(ckpt_dir=tmp_path, **kwargs)
    return ck, [w for w in seen if issubclass(w.category, DeprecationWarning)]


# old keyword arguments -> the same settings in the new shape, and what the warning names
OLD_AND_NEW = [
    ({"every_steps": 10}, {"every": 10}, "every="),
    ({"every_steps": "auto"}, {"every": "auto"}, "every="),
    ({"every_steps": "auto", "every_seconds": 60}, {"every": Every(steps="auto", seconds=60)},
     "every=Every(seconds="),
    ({"every_steps": worker.CadenceBounds(min_steps=5, max_steps=50)},
     {"every": Every(steps="auto", min_steps=5, max_steps=50)}, "every="),
    ({"every_steps": worker.CadenceBounds(max_seconds=90)},
     {"every": Every(steps="auto", seconds=90)}, "every="),
    ({"every_seconds": 30}, {"every": Every(seconds=30)}, "every=Every(seconds="),
    ({"every_steps": 5, "on_epoch_end": True}, {"every": Every(steps=5, epoch_end=True)},
     "every=Every(epoch_end="),
    ({"every_steps": "auto", "total_steps": 400},
     {"every": Every(steps="auto", total_steps=400)}, "every=Every(total_steps="),
    ({"keep_best": 2, "metric": "loss"}, {"keep": Keep(best=2, metric="loss")},
     "keep=Keep(best="),
    ({"keep": 5, "keep_best": 1, "metric": "acc", "mode": "max"},
     {"keep": Keep(last=5, best=1, metric="acc", mode="max")}, "keep=Keep(mode="),
    ({"milestone_every": 100}, {"keep": Keep(milestone_every=100)},
     "keep=Keep(milestone_every="),
    ({"async_save": True}, {"saving": Saving(async_mode="auto")},
     "saving=Saving(async_mode='auto')"),
    ({"async_save": True, "async_mode": "thread"}, {"saving": Saving(async_mode="thread")},
     "saving=Saving(async_mode='thread')"),
    ({"async_save": False, "async_mode": "fork"}, {"saving": Saving(async_mode="off")},
     "saving=Saving(async_mode='off')"),
    ({"fsync": False}, {"saving": Saving(fsync=False)}, "saving=Saving(fsync="),
    ({"sharded": False}, {"saving": Saving(sharded=False)}, "saving=Saving(sharded="),
    ({"trainable_only": True}, {"saving": Saving(trainable_only=True)},
     "saving=Saving(trainable_only="),
    ({"save_on_failure": False}, {"saving": Saving(on_failure=False)},
     "saving=Saving(on_failure="),
    ({"failure_save_timeout_s": 9.0}, {"saving": Saving(failure_timeout_s=9.0)},
     "saving=Saving(failure_timeout_s="),
    ({"verify_level": "quick"}, {"restoring": Restoring(verify="quick")},
     "restoring=Restoring(verify="),
    ({"map_location": "meta"}, {"restoring": Restoring(map_location="meta")},
     "restoring=Restoring(map_location="),
    ({"allow_resize": True}, {"restoring": Restoring(allow_resize=True)},
     "restoring=Restoring(allow_resize="),
    ({"allow_pickle": True}, {"restoring": Restoring(allow_pickle=True)},
     "restoring=Restoring(allow_pickle="),
]


@pytest.mark.parametrize("old,new,names", OLD_AND_NEW,
                         ids=[",".join(o) for o, _, _ in OLD_AND_NEW])
def test_an_old_keyword_still_works_and_names_its_new_spelling(tmp_path, old, new, names):
    ck_old, warned = built(tmp_path, **old)
    ck_new, none = built(tmp_path, **new)
    assert settings_of(ck_old) == settings_of(ck_new)
    assert ck_old.schedule == ck_new.schedule
    assert not none
    said = [str(w.message) for w in warned]
    deprecated = set(old) & legacy_args.KNOWN
    assert len(said) == len(deprecated) - ({"async_mode", "async_save"} <= deprecated)
    assert all("deprecated" in s for s in said)
    assert any(names in s for s in said), said
    assert all(w.filename == __file__ for w in warned)  # the warning points at the caller


def test_every_old_keyword_is_in_the_table():
    tried = {name for old, _, _ in OLD_AND_NEW for name in old} | {"keep", "sampler",
                                                                     "on_pressure"}
    assert tried >= legacy_args.KNOWN


def test_sampler_becomes_loader_and_resumes_its_position(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    old_sampler = worker.ResumableSampler(10, seed=3)
    ck_old, warned = built(tmp_path / "a", model=model, sampler=old_sampler)
    assert "loader=" in str(warned[0].message)
    it = iter(old_sampler)
    taken = [next(it) for _ in range(4)]
    ck_old.save(1)
    new_sampler = worker.ResumableSampler(10, seed=3)
    ck_new, none = built(tmp_path / "a", model=model, loader=new_sampler)
    assert not none and ck_new.sampler is new_sampler
    assert ck_new.restore() == 1
    assert list(new_sampler) == list(worker.ResumableSampler(10, seed=3))[len(taken):]


def test_sampler_and_loader_naming_two_samplers_is_refused(tmp_path):
    with pytest.raises(ValueError, match="pass only loader="):
        built(tmp_path, loader=worker.ResumableSampler(4, seed=0),
              sampler=worker.ResumableSampler(4, seed=0))


def test_on_pressure_keyword_registers_the_callback(tmp_path):
    calls = []

    def shrink():
        calls.append(1)
        return "shrank"

    _, warned = built(tmp_path, on_pressure=shrink)
    assert "worker.on_pressure(callback)" in str(warned[0].message)
    runtime._state.relieve.set()
    assert "shrank" in runtime.relieve_pressure(step=1)
    assert calls == [1]


@pytest.mark.parametrize("kwargs,message", [
    ({"fsync": False, "saving": Saving()}, "saving= and the old fsync="),
    ({"verify_level": "quick", "restoring": Restoring()}, "restoring= and the old verify_level="),
    ({"keep_best": 1, "metric": "loss", "keep": Keep()}, "keep= and the old"),
    ({"every_seconds": 5, "every": Every(steps=3)}, "every= and the old every_seconds="),
    ({"every_steps": 5, "every": 10}, "every= and the old every_steps="),
    ({"no_such_option": 1}, "unexpected keyword argument 'no_such_option'"),
    ({"every": worker.CadenceBounds()}, "Every(steps='auto'"),
    ({"every": 2.5}, "every= takes a number of steps"),
    ({"keep": "all"}, "keep= takes a number"),
    ({"saving": Restoring()}, "saving= takes a Saving"),
])
def test_saying_one_thing_two_ways_or_wrongly_is_a_type_error(tmp_path, kwargs, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        built(tmp_path, **kwargs)


@pytest.mark.parametrize("make,message", [
    (lambda: Every(steps=0), "Every(steps=)"),
    (lambda: Every(steps=True), "Every(steps=)"),
    (lambda: Every(steps=10, max_steps=20), "bound steps='auto'"),
    (lambda: Every(steps="auto", min_steps=5, max_steps=2), "max_steps (2) must be at least"),
    (lambda: Every(seconds=0), "Every(seconds=)"),
    (lambda: Every(total_steps=0), "Every(total_steps=)"),
    (lambda: Keep(last=0), "keep must be at least 1"),
    (lambda: Keep(best=2), "keep_best needs a metric"),
    (lambda: Saving(async_mode="yes"), "Saving(async_mode=)"),
    (lambda: Saving(failure_timeout_s=0), "Saving(failure_timeout_s=)"),
    (lambda: Restoring(verify="some"), "Restoring(verify=)"),
])
def test_an_option_group_refuses_a_bad_value_where_it_is_built(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_the_common_case_takes_no_option_group(tmp_path):
    ck, warned = built(tmp_path, model=nn.Linear(2, 2), every=50)
    assert not warned
    assert (ck.keep, ck.saving, ck.restoring) == (Keep(), Saving(), Restoring())
    assert ck.schedule.every_steps == 50


def test_async_mode_set_in_saving_saves_in_the_background(tmp_path):
    model = nn.Linear(3, 3)
    ck, _ = built(tmp_path, model=model, saving=Saving(async_mode="thread"))
    ck.save(1)
    assert ck._bg._thread is not None  # written by the background thread
    ck.close()
    assert (tmp_path / "checkpoint-1" / "manifest.json").exists()


# --- the reference -------------------------------------------------------------------------


def documented_args(doc: str) -> dict[str, str]:
    section = doc.split("\nArgs:\n", 1)[1]
    entries: dict[str, str] = {}
    for line in section.splitlines():
        m = re.match(r"    (\w+): ", line)
        if m:
            entries[m.group(1)] = line
        elif line and not line.startswith("        "):
            break
    return entries


def test_every_argument_is_in_the_reference_and_nothing_else():
    doc = inspect.getdoc(Checkpointer)
    params = [p for p in inspect.signature(Checkpointer.__init__).parameters.values()
              if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert list(documented_args(doc)) == [p.name for p in params]
    assert len(params) <= 13  # about a dozen: new settings go into the groups


def fields_documented(cls: type) -> dict[str, str]:
    """The "Attributes:" section of an option class's docstring: name -> its text."""
    doc = inspect.getdoc(cls) or ""
    if "Attributes:\n" not in doc:
        return {}
    entries: dict[str, str] = {}
    name = None
    for line in doc.split("Attributes:\n", 1)[1].splitlines():
        if line.startswith("    ") and not line.startswith("        ") and ":" in line:
            name, text = line.strip().split(":", 1)
            entries[name] = text.strip()
        elif line.startswith("        ") and name is not None:
            entries[name] += " " + line.strip()
        elif line.strip():
            break
    return entries


@pytest.mark.parametrize("cls", options.GROUPS, ids=lambda c: c.__name__)
def test_every_option_field_is_in_its_reference(cls):
    assert list(fields_documented(cls)) == [f.name for f in dataclasses.fields(cls)]
    assert f"\n{cls.__name__}(" in inspect.getdoc(Checkpointer)  # help() shows the group
    assert cls.__name__ in worker.__all__


def test_the_readme_reference_is_the_docstring():
    spec = importlib.util.spec_from_file_location("reference",
                                                  ROOT / "scripts/checkpointer_reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    readme = (ROOT / "README.md").read_text()
    assert reference.replaced(readme, reference.render()) == readme, (
        "README.md's Checkpointer reference is out of date: run "
        "python scripts/checkpointer_reference.py --write")
