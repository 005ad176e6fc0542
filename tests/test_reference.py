"""docs/reference.md is what scripts/gen_reference.py makes of the code today: a command, key,
field, event, exit code, metric or variable changed without regenerating the page fails here."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def generator():
    spec = importlib.util.spec_from_file_location("gen_reference",
                                                  ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_is_generated_from_the_code():
    made = generator().render()
    kept = (ROOT / "docs" / "reference.md").read_text()
    diff = "".join(list(difflib.unified_diff(kept.splitlines(True), made.splitlines(True),
                                             "docs/reference.md", "from the code", n=1))[:40])
    assert made == kept, ("docs/reference.md is out of date: run python "
                          f"scripts/gen_reference.py\n{diff}")


def test_reference_names_no_machine_path():
    made = generator().render()
    for here in {str(ROOT), str(Path.home())} - {"/"}:
        assert here not in made


def test_every_variable_and_exit_code_has_its_meaning():
    gen = generator()
    assert all(doc for _, _, doc in gen.env_variables())
    from rtrain.supervisor.core.errors import ExitCode

    docs = gen.class_attribute_docs(ExitCode)
    assert set(docs) == {m.name for m in ExitCode}
