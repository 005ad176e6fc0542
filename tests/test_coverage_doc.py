"""docs/test-coverage.md names the default-tier test of every failure kind, CLI command and
optional component: each name must be a test that exists and is not in the soak tier."""

from __future__ import annotations

import ast
import re

from harness import REPO

DOC = REPO / "docs" / "test-coverage.md"
NAMED = re.compile(r"`(tests/test_\w+\.py)::(test_\w+)`")


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The names of the pytest marks among `decorators` (or a pytestmark value's elements)."""
    out = set()
    for d in decorators:
        node = d.func if isinstance(d, ast.Call) else d
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "mark":
            out.add(node.attr)
    return out


def _module_marks(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            value = node.value
            return _marks(value.elts if isinstance(value, ast.List | ast.Tuple) else [value])
    return set()


def test_every_test_the_coverage_doc_names_exists_in_the_default_tier():
    named = NAMED.findall(DOC.read_text())
    assert len(named) >= 40, "the coverage table lost its rows"
    problems = []
    for path, name in named:
        tree = ast.parse((REPO / path).read_text())
        defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        if name not in defs:
            problems.append(f"{path}::{name}: no such test")
        elif "soak" in _marks(defs[name].decorator_list) | _module_marks(tree):
            problems.append(f"{path}::{name}: in the soak tier")
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_soak_mark():
    tree = ast.parse("import pytest\n@pytest.mark.slow\n@pytest.mark.soak\ndef test_a(): pass\n"
                     "pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('x')]\n")
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    assert _marks(fn.decorator_list) == {"slow", "soak"}
    assert _module_marks(tree) == {"slow", "xdist_group"}
