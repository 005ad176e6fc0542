"""The events schema is defined once (`events.KINDS`): every emitter in the code and the hook
config agree with it, and `emit` refuses anything else (docs/reference.md's table is generated
from it: tests/test_reference.py)."""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

import pytest

from rtrain.supervisor.core.event_schema import DURABLE_KINDS, KINDS, Kind
from rtrain.supervisor.hooks.hook_spec import HOOKABLE
from rtrain.supervisor.records import events as ev
from rtrain.supervisor.records.events import EventLog, EventSchemaError, read_events

ROOT = Path(__file__).resolve().parent.parent
# Written by EventLog itself (not through emit) once a full disk has room again.
NOT_EMITTED = {Kind.EVENTS_LOST}


def _emits(path: Path) -> list[tuple[str, str, list[str], int]]:
    """(kind, file, keyword names, line) of every emit(...) / report(...) call with a literal
    kind: a string or a Kind member."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("emit", "report") and node.args):
            continue
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            kind = first.value
        elif (isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name)
              and first.value.id == "Kind"):
            kind = Kind[first.attr].value
        else:
            continue
        found.append((kind, str(path.relative_to(ROOT)),
                      [k.arg for k in node.keywords if k.arg is not None], node.lineno))
    return found


@functools.cache
def all_emits() -> list[tuple[str, str, list[str], int]]:
    files = sorted([*(ROOT / "supervisor").rglob("*.py"), *(ROOT / "worker").rglob("*.py")])
    return [e for f in files for e in _emits(f)]


def test_every_emitter_uses_registered_kinds_and_fields():
    emits = all_emits()
    assert len(emits) > 20, "the scan found too few emitters: did the call sites move?"
    for kind, where, fields, line in emits:
        assert kind in {k.value for k in KINDS}, f"{where}:{line}: unregistered kind {kind!r}"
        spec = KINDS[Kind(kind)]
        unknown = set(fields) - set(spec.fields) - set(spec.optional)
        assert not unknown, f"{where}:{line}: {kind} has no field {sorted(unknown)}"


def test_every_registered_kind_is_emitted_somewhere():
    emitted = {kind for kind, *_ in all_emits()}
    assert {k.value for k in KINDS} - {k.value for k in NOT_EMITTED} == emitted


def test_emit_refuses_unknown_kinds_and_fields(tmp_path):
    with EventLog(tmp_path / "events.jsonl") as log:
        with pytest.raises(EventSchemaError, match="'preempted' is not an event kind"):
            log.emit("preempted", reason="x")
        with pytest.raises(EventSchemaError, match="classification events have no field "
                                                   "failure_kind"):
            log.emit("classification", attempt=0, failure_kind="crash", reason="r")
        log.emit(Kind.FINISHED, reason="done")  # a member or its name
        log.emit("signal", name="SIGTERM")
    events = read_events(tmp_path / "events.jsonl")
    assert [(e["seq"], e["kind"]) for e in events] == [(1, "finished"), (2, "signal")]
    assert type(events[0]["kind"]) is str


def test_durable_kinds_are_fsynced_at_once_the_rest_by_sync_or_close(tmp_path, monkeypatch):
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(ev.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    with EventLog(tmp_path / "events.jsonl") as log:
        for kind, spec in KINDS.items():
            if kind is Kind.EVENTS_LOST:
                continue
            before = len(synced)
            log.emit(kind)
            assert (len(synced) > before) == spec.durable, kind.value
        log.emit(Kind.DECISION)
        before = len(synced)
        log.sync()  # nothing written since the durable decision: no second fsync
        assert len(synced) == before
        log.emit(Kind.SIGNAL)
    assert len(synced) == before + 1  # close syncs what is left
    assert set(DURABLE_KINDS) == {"launch", "decision", "give_up", "requeue", "finished",
                                  "lock_takeover", "final_state_unsaved", "mirror_final",
                                  "mirror_downloaded"}


def test_hooks_accept_the_hookable_kinds_only():
    for kind, spec in KINDS.items():
        assert (kind.value in HOOKABLE) == spec.hookable, kind.value
