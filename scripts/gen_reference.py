"""Write docs/reference.md, the page a user looks things up in, from the code alone.

    python scripts/gen_reference.py           # after changing a command, key, field, event...
    python scripts/gen_reference.py --check   # exit 1 when docs/reference.md differs

Every entry comes from where the code defines it: the typer app's commands and options (their
help), config.py's dataclasses (the docstring after each field), `rtrain.Checkpointer` and its
option groups (their docstrings, reached through the public `rtrain` names), the events schema,
`ExitCode` (the docstring after each member), the metrics file's series, and the `ENV_*`
constants of the package (the docstring after each). To change a line of the page, change the
code's text and run this again. tests/test_reference.py fails when the page differs. Nothing
depends on the machine or the day (no path, no date), so the page is the same wherever it is made.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import itertools
import re
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference.md"
HINT = "run python scripts/gen_reference.py"


# ------------------------------------------------------------------ reading the code's text

def attribute_docs(source: str) -> dict[str, str]:
    """`name -> docstring` for each assignment in `source` (a class or module body) followed
    by a string literal: the convention config.py, ExitCode and the ENV_* constants follow."""
    tree = ast.parse(textwrap.dedent(source))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else tree.body
    docs = {}
    for node, after in itertools.pairwise(body):
        if not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            continue
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
            if isinstance(target, ast.Name):
                docs[target.id] = inspect.cleandoc(after.value.value)
    return docs


def class_attribute_docs(cls: type) -> dict[str, str]:
    return attribute_docs(inspect.getsource(cls))


def sections(doc: str) -> tuple[str, dict[str, dict[str, str]], str]:
    """A Google-style docstring split: the text before its first `Args:`/`Attributes:`
    section, each section's `name: text` entries, and the text after the last section."""
    head: list[str] = []
    tail: list[str] = []
    found: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    name = ""
    for line in doc.splitlines():
        if re.fullmatch(r"(Args|Attributes):", line):
            current = found.setdefault(line[:-1], {})
            continue
        if current is None:
            head.append(line)
        elif m := re.fullmatch(r" {4}(\*{0,2}\w+): (.*)", line):
            name = m.group(1)
            current[name] = m.group(2)
        elif line.startswith(" " * 8) and name:
            current[name] += " " + line.strip()
        elif not line.strip():
            if tail:
                tail.append(line)
        else:
            current, name = {}, ""
            tail.append(line)
    return "\n".join(head).strip(), found, "\n".join(tail).strip()


def escape(line: str) -> str:
    """`<` outside code spans as `&lt;`: `<run-dir>` would read as an HTML tag."""
    parts = line.split("`")
    return "`".join(part.replace("<", "&lt;") if i % 2 == 0 else part
                    for i, part in enumerate(parts))


def prose(text: str) -> str:
    """A docstring's text for the page: escaped, except its indented (code) lines."""
    return "\n".join(line if line.startswith("    ") else escape(line)
                     for line in text.splitlines())


def one_line(text: str) -> str:
    """Text for a table cell: one line, `<` and `|` escaped."""
    return escape(" ".join(text.split())).replace("|", "\\|")


def table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(one_line(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def code(text: str) -> str:
    """`text` as code; the words that are no value (empty, unset, required) as they are."""
    return f"`{text}`" if text not in ("", "unset", "required") else text


def signature_lines(obj: Any, skip_self: bool = False) -> list[str]:
    """Each parameter as `name: annotation = default` (string annotations unquoted)."""
    out = []
    for i, p in enumerate(inspect.signature(obj).parameters.values()):
        if skip_self and i == 0:
            continue
        if p.kind is p.KEYWORD_ONLY and not any(x.startswith("*") for x in out):
            out.append("*")
        text = p.name + (f": {annotation(p.annotation)}" if p.annotation is not p.empty else "")
        out.append(text + (f" = {p.default!r}" if p.default is not p.empty else ""))
    return out


def annotation(value: Any) -> str:
    return value if isinstance(value, str) else getattr(value, "__name__", repr(value))


def toml_value(value: Any) -> str:
    """A default as it would be written in rtrain.toml."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return toml_value(value.value)
    if isinstance(value, (str, Path)):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


# ------------------------------------------------------------------ the command line

def cli_section() -> str:
    import typer

    from rtrain.supervisor.cli import app

    # typer builds click objects (its own copy of click: duck-typed here, not imported).
    group = typer.main.get_command(app)
    ctx = group.context_class(group, info_name="rtrain")
    names = group.list_commands(ctx)
    out = ["## Command line", "",
           f"`rtrain`: {one_line(group.help or '')} Every command takes `-h`/`--help`; "
           "`rtrain --version` prints the version; `python -m rtrain` is the same command. "
           "Exit codes: [below](#exit-codes).", ""]
    for name in sorted(names, key=lambda n: (n != "launch", names.index(n))):
        command = group.get_command(ctx, name)
        sub = command.context_class(command, info_name=name, parent=ctx)
        usage = " ".join(["rtrain", name, *command.collect_usage_pieces(sub)])
        out += [f"### rtrain {name}", "", "```text", usage, "```", "",
                inspect.cleandoc(command.help or ""), ""]
        rows = [param_row(p, sub) for p in command.get_params(sub) if p.name != "help"]
        out += [table(["argument or option", "meaning", "default"], rows), ""]
    return "\n".join(out)


def param_row(param: Any, ctx: Any) -> tuple[str, str, str]:
    if param.param_type_name == "argument":
        return code(param.metavar or param.name.upper()), param.help or "", (
            "required" if param.required else "")
    names = ", ".join(sorted(param.opts, key=len))
    if param.secondary_opts:
        names += " / " + ", ".join(param.secondary_opts)
    if not param.is_flag:
        shown_type = getattr(param, "display_type", None)  # typer's: <quick|full>, <int>
        names += " " + (param.metavar or (shown_type(ctx).strip("<>") if shown_type
                                          else "VALUE"))
    default = param.default
    if param.required:
        shown = "required"
    elif default is None or param.is_flag or default == ():
        shown = ""
    else:
        shown = code(str(default.value if isinstance(default, enum.Enum) else default))
    return code(names), param.help or "", shown


# ------------------------------------------------------------------ configuration

def config_section() -> str:
    from rtrain.supervisor import config
    from rtrain.supervisor.decide.ladder import DEFAULT_LADDER, Rung
    from rtrain.supervisor.hooks.hook_spec import HOOKABLE, HookSpec

    top_docs = class_attribute_docs(config.Config)
    own = ("settings", "ladder", "hooks")  # the user's own tables, each with a section below
    paragraphs = inspect.getdoc(config).split("\n\n")
    out = ["## Configuration", "", one_line(paragraphs[1]),
           "Tables merge key by key, so `--max-restarts` keeps the file's budgets. An unknown key "
           "or a bad value is a one-line error naming its source and what to change (exit 2).",
           f"These {len(config.KEYS)} keys are all there is: everything else rtrain uses is a "
           "constant in its code, or measured on the run, and a file that names one is refused "
           "with the value rtrain holds it at.", ""]
    rows = []
    for key in config.KEYS:
        if key in own:
            rows.append((code(key), "table" if key == "settings" else "array of tables",
                         "", f"{one_line(top_docs[key])} See [{key}] below."))
            continue
        section, _, name = key.rpartition(".")
        cls = type(getattr(config.Config(), section)) if section else config.Config
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        shown = f"[{section}] {name}" if section else name
        rows.append((code(shown), code(toml_type(name, f.type)),
                     code(shown_default(name, getattr(cls(), name))),
                     class_attribute_docs(cls).get(name, "")))
    out += [table(["key", "type", "default", "meaning and why to set it"], rows), ""]
    out += ["### [settings]", "", top_docs["settings"],
            "The script reads them with `rtrain.settings()`, or through `{knob}` templates in "
            "its arguments; `--set KNOB=VALUE` overrides one.", "",
            "### [[ladder]]", "", top_docs["ladder"], "", prose(inspect.getdoc(Rung) or ""), "",
            fields_table(Rung, None), "", "The default ladder:", "", "```toml"]
    for rung in DEFAULT_LADDER:
        out += ["[[ladder]]"] + [f"{f.name} = {toml_value(getattr(rung, f.name))}"
                                 for f in dataclasses.fields(Rung)
                                 if getattr(rung, f.name) != f.default or f.name == "knob"]
        out.append("")
    out[-1] = "```"
    out += ["", "### [[hooks]]", "", top_docs["hooks"], "", fields_table(HookSpec, None), "",
            "Kinds `on` may name: " + ", ".join(code(k) for k in HOOKABLE) + ".", ""]
    return "\n".join(out)


def toml_type(name: str, value: Any) -> str:
    """A field's type as the file spells it: a path is a string, file_mode an octal string."""
    if name == "file_mode":
        return "str"
    return re.sub(r"\bPath\b", "path", annotation(value))


def shown_default(name: str, value: Any) -> str:
    if name == "file_mode":  # an int in the code, written as an octal string in the file
        return f'"{value:04o}"'
    return toml_value(value)


def fields_table(cls: type, instance: Any) -> str:
    docs = class_attribute_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if instance is not None:
            default = shown_default(f.name, getattr(instance, f.name))
        elif f.default is not dataclasses.MISSING:
            default = toml_value(f.default)
        else:
            default = "required"
        rows.append((code(f.name), code(toml_type(f.name, f.type)), code(default),
                     docs.get(f.name, "")))
    return table(["key", "type", "default", "meaning"], rows)


# ------------------------------------------------------------------ the Checkpointer

def checkpointer_section() -> str:
    import rtrain

    cls = rtrain.Checkpointer
    doc = inspect.getdoc(cls) or ""
    # The option groups' docstrings are appended to the Checkpointer's (help() shows them):
    # each starts with a line `Name(field=default, ...)` naming a public class.
    lines = doc.splitlines()
    starts = [i for i, line in enumerate(lines)
              if (m := re.match(r"(\w+)\(", line)) and m.group(1) in rtrain.__all__]
    groups = [getattr(rtrain, lines[i].split("(")[0]) for i in starts]
    own = "\n".join(lines[:starts[0]] if starts else lines)
    intro, found, after = sections(own)
    signature = inspect.signature(cls)
    params = "".join(f"    {line},\n" for line in signature_lines(cls))
    out = ["## The Checkpointer", "",
           "`import rtrain` (torch-free to import; each name loads on first use).", "",
           "```python", f"rtrain.Checkpointer(\n{params})", "```", "", prose(intro), "",
           table(["argument", "default", "meaning"],
                 [(code(name), code(repr(signature.parameters[name].default)), text)
                  for name, text in found.get("Args", {}).items()]), "", prose(after), "",
           "### Methods", ""]
    for name, member in vars(cls).items():  # in the order the class defines them
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            out += [f"#### `{name}` (property)", "", prose(inspect.getdoc(member) or ""), ""]
        elif inspect.isfunction(member):
            ret = inspect.signature(member).return_annotation
            sig = f"{name}({', '.join(signature_lines(member, skip_self=True))})" + (
                f" -> {annotation(ret)}" if ret is not inspect.Signature.empty else "")
            out += [f"#### `{sig}`", "", prose(inspect.getdoc(member) or ""), ""]
    out += ["### Option groups", ""]
    for group in groups:
        summary, found, _ = sections(inspect.getdoc(group) or "")
        fields = found.get("Attributes", {})
        out += [f"#### rtrain.{group.__name__}", "", prose(summary), "",
                table(["field", "type", "default", "meaning"],
                      [(code(f.name), code(annotation(f.type)), code(repr(_default(f))),
                        fields.get(f.name, "")) for f in dataclasses.fields(group)]), ""]
    out += ["### Other names", "",
            table(["name", "what it is"], [
                (code(f"rtrain.{name}"), first_paragraph(getattr(rtrain, name)))
                for name in rtrain.__all__
                if not name.startswith("_") and name != "Checkpointer"
                and getattr(rtrain, name) not in groups]), ""]
    return "\n".join(out)


def first_paragraph(obj: Any) -> str:
    return (inspect.getdoc(obj) or "").split("\n\n")[0]


# ------------------------------------------------------------------ events, exit codes, metrics

def events_section() -> str:
    from rtrain.supervisor.core import event_schema

    rows = [(code(kind.value), spec.meaning, ", ".join(code(f) for f in spec.fields),
             ", ".join(code(f) for f in spec.optional),
             "yes" if spec.hookable else "no", "yes" if spec.durable else "no")
            for kind, spec in event_schema.KINDS.items()]
    return "\n".join([
        "## Events", "",
        "`<run-dir>/events.jsonl` holds one JSON object per line; each has `kind`, `time`, "
        "`seq` and `v` besides the fields below. *hook*: a `[[hooks]]` table may name the kind; "
        "*fsync*: on disk before rtrain goes on.", "",
        table(["kind", "meaning", "fields", "optional fields", "hook", "fsync"], rows), ""])


def exit_codes_section() -> str:
    from rtrain.supervisor.core.errors import ExitCode

    docs = class_attribute_docs(ExitCode)
    rows = [(code(str(int(member))), code(member.name), docs.get(member.name, ""))
            for member in sorted(ExitCode)]
    return "\n".join(["## Exit codes", "", table(["code", "name", "meaning"], rows), ""])


def metrics_section() -> str:
    from rtrain.supervisor.metrics import file as metrics

    doc = inspect.getdoc(metrics) or ""
    labels = dict(re.findall(r"^ {4}(rtrain_\w+)\{([^}]*)\}", doc, re.M))
    missing = set(metrics._HELP) - set(labels)
    if missing:
        raise SystemExit(f"supervisor/metrics/file.py's docstring lists no labels for "
                         f"{sorted(missing)}")
    rows = [(code(name), kind, ", ".join(code(label) for label in labels[name].split(",")),
             text) for name, (kind, text) in metrics._HELP.items()]
    return "\n".join([
        "## Metrics", "",
        "`rtrain launch --metrics-file PATH` (or `metrics_file`) writes these in Prometheus' "
        "text format, replacing the file atomically at every event and every few seconds "
        "(node-exporter's textfile collector reads it). A value not known yet is left out.", "",
        table(["metric", "type", "labels", "meaning"], rows), ""])


# ------------------------------------------------------------------ environment variables

def env_variables() -> list[tuple[str, str, str]]:
    """(module, variable, docstring) of every module-level `ENV_* = "RTRAIN_..."` of the
    package, read from the source files (no module is imported)."""
    import rtrain.supervisor
    import rtrain.worker

    found = []
    for package in (rtrain.supervisor, rtrain.worker):
        base = Path(package.__path__[0])
        for path in sorted(base.rglob("*.py")):
            source = path.read_text()
            docs = attribute_docs(source)
            module = ".".join([package.__name__, *path.relative_to(base).with_suffix("").parts])
            for node in ast.parse(source).body:
                if (isinstance(node, ast.Assign) and len(node.targets) == 1
                        and isinstance(node.targets[0], ast.Name)
                        and node.targets[0].id.startswith("ENV_")
                        and isinstance(node.value, ast.Constant)
                        and str(node.value.value).startswith("RTRAIN_")):
                    found.append((module, node.value.value, docs.get(node.targets[0].id, "")))
    return found


def env_section() -> str:
    found = env_variables()
    undocumented = [name for _, name, doc in found if not doc]
    if undocumented:
        raise SystemExit(f"give these ENV_* constants a docstring: {undocumented}")
    given = sorted((name, doc) for module, name, doc in found if module.endswith(".protocol"))
    read = sorted((name, doc) for module, name, doc in found if not module.endswith(".protocol"))
    return "\n".join([
        "## Environment variables", "",
        "### Given to the training process", "",
        "rtrain sets these for each attempt; `rtrain.settings()` and the Checkpointer read them, "
        "and a script run by hand, without them, checkpoints and resumes on its own.", "",
        table(["variable", "meaning"], [(code(n), d) for n, d in given]), "",
        "### Read by rtrain and the worker", "",
        table(["variable", "meaning"], [(code(n), d) for n, d in read]), ""])


# ------------------------------------------------------------------ the page

def render() -> str:
    parts = [
        "# rtrain reference", "",
        "<!-- Generated by scripts/gen_reference.py from the code; edit the code's docstrings "
        "and help, then run it again. -->", "",
        "Every command, option, configuration key, Checkpointer argument, event, exit code, "
        "metric and environment variable, as the code defines them. The README says how to use "
        "them; docs/architecture.md why they are so.", "",
        "- [Command line](#command-line)", "- [Configuration](#configuration)",
        "- [The Checkpointer](#the-checkpointer)", "- [Events](#events)",
        "- [Exit codes](#exit-codes)", "- [Metrics](#metrics)",
        "- [Environment variables](#environment-variables)", "",
        cli_section(), config_section(), checkpointer_section(), events_section(),
        exit_codes_section(), metrics_section(), env_section()]
    text = "\n".join(parts)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def _default(f: dataclasses.Field) -> object:
    """A field's default; a default_factory's product (Saving.memory's MEMORY_DEFAULT)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/reference.md differs, write nothing")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"docs/reference.md differs from the code: {HINT}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
