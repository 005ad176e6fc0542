"""Read what a `torch.save` pickle says without running it: its training step, and whether it
would call something that runs commands or code when loaded.

`scan(data)` walks the opcodes of one pickle (`pickletools.genops`, never `pickle.load`) on a
symbolic stack that holds only what matters here: strings, integers, dicts and opaque objects.
Nothing is imported, constructed or called.

- **Step.** The root of a `torch.save` checkpoint is usually a dict. The step is the integer
  value of the first of `STEP_KEYS` among its top-level keys: `global_step` (Lightning, and
  the usual name in loops written by hand), `iter_num` (nanoGPT-style scripts), `step`, and
  last `epoch` (coarse, but still ordered). Values nested deeper (`{"state": {"step": 3}}`) are
  not read: a step key inside an optimizer state is per parameter, not the run's.
- **Unsafe globals.** A pickle names the functions it calls at load (GLOBAL, STACK_GLOBAL,
  INST). Any name from a module that runs commands, opens sockets, imports or evaluates code
  (`os.system`, `subprocess.Popen`, `builtins.eval`, ...) refuses the file; that is how a
  malicious checkpoint takes over whoever loads it. Other names (tensors, numpy arrays, a
  script's own config class) pass: refusing them would throw away real checkpoints, and a
  loader that runs the script's own classes runs the script's own code anyway.

The walk is linear in the pickle's size; the caller bounds that size (torchzip.MAX_PICKLE).
"""

from __future__ import annotations

import pickletools
from dataclasses import dataclass
from typing import BinaryIO

STEP_KEYS = ("global_step", "iter_num", "step", "epoch")

# Modules whose functions, called by a pickle, run commands or code, touch the network or
# reach the interpreter's internals (the lists pickle scanners such as picklescan use).
_UNSAFE_MODULES = (
    "os", "posix", "nt", "subprocess", "sys", "socket", "shutil", "pty", "commands", "runpy",
    "importlib", "code", "codeop", "pdb", "bdb", "webbrowser", "ctypes", "multiprocessing",
    "asyncio", "pickle", "_pickle", "marshal", "types", "timeit", "platform", "requests",
    "http", "httplib", "urllib", "urllib2", "aiohttp", "pip", "setuptools", "distutils",
    "signal", "threading", "_thread", "ftplib", "smtplib", "telnetlib", "tempfile", "glob",
    "io", "_io", "zipimport", "torch.hub", "torch.package", "torch.jit",
    "torch.utils.cpp_extension",
)
_UNSAFE_NAMES = {
    "builtins": {"eval", "exec", "execfile", "compile", "open", "__import__", "getattr",
                 "setattr", "delattr", "globals", "locals", "vars", "input", "breakpoint",
                 "apply", "file", "reload", "exit", "quit", "help", "memoryview"},
    "__builtin__": {"eval", "exec", "execfile", "compile", "open", "__import__", "getattr",
                    "setattr", "delattr", "globals", "locals", "vars", "input", "apply",
                    "file", "reload"},
    # Gadgets that reach any attribute of an allowed object (a function's __globals__).
    "operator": {"attrgetter", "methodcaller", "getitem"},
    "torch": {"load", "hub"},
    "torch.serialization": {"load"},
    "numpy": {"load", "loadtxt", "fromfile"},
    "numpy.testing._private.utils": {"runstring"},
}
_STRINGS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
            "SHORT_BINUNICODE", "BINUNICODE8"}
_INTS = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}


class PickleRefused(ValueError):
    """The pickle is unsafe or malformed; `str()` is the one-line reason a person reads."""


@dataclass(frozen=True)
class Scan:
    step: int | None  # the first of STEP_KEYS at the root dict's top level, if an int
    step_key: str | None  # which key it was
    globals_named: int  # how many global names the pickle refers to


class _Mark:
    __slots__ = ()


class _Obj:
    """Something the pickle builds; a dict-like one remembers its str -> int items."""

    __slots__ = ("items",)

    def __init__(self, dictlike: bool = False) -> None:
        self.items: dict[str, int] | None = {} if dictlike else None

    def set(self, key: object, value: object) -> None:
        if self.items is not None and isinstance(key, str) and _is_int(value):
            self.items[key] = value  # type: ignore[assignment]


_MARK = _Mark()
_DICT_CLASSES = {("collections", "OrderedDict"), ("builtins", "dict"), ("__builtin__", "dict")}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def unsafe_global(module: str, name: str) -> bool:
    """Would calling `module.name` from a pickle run commands or code?"""
    if any(module == m or module.startswith(m + ".") for m in _UNSAFE_MODULES):
        return True
    return name.split(".", 1)[0] in _UNSAFE_NAMES.get(module, ())


def scan(data: bytes | BinaryIO, *, what: str = "data.pkl") -> Scan:
    """Walk one pickle (bytes, or a stream left just after its STOP); raise `PickleRefused`
    when it names an unsafe global or is malformed."""
    stack: list[object] = []
    memo: dict[int, object] = {}
    named = 0
    result: object = None

    def pop() -> object:
        if not stack:
            raise PickleRefused(f"{what}: malformed pickle (stack underflow)")
        return stack.pop()

    def pop_mark() -> list[object]:
        items: list[object] = []
        while True:
            item = pop()
            if item is _MARK:
                items.reverse()
                return items
            items.append(item)

    def check(module: object, name: object, op: str) -> _Obj:
        if not isinstance(module, str) or not isinstance(name, str):
            raise PickleRefused(f"{what}: {op} with a name that is not a plain string "
                                "(refused: it could name anything)")
        if unsafe_global(module, name):
            raise PickleRefused(f"{what}: the pickle calls {module}.{name} when loaded "
                                "(refused, never run: a checkpoint has no reason to)")
        return _Obj(dictlike=(module, name) in _DICT_CLASSES)

    try:
        for op, arg, _pos in pickletools.genops(data if hasattr(data, "read") else bytes(data)):
            name = op.name
            if name in _STRINGS:
                stack.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
            elif name in _INTS:
                stack.append(arg)
            elif name in ("EMPTY_DICT",):
                stack.append(_Obj(dictlike=True))
            elif name == "DICT":
                items, d = pop_mark(), _Obj(dictlike=True)
                for k, v in zip(items[::2], items[1::2], strict=False):
                    d.set(k, v)
                stack.append(d)
            elif name == "SETITEM":
                value, key = pop(), pop()
                target = stack[-1] if stack else None
                if isinstance(target, _Obj):
                    target.set(key, value)
            elif name == "SETITEMS":
                items = pop_mark()
                target = stack[-1] if stack else None
                if isinstance(target, _Obj):
                    for k, v in zip(items[::2], items[1::2], strict=False):
                        target.set(k, v)
            elif name in ("APPEND", "BUILD"):
                pop()
            elif name in ("APPENDS", "ADDITEMS"):
                pop_mark()
            elif name == "MARK":
                stack.append(_MARK)
            elif name == "POP_MARK":
                pop_mark()
            elif name == "DUP":
                stack.append(stack[-1] if stack else pop())
            elif name in _PUTS:
                memo[arg] = stack[-1] if stack else pop()
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else pop()
            elif name in _GETS:
                if arg not in memo:
                    raise PickleRefused(f"{what}: malformed pickle (memo {arg} read before "
                                        "it was written)")
                stack.append(memo[arg])
            elif name == "GLOBAL":
                module, _, attr = str(arg).partition(" ")
                named += 1
                stack.append(check(module, attr, name))
            elif name == "STACK_GLOBAL":
                attr, module = pop(), pop()
                named += 1
                stack.append(check(module, attr, name))
            elif name == "INST":
                module, _, attr = str(arg).partition(" ")
                named += 1
                check(module, attr, name)
                pop_mark()
                stack.append(_Obj())
            elif name in ("EXT1", "EXT2", "EXT4"):
                raise PickleRefused(f"{what}: the pickle names a function through the "
                                    "extension registry (refused: it could name anything)")
            elif name == "REDUCE":
                pop()
                func = pop()
                # OrderedDict() and friends: keep collecting the items set on the result.
                stack.append(_Obj(dictlike=isinstance(func, _Obj) and func.items is not None))
            elif name == "STOP":
                result = pop()
                break
            else:
                _generic(op, stack, pop, pop_mark)
    except ValueError as e:  # genops on bytes that are no pickle, or cut short
        if isinstance(e, PickleRefused):
            raise
        raise PickleRefused(f"{what}: not a readable pickle ({e})") from None
    else:
        if result is None:
            raise PickleRefused(f"{what}: pickle cut short (no STOP)")
    step, key = None, None
    if isinstance(result, _Obj) and result.items:
        for key in STEP_KEYS:
            if key in result.items:
                step = result.items[key]
                break
        else:
            key = None
    return Scan(step=step if step is None or step >= 0 else None,
                step_key=key if step is not None and step >= 0 else None, globals_named=named)


def _generic(op: pickletools.OpcodeInfo, stack: list[object], pop, pop_mark) -> None:
    """Any other opcode by its documented stack effect: consumed items out, opaque ones in."""
    before = op.stack_before
    if pickletools.markobject in before:
        pop_mark()
        for _ in range(before.index(pickletools.markobject)):
            pop()
    else:
        for _ in before:
            pop()
    for item in op.stack_after:
        stack.append(_MARK if item is pickletools.markobject else _Obj())
