"""docs/test-coverage.md names the default-tier test of every failure kind, CLI command and
optional component: each name must be a test that exists and is not in the soak tier."""

from __future__ import annotations

import ast
import re

from harness import REPO

DOC = REPO / "docs" / "test-coverage.md"
NAMED = re.compile(r"`(tests/test_\w+\.py)::(test_\w+)`")


def _mark(node: ast.expr) -> str | None:
    """X for `pytest.mark.X` or `pytest.mark.X(...)`."""
    node = node.func if isinstance(node, ast.Call) else node
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
            and node.value.attr == "mark":
        return node.attr
    return None


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to a mark (`SOAK = pytest.mark.soak`) -> the mark."""
    return {t.id: mark for node in tree.body if isinstance(node, ast.Assign)
            and (mark := _mark(node.value)) for t in node.targets if isinstance(t, ast.Name)}


def _marks(decorators: list[ast.expr], aliases: dict[str, str] | None = None) -> set[str]:
    """The names of the pytest marks among `decorators` (or a pytestmark value's elements)."""
    out = set()
    for d in decorators:
        mark = _mark(d)
        if mark is None and isinstance(d, ast.Name):
            mark = (aliases or {}).get(d.id)
        if mark is not None:
            out.add(mark)
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
        elif "soak" in _marks(defs[name].decorator_list, _aliases(tree)) | _module_marks(tree):
            problems.append(f"{path}::{name}: in the soak tier")
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_soak_mark():
    tree = ast.parse("import pytest\n@pytest.mark.slow\n@pytest.mark.soak\ndef test_a(): pass\n"
                     "pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('x')]\n")
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    assert _marks(fn.decorator_list) == {"slow", "soak"}
    aliased = ast.parse("import pytest\nSOAK = pytest.mark.soak\n@SOAK\ndef test_a(): pass\n")
    fn = next(n for n in aliased.body if isinstance(n, ast.FunctionDef))
    assert _marks(fn.decorator_list, _aliases(aliased)) == {"soak"}
    assert _module_marks(tree) == {"slow", "xdist_group"}
