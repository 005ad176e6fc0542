"""Read what a `torch.save` pickle says without running it: its training step, and whether it
names anything beyond what checkpoints hold.

`scan(data)` walks the opcodes of one pickle (never `pickle.load`) on a symbolic stack that
holds only what matters here: short strings, integers, the first dicts and opaque markers.
Nothing is imported, constructed or called.

- **Step.** The root of a `torch.save` checkpoint is usually a dict. The step is the integer
  value of the first of `STEP_KEYS` among its top-level keys: `global_step` (Lightning, and
  the usual name in loops written by hand), `iter_num` (nanoGPT-style scripts), `step`, and
  last `epoch` (coarse, but still ordered). Values nested deeper (`{"state": {"step": 3}}`) are
  not read: a step key inside an optimizer state is per parameter, not the run's.
- **An allow-list of globals.** A pickle names the functions and classes it calls at load
  (GLOBAL, STACK_GLOBAL, INST). Every name must be one that `torch.save` and the formats
  rtrain resumes from write (`ALLOWED`: torch's tensor and storage rebuilders and dtypes,
  `collections.OrderedDict`, numpy's array and scalar reconstruction, builtin containers,
  `argparse.Namespace` and `datetime` for a script's saved args, Lightning's `AttributeDict`,
  DeepSpeed's enums and loss scalers), the set torch's own `weights_only` loader allows and
  what the real checkpoints of those formats hold besides. Anything else, named as written,
  makes the file not resumable: a deny-list is bypassed by any of the thousands of functions
  that run a command once called (`pydoc.pipepager`, `cProfile.run`, `pkgutil.resolve_name`).
  Names are checked as the loader resolves them (protocol < 3: Python 2 spellings mapped).
  Not allowed although torch writes it in one case: `torch.storage._load_from_bytes`, which
  loads nested bytes with `weights_only=False` (a storage pickled with plain `pickle`, never by
  `torch.save`).
- **Bounded work.** The walk is one pass over the bytes, at most one opcode per byte, in
  memory bounded by the pickle's size with a small constant: strings are kept only when they
  can name an allowed global or a step key (plus the first few others, to name what is
  refused), integers never in the memo, opaque values as one shared marker. A pickle that
  memoizes more than `MAX_MEMO_PER_BYTE` entries per byte, nests deeper than `MAX_STACK`, or
  takes longer than `MAX_SECONDS` is refused: `pickle` itself never writes one.

The caller bounds the pickle's size (torchzip.MAX_PICKLE).
"""

from __future__ import annotations

import _compat_pickle
import codecs
import re
import struct
import time
from dataclasses import dataclass
from typing import BinaryIO

STEP_KEYS = ("global_step", "iter_num", "step", "epoch")

_TORCH_REBUILD = (
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_sparse_tensor",
    "_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass",
    "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor",
)
_NUMPY_CORE = ("multiarray._reconstruct", "multiarray.scalar")
ALLOWED = frozenset({
    # torch.save's own: tensors, storages (checked by name pattern below), dtypes, devices.
    *(f"torch._utils.{f}" for f in _TORCH_REBUILD),
    "torch._tensor._rebuild_from_type_v2", "torch.tensor._rebuild_from_type_v2",
    "torch.Size", "torch.Tensor", "torch.device", "torch.nn.parameter.Parameter",
    "torch.serialization._get_layout", "torch.storage.UntypedStorage",
    "torch.storage.TypedStorage", "torch.per_tensor_affine", "torch.per_tensor_symmetric",
    "torch.per_channel_affine", "torch.per_channel_symmetric",
    "torch.per_channel_affine_float_qparams",
    # Containers and scalars: bytes under protocol 2 are `_codecs.encode(str, "latin1")`.
    "collections.OrderedDict", "collections.Counter", "collections.defaultdict",
    "builtins.dict", "builtins.list", "builtins.tuple", "builtins.set", "builtins.frozenset",
    "builtins.complex", "builtins.slice", "builtins.bytearray", "builtins.bytes",
    "builtins.int", "builtins.float", "builtins.str", "builtins.bool", "builtins.range",
    "_codecs.encode",
    # numpy arrays and scalars (an RNG state, a metric): numpy 1 and numpy 2 spellings.
    *(f"numpy.core.{f}" for f in _NUMPY_CORE), *(f"numpy._core.{f}" for f in _NUMPY_CORE),
    "numpy.dtype", "numpy.ndarray",
    # A script's saved arguments (imagenet's and timm's `args`), dates, paths.
    "argparse.Namespace", "datetime.datetime", "datetime.date", "datetime.time",
    "datetime.timedelta", "datetime.timezone", "pathlib.PosixPath", "pathlib.PurePosixPath",
    "pathlib._local.PosixPath", "pathlib._local.PurePosixPath",
    # Lightning's hyper-parameters; DeepSpeed's model and optimizer states.
    "lightning.fabric.utilities.data.AttributeDict",
    "lightning_fabric.utilities.data.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict",
    "pytorch_lightning.utilities.parsing.AttributeDict",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
})
# torch.FloatStorage, torch.cuda.HalfStorage, ...; torch.float32, torch.bfloat16, torch.uint4...
_TORCH_NAME = re.compile(r"torch(\.cuda)?\.[A-Z][A-Za-z0-9]*Storage|torch\.(float\d*(_\w+)?|"
                         r"bfloat16|half|double|cfloat|cdouble|chalf|complex\d+|u?int\d+|long|"
                         r"short|int|bool|q?u?int\d+(x\d+)?|bits\w+)")

MAX_STACK = 1 << 18
"""Items on the stack at once. pickle writes containers in batches of 1,000 items, so a real
checkpoint's stack stays far below this at any nesting it has."""
MAX_MEMO_PER_BYTE = 0.25
"""Memo entries per byte of pickle (with a floor of 65,536): pickle memoizes each object once,
after the opcodes that made it, and no real checkpoint comes near one entry per 4 bytes."""
MAX_SECONDS = 30.0
"""Wall-clock seconds one pickle may take to walk: a backstop only, a 64 MiB pickle of the
cheapest opcodes takes a few seconds on one core."""
_KEEP_OTHER_STRINGS = 4096  # strings kept beyond the allowed names: to name what is refused
_MAX_STRING = 256
_TRACKED_DICTS = 16  # the root dict is made before anything it holds: among the first


class PickleRefused(ValueError):
    """The pickle is unsafe or malformed; `str()` is the one-line reason a person reads."""


@dataclass(frozen=True)
class Scan:
    step: int | None  # the first of STEP_KEYS at the root dict's top level, if an int
    step_key: str | None  # which key it was
    globals_named: int  # how many global names the pickle refers to


class _Mark:
    __slots__ = ()


class _Opaque:
    __slots__ = ()


class _Obj:
    """One of the first dicts the pickle builds: remembers its step-key items."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: dict[str, int] = {}

    def set(self, key: object, value: object) -> None:
        if key in _STEP_SET and _is_int(value):
            self.items[key] = value  # type: ignore[index,assignment]


_MARK = _Mark()
_OPAQUE = _Opaque()  # anything whose value does not matter here
_OTHER_STR = _Opaque()  # a string not kept (see the module docstring)
_STEP_SET = frozenset(STEP_KEYS)
_DICT_CLASSES = frozenset({"collections.OrderedDict", "builtins.dict",
                           "lightning.fabric.utilities.data.AttributeDict",
                           "lightning_fabric.utilities.data.AttributeDict",
                           "lightning.pytorch.utilities.parsing.AttributeDict",
                           "pytorch_lightning.utilities.parsing.AttributeDict"})
def _name_parts(name: str) -> list[str]:
    parts = name.split(".")
    return ([".".join(parts[:i]) for i in range(1, len(parts))]
            + [".".join(parts[i:]) for i in range(1, len(parts))] + [name])


# Every string that can be part of an allowed name or a step key, by its encoded bytes: kept
# as this one object, so a pickle repeating them costs no memory.
_KNOWN = {s.encode(): s for name in ALLOWED for s in _name_parts(name)}
_KNOWN.update({s.encode(): s for s in (*STEP_KEYS, "torch", "torch.cuda", "builtins",
                                       "__builtin__", "copy_reg", "copyreg")})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def allowed_global(module: str, name: str, *, protocol: int = 4) -> bool:
    """Does `module.name` (as the loader resolves it for a pickle of `protocol`) name something
    checkpoints hold? The allow-list of the module docstring."""
    if protocol < 3:  # the loader's fix_imports: Python 2 names to Python 3 ones
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
    full = f"{module}.{name}"
    return full in ALLOWED or _TORCH_NAME.fullmatch(full) is not None


def unsafe_global(module: str, name: str) -> bool:
    """Would a pickle naming `module.name` be refused? (Kept for callers of the deny-list
    this module had: now anything not on the allow-list.)"""
    return not (allowed_global(module, name, protocol=2) or allowed_global(module, name))


def scan(data: bytes | BinaryIO, *, what: str = "data.pkl", any_global: bool = False) -> Scan:
    """Walk one pickle (bytes, or a stream: left just after its STOP); raise `PickleRefused`
    when it names a global outside the allow-list, is malformed, or costs more than its size
    allows. `any_global`: names are counted, not judged (a file no resume ever loads, such as
    a Trainer's training_args.bin); the bounds hold all the same."""
    if hasattr(data, "read"):
        stream = data
        start = stream.tell() if stream.seekable() else 0
        end, out = _walk(stream.read(), what, any_global)
        if stream.seekable():
            stream.seek(start + end)
        return out
    return _walk(bytes(data) if not isinstance(data, bytes) else data, what, any_global)[1]


def _refuse(what: str, why: str) -> PickleRefused:
    return PickleRefused(f"{what}: {why}")


def _walk(buf: bytes, what: str, any_global: bool) -> tuple[int, Scan]:
    size = len(buf)
    max_memo = max(1 << 16, int(size * MAX_MEMO_PER_BYTE))
    deadline = time.monotonic() + MAX_SECONDS
    stack: list[object] = []
    push, pop_ = stack.append, stack.pop
    memo: list[object] = []
    sparse: dict[int, object] = {}
    named = 0
    dicts = 0
    kept = 0
    proto = 0
    pos = 0
    next_check = 0x10000
    unpack_from = struct.unpack_from
    known = _KNOWN

    def pop() -> object:
        if not stack:
            raise _refuse(what, "malformed pickle (stack underflow)")
        return pop_()

    def pop_mark() -> list[object]:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                items = stack[i + 1:]
                del stack[i:]
                return items
        raise _refuse(what, "malformed pickle (no mark on the stack)")

    def string(raw: bytes) -> object:
        nonlocal kept
        s = known.get(raw)
        if s is not None:
            return s
        if kept < _KEEP_OTHER_STRINGS and len(raw) <= _MAX_STRING:
            kept += 1
            return raw.decode("utf-8", "replace")
        return _OTHER_STR

    def new_dict() -> object:
        nonlocal dicts
        dicts += 1
        return _Obj() if dicts <= _TRACKED_DICTS else _OPAQUE

    def check(module: object, name: object, op: str) -> object:
        nonlocal named
        named += 1
        if not isinstance(module, str) or not isinstance(name, str):
            raise _refuse(what, f"{op} with a name that is not a plain string (refused: it "
                                "could name anything)")
        if not any_global and not allowed_global(module, name, protocol=proto):
            raise _refuse(what, f"the pickle calls {module}.{name} when loaded, which no "
                                "checkpoint format rtrain resumes from writes (refused, never "
                                "run)")
        full = module + "." + name if proto >= 3 else _mapped(module, name)
        return _CALLABLE_DICT if full in _DICT_CLASSES else _OPAQUE

    def line() -> bytes:
        nonlocal pos
        end = buf.find(b"\n", pos)
        if end < 0:
            raise _refuse(what, "not a readable pickle (cut short: no end of line)")
        raw = buf[pos:end]
        pos = end + 1
        return raw

    def counted(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > size:
            raise _refuse(what, "not a readable pickle (cut short: a string runs past its end)")
        raw = buf[pos:pos + n]
        pos += n
        return raw

    def memo_put(index: int, value: object) -> None:
        if len(memo) + len(sparse) >= max_memo:
            raise _refuse(what, f"the pickle memoizes more than {max_memo} objects for "
                                f"{size} bytes: pickle never writes that (refused)")
        if isinstance(value, int) and not isinstance(value, bool):
            value = _OPAQUE  # never a step: pickle does not memoize integers
        if index == len(memo):
            memo.append(value)
        elif index < len(memo):
            memo[index] = value
        else:
            sparse[index] = value

    def memo_get(index: int) -> object:
        if index < len(memo):
            return memo[index]
        if index in sparse:
            return sparse[index]
        raise _refuse(what, f"malformed pickle (memo {index} read before it was written)")

    try:
        while True:
            if pos >= size:
                raise _refuse(what, "not a readable pickle (cut short: no STOP)")
            code = buf[pos]
            pos += 1
            if pos >= next_check:  # every 64 KiB: at most that many opcodes since the last
                next_check = pos + 0x10000
                if time.monotonic() > deadline:
                    raise _refuse(what, f"the pickle takes more than {MAX_SECONDS:.0f} s to "
                                        "check (refused)")
                if len(stack) > MAX_STACK:
                    raise _refuse(what, f"the pickle holds more than {MAX_STACK} items at "
                                        "once: pickle never writes that (refused)")
            if code == 0x71:  # BINPUT
                memo_put(buf[pos], stack[-1] if stack else pop())
                pos += 1
            elif code == 0x68:  # BINGET
                push(memo_get(buf[pos]))
                pos += 1
            elif code == 0x94:  # MEMOIZE
                memo_put(len(memo), stack[-1] if stack else pop())
            elif code == 0x4B:  # BININT1
                push(buf[pos])
                pos += 1
            elif code == 0x28:  # MARK
                push(_MARK)
            elif code == 0x58 or code == 0x8C or code == 0x8D:  # (SHORT_)BINUNICODE(8)
                if code == 0x8C:
                    n = buf[pos]
                    pos += 1
                elif code == 0x58:
                    n = unpack_from("<I", buf, pos)[0]
                    pos += 4
                else:
                    n = unpack_from("<Q", buf, pos)[0]
                    pos += 8
                push(string(counted(n)))
            elif code == 0x72:  # LONG_BINPUT
                memo_put(unpack_from("<I", buf, pos)[0], stack[-1] if stack else pop())
                pos += 4
            elif code == 0x6A:  # LONG_BINGET
                push(memo_get(unpack_from("<I", buf, pos)[0]))
                pos += 4
            elif code == 0x4A:  # BININT
                push(unpack_from("<i", buf, pos)[0])
                pos += 4
            elif code == 0x4D:  # BININT2
                push(unpack_from("<H", buf, pos)[0])
                pos += 2
            elif code == 0x74:  # TUPLE
                pop_mark()
                push(_OPAQUE)
            elif code in (0x85, 0x86, 0x87):  # TUPLE1..3
                for _ in range(code - 0x84):
                    pop()
                push(_OPAQUE)
            elif code == 0x29 or code == 0x5D or code == 0x4E or code == 0x8F:
                push(_OPAQUE)  # EMPTY_TUPLE, EMPTY_LIST, NONE, EMPTY_SET
            elif code == 0x88:  # NEWTRUE
                push(True)
            elif code == 0x89:  # NEWFALSE
                push(False)
            elif code == 0x7D:  # EMPTY_DICT
                push(new_dict())
            elif code == 0x52:  # REDUCE
                pop()
                func = pop()
                # OrderedDict() and friends: keep collecting the items set on the result.
                push(new_dict() if func is _CALLABLE_DICT else _OPAQUE)
            elif code == 0x51:  # BINPERSID
                pop()
                push(_OPAQUE)
            elif code == 0x73:  # SETITEM
                value, key = pop(), pop()
                target = stack[-1] if stack else None
                if isinstance(target, _Obj):
                    target.set(key, value)
            elif code == 0x75:  # SETITEMS
                items = pop_mark()
                target = stack[-1] if stack else None
                if isinstance(target, _Obj):
                    for k, v in zip(items[::2], items[1::2], strict=False):
                        target.set(k, v)
            elif code == 0x61 or code == 0x62:  # APPEND, BUILD
                pop()
                if not stack:
                    raise _refuse(what, "malformed pickle (stack underflow)")
            elif code == 0x65 or code == 0x90:  # APPENDS, ADDITEMS
                pop_mark()
            elif code == 0x93:  # STACK_GLOBAL
                name = pop()
                module = pop()
                push(check(module, name, "STACK_GLOBAL"))
            elif code == 0x63:  # GLOBAL
                module = line().decode("utf-8", "replace")
                name = line().decode("utf-8", "replace")
                push(check(module, name, "GLOBAL"))
            elif code == 0x69:  # INST
                module = line().decode("utf-8", "replace")
                name = line().decode("utf-8", "replace")
                check(module, name, "INST")
                pop_mark()
                push(_OPAQUE)
            elif code == 0x81:  # NEWOBJ
                pop()
                cls = pop()
                push(new_dict() if cls is _CALLABLE_DICT else _OPAQUE)
            elif code == 0x92:  # NEWOBJ_EX
                pop()
                pop()
                cls = pop()
                push(new_dict() if cls is _CALLABLE_DICT else _OPAQUE)
            elif code == 0x6F:  # OBJ
                items = pop_mark()
                if not items:
                    raise _refuse(what, "malformed pickle (OBJ without a class)")
                push(_OPAQUE)
            elif code == 0x2E:  # STOP
                result = pop()
                break
            elif code == 0x80:  # PROTO
                proto = buf[pos]
                pos += 1
            elif code == 0x95:  # FRAME: a length only, the opcodes follow as usual
                pos += 8
            elif code == 0x30:  # POP
                pop()
            elif code == 0x31:  # POP_MARK
                pop_mark()
            elif code == 0x32:  # DUP
                push(stack[-1] if stack else pop())
            elif code == 0x47:  # BINFLOAT
                pos += 8
                push(_OPAQUE)
            elif code == 0x8A or code == 0x8B:  # LONG1, LONG4
                if code == 0x8A:
                    n = buf[pos]
                    pos += 1
                else:
                    n = unpack_from("<i", buf, pos)[0]
                    pos += 4
                raw = counted(n)  # an int of more than 8 bytes is no step: not decoded
                push(int.from_bytes(raw, "little", signed=True) if n <= 8 else _OPAQUE)
            elif code in (0x43, 0x42, 0x8E, 0x96, 0x55, 0x54):  # bytes, bytearray, 8-bit str
                if code == 0x43 or code == 0x55:
                    n = buf[pos]
                    pos += 1
                elif code == 0x42 or code == 0x54:
                    n = unpack_from("<I" if code == 0x42 else "<i", buf, pos)[0]
                    pos += 4
                else:
                    n = unpack_from("<Q", buf, pos)[0]
                    pos += 8
                raw = counted(n)
                push(string(raw) if code in (0x55, 0x54) else _OPAQUE)
            elif code == 0x6C:  # LIST
                pop_mark()
                push(_OPAQUE)
            elif code == 0x64:  # DICT
                items = pop_mark()
                d = new_dict()
                if isinstance(d, _Obj):
                    for k, v in zip(items[::2], items[1::2], strict=False):
                        d.set(k, v)
                push(d)
            elif code == 0x91:  # FROZENSET
                pop_mark()
                push(_OPAQUE)
            elif code == 0x49:  # INT: "00"/"01" are False/True at protocol 0
                text = line()
                push(False if text == b"00" else True if text == b"01" else int(text))
            elif code == 0x4C:  # LONG
                push(int(line().rstrip(b"L")))
            elif code == 0x46:  # FLOAT
                float(line())
                push(_OPAQUE)
            elif code == 0x53:  # STRING: a quoted repr
                raw = line()
                if len(raw) < 2 or raw[:1] != raw[-1:] or raw[:1] not in (b"'", b'"'):
                    raise _refuse(what, "malformed pickle (STRING not quoted)")
                push(string(codecs.escape_decode(raw[1:-1])[0]))
            elif code == 0x56:  # UNICODE
                push(string(line().decode("raw-unicode-escape").encode()))
            elif code == 0x67:  # GET
                push(memo_get(int(line())))
            elif code == 0x70:  # PUT
                memo_put(int(line()), stack[-1] if stack else pop())
            elif code == 0x50:  # PERSID
                line()
                push(_OPAQUE)
            elif code in (0x82, 0x83, 0x84):  # EXT1, EXT2, EXT4
                raise _refuse(what, "the pickle names a function through the extension "
                                    "registry (refused: it could name anything)")
            elif code in (0x97, 0x98):  # NEXT_BUFFER, READONLY_BUFFER
                raise _refuse(what, "the pickle needs out-of-band buffers, which no "
                                    "checkpoint has (refused)")
            else:
                raise _refuse(what, f"not a readable pickle (opcode {code:#04x} at byte "
                                    f"{pos - 1})")
    except (struct.error, IndexError, ValueError, UnicodeDecodeError, OverflowError) as e:
        if isinstance(e, PickleRefused):
            raise
        raise _refuse(what, f"not a readable pickle ({e})") from None
    step, key = None, None
    if isinstance(result, _Obj):
        key = next((k for k in STEP_KEYS if k in result.items), None)
        step = result.items[key] if key is not None else None
        if step is None or step < 0:  # the first key present decides: a -1 is no step
            step, key = None, None
    return pos, Scan(step=step, step_key=key, globals_named=named)


def _mapped(module: str, name: str) -> str:
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    else:
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    return f"{module}.{name}"


_CALLABLE_DICT = _Opaque()  # a global that makes a dict (OrderedDict, AttributeDict)
