"""Strings from files anyone could have written, made safe to print on a terminal.

Metric and setting names, file and directory names, reasons quoting them: all come from
checkpoint directories and run files. Printed raw, an escape sequence in one of them drives the
terminal (recolours, rewrites the screen, sets the window title) and a newline forges a line of
rtrain's own output, such as a fake `ok` row. Text output passes every such string through
`safe`; JSON output keeps the exact value (json.dumps escapes control characters itself).
"""

from __future__ import annotations


def safe(text: object) -> str:
    """`text` unchanged when every character prints; else its repr(), quotes included, so an
    escaped name can never be mistaken for a plain one."""
    s = str(text)
    return s if s.isprintable() else repr(s)
