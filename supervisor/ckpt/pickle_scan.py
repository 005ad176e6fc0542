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
  refused), integers never in the memo, opaque values as one shared marker; each opcode is one
  small function found by its byte, so no opcode is dearer to flood with than another. A
  pickle that memoizes more than `MAX_MEMO_PER_BYTE` entries per byte or many out of order,
  holds more than `MAX_STACK` items, or takes longer than `MAX_SECONDS` is refused: `pickle`
  itself never writes one.

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
    # A DCP save's `.metadata` (torchtitan's step-N): torch's own records of its shards.
    *(f"torch.distributed.checkpoint.metadata.{c}" for c in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
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


class _Stop(Exception):  # not an error: the STOP opcode, carrying the pickle's result
    def __init__(self, value: object) -> None:
        self.value = value


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
_MAX_SPARSE = 1 << 16  # memo entries written out of order: pickle writes none


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

    def skip(n: int) -> None:  # bytes whose value does not matter: not copied
        nonlocal pos
        if n < 0 or pos + n > size:
            raise _refuse(what, "not a readable pickle (cut short: a string runs past its end)")
        pos += n

    def text(n: int) -> object:
        if n > _MAX_STRING:  # no allowed name or step key is this long
            skip(n)
            return _OTHER_STR
        return string(counted(n))

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
        elif len(sparse) < _MAX_SPARSE:
            sparse[index] = value
        else:
            raise _refuse(what, f"the pickle writes more than {_MAX_SPARSE} memo entries out "
                                "of order: pickle never writes that (refused)")

    def memo_get(index: int) -> object:
        if index < len(memo):
            return memo[index]
        if index in sparse:
            return sparse[index]
        raise _refuse(what, f"malformed pickle (memo {index} read before it was written)")

    # One small function per opcode, found by its byte: a flood of the opcode the walk takes
    # longest on costs no more than any other (a chain of tests would make the last one dear).
    def top() -> object:
        return stack[-1] if stack else pop()

    def u1() -> int:
        nonlocal pos
        pos += 1
        return buf[pos - 1]

    def fixed(fmt: str, n: int) -> int:
        nonlocal pos
        pos += n
        return unpack_from(fmt, buf, pos - n)[0]

    def op_binput() -> None:
        memo_put(u1(), top())

    def op_binget() -> None:
        push(memo_get(u1()))

    def op_long_binput() -> None:
        memo_put(fixed("<I", 4), top())

    def op_long_binget() -> None:
        push(memo_get(fixed("<I", 4)))

    def op_memoize() -> None:
        memo_put(len(memo), top())

    def op_binint1() -> None:
        push(u1())

    def op_binint() -> None:
        push(fixed("<i", 4))

    def op_binint2() -> None:
        push(fixed("<H", 2))

    def op_mark() -> None:
        push(_MARK)

    def op_short_binunicode() -> None:  # also SHORT_BINSTRING
        push(text(u1()))

    def op_binunicode() -> None:
        push(text(fixed("<I", 4)))

    def op_binunicode8() -> None:
        push(text(fixed("<Q", 8)))

    def op_binstring() -> None:
        push(text(fixed("<i", 4)))

    def op_short_binbytes() -> None:
        skip(u1())
        push(_OPAQUE)

    def op_binbytes() -> None:
        skip(fixed("<I", 4))
        push(_OPAQUE)

    def op_binbytes8() -> None:  # BINBYTES8, BYTEARRAY8
        skip(fixed("<Q", 8))
        push(_OPAQUE)

    def op_opaque() -> None:  # EMPTY_TUPLE, EMPTY_LIST, NONE, EMPTY_SET
        push(_OPAQUE)

    def op_true() -> None:
        push(True)

    def op_false() -> None:
        push(False)

    def op_from_mark() -> None:  # TUPLE, LIST, FROZENSET
        pop_mark()
        push(_OPAQUE)

    def op_tuple1() -> None:
        pop()
        push(_OPAQUE)

    def op_tuple2() -> None:
        pop()
        pop()
        push(_OPAQUE)

    def op_tuple3() -> None:
        pop()
        pop()
        pop()
        push(_OPAQUE)

    def op_empty_dict() -> None:
        push(new_dict())

    def op_dict() -> None:
        items = pop_mark()
        d = new_dict()
        if isinstance(d, _Obj):
            for k, v in zip(items[::2], items[1::2], strict=False):
                d.set(k, v)
        push(d)

    def op_reduce() -> None:
        pop()
        func = pop()
        # OrderedDict() and friends: keep collecting the items set on the result.
        push(new_dict() if func is _CALLABLE_DICT else _OPAQUE)

    def op_newobj() -> None:
        pop()
        push(new_dict() if pop() is _CALLABLE_DICT else _OPAQUE)

    def op_newobj_ex() -> None:
        pop()
        pop()
        push(new_dict() if pop() is _CALLABLE_DICT else _OPAQUE)

    def op_obj() -> None:
        if not pop_mark():
            raise _refuse(what, "malformed pickle (OBJ without a class)")
        push(_OPAQUE)

    def op_binpersid() -> None:  # a storage torch keeps outside the pickle
        pop()
        push(_OPAQUE)

    def op_setitem() -> None:
        value, key = pop(), pop()
        target = stack[-1] if stack else None
        if isinstance(target, _Obj):
            target.set(key, value)

    def op_setitems() -> None:
        items = pop_mark()
        target = stack[-1] if stack else None
        if isinstance(target, _Obj):
            for k, v in zip(items[::2], items[1::2], strict=False):
                target.set(k, v)

    def op_append() -> None:  # APPEND, BUILD: the target stays
        pop()
        if not stack:
            raise _refuse(what, "malformed pickle (stack underflow)")

    def op_appends() -> None:  # APPENDS, ADDITEMS
        pop_mark()
        if not stack:
            raise _refuse(what, "malformed pickle (stack underflow)")

    def op_stack_global() -> None:
        name = pop()
        push(check(pop(), name, "STACK_GLOBAL"))

    def op_global() -> None:
        module = line().decode("utf-8", "replace")
        push(check(module, line().decode("utf-8", "replace"), "GLOBAL"))

    def op_inst() -> None:
        module = line().decode("utf-8", "replace")
        check(module, line().decode("utf-8", "replace"), "INST")
        pop_mark()
        push(_OPAQUE)

    def op_stop() -> None:
        raise _Stop(pop())

    def op_proto() -> None:
        nonlocal proto
        proto = u1()

    def op_frame() -> None:  # a length only: the opcodes follow as usual
        nonlocal pos
        pos += 8

    def op_pop() -> None:
        pop()

    def op_pop_mark() -> None:
        pop_mark()

    def op_dup() -> None:
        push(top())

    def op_binfloat() -> None:
        nonlocal pos
        pos += 8
        push(_OPAQUE)

    def op_long1() -> None:
        n = u1()
        raw = counted(n)  # an int of more than 8 bytes is no step: not decoded
        push(int.from_bytes(raw, "little", signed=True) if n <= 8 else _OPAQUE)

    def op_long4() -> None:
        skip(fixed("<i", 4))
        push(_OPAQUE)

    def op_int() -> None:  # "00"/"01" are False/True at protocol 0
        text = line()
        push(False if text == b"00" else True if text == b"01" else int(text))

    def op_long() -> None:
        push(int(line().rstrip(b"L")))

    def op_float() -> None:
        float(line())
        push(_OPAQUE)

    def op_string() -> None:  # a quoted repr
        raw = line()
        if len(raw) < 2 or raw[:1] != raw[-1:] or raw[:1] not in (b"'", b'"'):
            raise _refuse(what, "malformed pickle (STRING not quoted)")
        push(string(codecs.escape_decode(raw[1:-1])[0]))

    def op_unicode() -> None:
        push(string(line().decode("raw-unicode-escape").encode()))

    def op_get() -> None:
        push(memo_get(int(line())))

    def op_put() -> None:
        memo_put(int(line()), top())

    def op_persid() -> None:
        line()
        push(_OPAQUE)

    def op_ext() -> None:
        raise _refuse(what, "the pickle names a function through the extension registry "
                            "(refused: it could name anything)")

    def op_buffer() -> None:
        raise _refuse(what, "the pickle needs out-of-band buffers, which no checkpoint has "
                            "(refused)")

    def op_unknown() -> None:
        raise _refuse(what, f"not a readable pickle (opcode {buf[pos - 1]:#04x} at byte "
                            f"{pos - 1})")

    ops = [op_unknown] * 256
    for codes, op in (
            (b"q", op_binput), (b"h", op_binget), (b"r", op_long_binput),
            (b"j", op_long_binget), (b"\x94", op_memoize), (b"K", op_binint1),
            (b"J", op_binint), (b"M", op_binint2), (b"(", op_mark),
            (b"\x8c", op_short_binunicode), (b"X", op_binunicode), (b"\x8d", op_binunicode8),
            (b"U", op_short_binunicode), (b"T", op_binstring), (b"C", op_short_binbytes),
            (b"B", op_binbytes), (b"\x8e\x96", op_binbytes8), (b")]N\x8f", op_opaque),
            (b"\x88", op_true), (b"\x89", op_false), (b"tl\x91", op_from_mark),
            (b"\x85", op_tuple1), (b"\x86", op_tuple2), (b"\x87", op_tuple3),
            (b"}", op_empty_dict), (b"d", op_dict), (b"R", op_reduce), (b"\x81", op_newobj),
            (b"\x92", op_newobj_ex), (b"o", op_obj), (b"Q", op_binpersid),
            (b"s", op_setitem), (b"u", op_setitems), (b"ab", op_append),
            (b"e\x90", op_appends), (b"\x93", op_stack_global), (b"c", op_global),
            (b"i", op_inst), (b".", op_stop), (b"\x80", op_proto), (b"\x95", op_frame),
            (b"0", op_pop), (b"1", op_pop_mark), (b"2", op_dup), (b"G", op_binfloat),
            (b"\x8a", op_long1), (b"\x8b", op_long4), (b"I", op_int), (b"L", op_long),
            (b"F", op_float), (b"S", op_string), (b"V", op_unicode), (b"g", op_get),
            (b"p", op_put), (b"P", op_persid), (b"\x82\x83\x84", op_ext),
            (b"\x97\x98", op_buffer)):
        for code in codes:
            ops[code] = op
    try:
        while True:
            if pos >= next_check:  # every 64 KiB: at most that many opcodes since the last
                next_check = pos + 0x10000
                if time.monotonic() > deadline:
                    raise _refuse(what, f"the pickle takes more than {MAX_SECONDS:.0f} s to "
                                        "check (refused)")
                if len(stack) > MAX_STACK:
                    raise _refuse(what, f"the pickle holds more than {MAX_STACK} items at "
                                        "once: pickle never writes that (refused)")
            pos += 1
            ops[buf[pos - 1]]()
    except _Stop as stop:
        result = stop.value
    except IndexError:  # buf[pos] past the end, an opcode's argument cut off
        raise _refuse(what, "not a readable pickle (cut short: no STOP)") from None
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError) as e:
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
