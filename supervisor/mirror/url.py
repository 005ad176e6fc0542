"""Telling a mirror URL from a directory, and showing one without its secrets. Pure and cheap:
the CLI asks before deciding whether to import the mirror code (and fsspec) at all."""

from __future__ import annotations

import re

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_USERINFO_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@?#]*@")


def scheme(text: str) -> str | None:
    """The URL scheme in lower case (`s3`, `file`), or None for a plain path."""
    m = _SCHEME_RE.match(text)
    return m.group(1).lower() if m else None


def is_url(text: str) -> bool:
    """Whether `text` names a mirror (`scheme://...`) rather than a local directory."""
    return scheme(text) is not None


def redact(url: str) -> str:
    """`url` as it may be shown: no `user:password@`, no query or fragment (tokens live there)."""
    return re.split(r"[?#]", _USERINFO_RE.sub(r"\1", url), maxsplit=1)[0]


def split_checkpoint(url: str) -> tuple[str, str] | None:
    """`(mirror url, checkpoint name)` when `url` ends in a checkpoint's name, else None."""
    from rtrain.checkpoint.layout import parse_step

    base, _, last = url.rstrip("/").rpartition("/")
    if parse_step(last) is None or not base or base.endswith(":/"):
        return None
    return base, last
