"""docs/design.md's package map names every module of supervisor/, worker/ and checkpoint/, and
nothing that is gone: a new, moved or deleted module fails here until the map says where it sits."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rtrain", "supervisor", "worker", "checkpoint")


def mapped_modules(design: str) -> set[str]:
    """Paths named in the fenced block under "## Package map", nesting read from indentation."""
    section = design.split("\n## Package map\n", 1)[1]
    block = section.split("```\n", 2)[1]
    names: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, directory)
    for line in block.splitlines():
        m = re.match(r"( *)(\S+)", line)
        if not m:
            continue
        indent, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([d for _, d in stack] + [name.rstrip("/")])
        if name.endswith("/"):
            stack.append((indent, name.rstrip("/")))
        elif name.endswith(".py"):
            names.add(path)
    return names


def source_modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if not p.name.startswith("__")}


def test_every_module_is_in_the_package_map():
    mapped = mapped_modules((ROOT / "docs" / "design.md").read_text())
    actual = source_modules()
    assert not actual - mapped, f"add to docs/design.md's package map: {sorted(actual - mapped)}"
    assert not mapped - actual, f"in the package map but gone: {sorted(mapped - actual)}"


def test_the_map_reader_follows_nesting():
    block = ("## Package map\n\n```\nsupervisor/   x\n  cli.py   y\n  ckpt/   z\n"
             "    layout.py   w\n  errors.py   v\nworker/   u\n  state.py   t\n```\n")
    assert mapped_modules("\n" + block) == {"supervisor/cli.py", "supervisor/ckpt/layout.py",
                                            "supervisor/errors.py", "worker/state.py"}
