"""supervisor/commands/fast_typer.py: the CLI's simple options are converted without pydantic
(typer would import it and build an adapter per option: ~0.25 s of every `rtrain launch`),
`T | None` and `list[T]` included, with typer's own errors for bad values."""

from __future__ import annotations

import enum
import subprocess
import sys
from pathlib import Path

import pytest

from rtrain.supervisor.commands.fast_typer import plain_converter


class Color(enum.Enum):
    RED = "red"


def test_optional_and_list_annotations_get_plain_converters():
    assert plain_converter(int | None)("3") == 3
    assert plain_converter(Path | None)("a/b") == Path("a/b")
    assert plain_converter(Color | None, case_sensitive=False)("RED") is Color.RED
    assert plain_converter(list[str] | None, multiple=True)(("a", "b")) == ["a", "b"]
    assert plain_converter(list[int], multiple=True)(("1", "2")) == [1, 2]
    with pytest.raises(ValueError, match="not a valid integer"):
        plain_converter(int | None)("x")
    # What plain conversion cannot stand for stays typer's.
    assert plain_converter(int | str) is None
    assert plain_converter(tuple[int, int]) is None
    assert plain_converter(list[str]) is None  # a list where one value is given
    assert plain_converter(list[tuple[int, int]], multiple=True) is None


@pytest.mark.slow  # a real `rtrain launch`
def test_a_launch_imports_no_pydantic(tmp_path):
    (tmp_path / "tiny.py").write_text("print('hi')\n")
    probe = ("import runpy, sys\n"
             "sys.argv = ['rtrain', 'launch', '--run-dir', sys.argv[1], '-q', '--set', 'a=1', "
             "'--max-restarts', '2', 'tiny.py', '--x', 'y']\n"
             "try:\n    runpy.run_module('rtrain', run_name='__main__')\n"
             "except SystemExit as e:\n    code = e.code\n"
             "print('pydantic' in sys.modules, code)\n")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "run")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-2:] == ["False", "0"], out.stdout + out.stderr[-2000:]
