"""Bitwise comparison of nested training state (state dicts, optimizer states)."""

from __future__ import annotations

from typing import Any


def _bits(t):
    import torch

    # Compare the bytes, so -0.0 vs 0.0 or two different NaNs count as different.
    return t.reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t


def bitwise_diff(a: Any, b: Any, path: str = "state") -> str | None:
    """None when `a` and `b` (nested state dicts) are bitwise identical, else where they differ."""
    import torch

    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return path
        return None if torch.equal(_bits(a), _bits(b)) else path
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return path
        return next((d for k in a if (d := bitwise_diff(a[k], b[k], f"{path}.{k}"))), None)
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return path
        return next((d for i, (x, y) in enumerate(zip(a, b, strict=True)) if (d := bitwise_diff(
            x, y, f"{path}[{i}]"))), None)
    return None if a == b else path


def assert_bitwise_equal(a: Any, b: Any, path: str = "state") -> None:
    where = bitwise_diff(a, b, path)
    assert where is None, f"not bitwise identical at {where}"
