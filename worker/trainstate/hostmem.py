"""Fresh host memory for a checkpoint file's bytes, on huge pages where the kernel offers them.

A restore reads each file into memory of its own before anything is used (the bytes used must
be the bytes hashed). Filling fresh memory costs a page fault per 4 KiB page, in which the
kernel finds, zeroes and maps the page: 262144 faults for 1 GiB, measured as most of a
restore's time. Advising transparent huge pages on the buffer (MADV_HUGEPAGE, honoured when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`) makes that 512 faults of
2 MiB. The advice changes nothing but the page size; where it is not available (not Linux,
THP off) the buffer is ordinary memory and only slower to fill.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def _find_madvise():
    if _MADV_HUGEPAGE is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _find_madvise()


def fresh_bytes(n: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of n bytes (an ordinary torch allocation, freed as
    usual), whose whole 2 MiB spans are advised to be huge pages before anything touches them."""
    t = torch.empty(n, dtype=torch.uint8)
    if _madvise is not None and n >= 2 * _HUGE:
        start = -(-t.data_ptr() // _HUGE) * _HUGE
        stop = (t.data_ptr() + n) // _HUGE * _HUGE
        if stop > start:
            _madvise(start, stop - start, _MADV_HUGEPAGE)  # advice only: failing changes nothing
    return t
