"""The Checkpointer's arguments: the option groups (one spelling for each setting; rtrain 0.1's
keyword arguments are refused like any unknown name), and the reference that help() and
docs/reference.md show."""

import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
from torch import nn

import rtrain
from rtrain.worker import options
from rtrain.worker.checkpointer import Checkpointer
from rtrain.worker.options import Every, Keep, Restoring, Saving

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("unsupervised")


def built(tmp_path, **kwargs):
    return Checkpointer(ckpt_dir=tmp_path, **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    ({"no_such_option": 1}, "unexpected keyword argument 'no_such_option'"),
    ({"every": 2.5}, "every= takes a number of steps"),
    ({"keep": "all"}, "keep= takes a number"),
    ({"saving": Restoring()}, "saving= takes a Saving"),
])
def test_a_wrong_argument_is_a_type_error(tmp_path, kwargs, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        built(tmp_path, **kwargs)


@pytest.mark.parametrize("cls,name,value", [
    (Checkpointer, "every_steps", 10),
    (Checkpointer, "async_save", True),
    (Checkpointer, "fsync", False),
    (Checkpointer, "sampler", None),
    (Checkpointer, "on_pressure", print),
    (Every, "total_steps", 100),
], ids=lambda v: v if isinstance(v, str) else None)
def test_an_unreleased_0_1_keyword_is_refused_by_name(tmp_path, cls, name, value):
    """One spelling for each setting: the 0.1 keywords never shipped, so none is translated
    (`every_steps=10` is `every=10`, `fsync=False` is `saving=Saving(fsync=False)`)."""
    kwargs = {"ckpt_dir": tmp_path} if cls is Checkpointer else {}
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
        cls(**kwargs, **{name: value})


@pytest.mark.parametrize("make,message", [
    (lambda: Every(steps=0), "Every(steps=)"),
    (lambda: Every(steps=True), "Every(steps=)"),
    (lambda: Every(steps=10, max_steps=20), "bound steps='auto'"),
    (lambda: Every(steps="auto", min_steps=5, max_steps=2), "max_steps (2) must be at least"),
    (lambda: Every(seconds=0), "Every(seconds=)"),
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
    ck = built(tmp_path, model=nn.Linear(2, 2), every=50)
    assert (ck.keep, ck.saving, ck.restoring) == (Keep(), Saving(), Restoring())
    assert ck.schedule.every_steps == 50


def test_async_mode_set_in_saving_saves_in_the_background(tmp_path):
    model = nn.Linear(3, 3)
    ck = built(tmp_path, model=model, saving=Saving(async_mode="thread"))
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
    assert cls.__name__ in rtrain.__all__


def test_the_reference_page_shows_the_docstring():
    # docs/reference.md's Checkpointer section is made from help(rtrain.Checkpointer)'s text:
    # the arguments and every option group's fields (tests/test_reference.py keeps it current).
    spec = importlib.util.spec_from_file_location("gen_reference",
                                                  ROOT / "scripts/gen_reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    section = reference.checkpointer_section()
    assert section in (ROOT / "docs" / "reference.md").read_text(), (
        "docs/reference.md's Checkpointer section is out of date: run "
        "python scripts/gen_reference.py")
    for cls in options.GROUPS:
        assert f"#### rtrain.{cls.__name__}" in section
        for name in fields_documented(cls):
            assert f"| `{name}` |" in section, f"{cls.__name__}.{name}"
