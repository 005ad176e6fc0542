"""A `typer.Typer` whose simple options skip pydantic, so `rtrain inspect` starts fast.

typer 0.2x coerces every non-flag parameter through a pydantic `TypeAdapter`; importing pydantic
and building the adapters costs ~200 ms, two thirds of the 300 ms that `rtrain inspect` over 100
checkpoints may take in all. For `bool`, `str`, `int`, `float`, `Path` and `Enum` parameters
(all rtrain uses) plain conversion is equivalent, so `FastTyper`'s group and commands use it.
Anything else, or a typer without this seam, keeps typer's own coercion: slower, never wrong.
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import typer
from typer.core import TyperCommand, TyperGroup

try:  # private, hence guarded: without it commands simply keep typer's coercion
    from typer._coercion import RuntimeParam
except ImportError:  # pragma: no cover - depends on the installed typer
    RuntimeParam = None  # type: ignore[assignment,misc]


def _enum_converter(kind: type[enum.Enum], case_sensitive: bool) -> Callable[[Any], Any]:
    def convert(value: Any) -> enum.Enum:
        if isinstance(value, kind):
            return value
        for member in kind:
            if member.value == value or (not case_sensitive
                                         and str(member.value).lower() == str(value).lower()):
                return member
        choices = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"{value!r} is not one of {choices}")

    return convert


def _int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a valid integer")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a valid integer") from None


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a valid number") from None


_TRUE, _FALSE = {"1", "true", "t", "yes", "y", "on"}, {"0", "false", "f", "no", "n", "off"}


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{value!r} is not a valid boolean")


def _without_none(annotation: Any) -> Any:
    """`T` for `T | None` (an option left out is None before any conversion), else as given."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def plain_converter(annotation: Any, case_sensitive: bool = True,
                    multiple: bool = False) -> Callable[[Any], Any] | None:
    """A converter for the simple annotations (and `T | None`; `list[T]` for a parameter that
    takes several values), or None to leave the parameter to typer."""
    annotation = _without_none(annotation)
    if multiple:
        if typing.get_origin(annotation) is not list or len(typing.get_args(annotation)) != 1:
            return None
        one = plain_converter(typing.get_args(annotation)[0], case_sensitive)
        return None if one is None else (lambda values: [one(v) for v in values])
    if annotation is bool:
        return _bool
    if annotation is str:
        return str
    if annotation is int:
        return _int
    if annotation is float:
        return _float
    if annotation is Path:
        return Path
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _enum_converter(annotation, case_sensitive)
    return None


if RuntimeParam is not None:
    @dataclass(frozen=True)
    class PlainParam(RuntimeParam):
        convert: Callable[[Any], Any] = str

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            try:
                return self.convert(value)
            except ValueError as e:
                raise typer.BadParameter(str(e), ctx=ctx, param=param) from None


def install_plain(params: list[Any]) -> None:
    """Give each simple single-valued parameter a plain converter (once)."""
    if RuntimeParam is None:
        return
    for param in params:
        desc = getattr(param, "type_descriptor", None)
        # Tuples, parsers and ranges keep typer's coercion.
        multiple = param.multiple or param.nargs == -1
        if (desc is None or (param.nargs != 1 and not multiple)
                or getattr(param, "_runtime_param", False) is not None):
            continue
        info = desc.parameter_info
        if any(getattr(info, a, None) is not None for a in ("parser", "min", "max")):
            continue
        convert = plain_converter(desc.annotation, getattr(info, "case_sensitive", True),
                                  multiple=multiple)
        if convert is not None:
            param._runtime_param = PlainParam(info, desc.annotation, convert)


class FastCommand(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        # Here rather than in __init__: the help option is only made when first asked for.
        params = super().get_params(ctx)
        install_plain(params)
        return params

    panels: ClassVar[Mapping[str, str]] = {}
    """Parameter name -> the heading its option is listed under in --help."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """Options under their panel's heading, the panels in the order `panels` names them,
        the others first under "Options": typer's rich help panels in plain text (rich would
        cost every start ~100 ms)."""
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                panel = self.panels.get(param.name or "", "Options")
                panels.setdefault(panel, []).append(record)
        order = list(dict.fromkeys(["Options", *self.panels.values()]))
        for panel, records in sorted(panels.items(), key=lambda item: order.index(item[0])):
            with formatter.section(panel):
                formatter.write_dl(records)


class FastGroup(TyperGroup):
    order: tuple[str, ...] = ()
    """Commands listed first, in this order; the others follow as they were added."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        install_plain(params)
        return params

    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        first = [n for n in self.order if n in names]
        return first + [n for n in names if n not in first]


class FastTyper(typer.Typer):
    """`typer.Typer` whose group and commands default to `FastGroup` / `FastCommand`."""

    def __init__(self, *args: Any, cls: type[TyperGroup] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, cls=cls or FastGroup, **kwargs)

    def command(self, *args: Any, cls: type[TyperCommand] | None = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or FastCommand, **kwargs)
