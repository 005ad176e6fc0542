"""Terminal injection: strings from checkpoint dirs and run files (metric and setting names and
values, file and directory names, reasons) are printed escaped in text output, so an escape
sequence never reaches the terminal and a newline never forges a row; JSON keeps them exact."""

from __future__ import annotations

import json

import pytest

from rtrain.supervisor.records.events import EventLog

ESC_TITLE = "\x1b]0;pwned\x07"
CLEAR = "\x1b[2J"
FORGED = "\n  *  999  9  2026-01-01 00:00:00  1 KiB  loss=0  -  ok"


def assert_clean(text: str, lines: int | None = None) -> None:
    assert "\x1b" not in text and "\x07" not in text
    assert not any(ln.lstrip().startswith("*  999") for ln in text.splitlines())  # no forged row
    if lines is not None:
        assert len(text.splitlines()) == lines, text


@pytest.fixture
def hostile(tmp_path, make_ckpt):
    d = tmp_path / "checkpoints"
    make_ckpt(d, 100, metrics={"loss": 0.5})
    make_ckpt(d, 200, metrics={f"{ESC_TITLE}loss": 0.25, "note": f"fine{FORGED}"},
              settings={"batch_size": CLEAR, f"lr{FORGED}": 1})
    (d / "checkpoint-200" / f"evil{CLEAR}{FORGED}.bin").write_bytes(b"x")
    (d / f".tmp-checkpoint-{ESC_TITLE}{FORGED}").mkdir()  # a name no save makes
    return d


def test_inspect_listing_escapes_metrics_settings_and_names(rtrain, hostile):
    r = rtrain("inspect", str(hostile))
    assert r.returncode == 0, r.stderr
    # header, table head, 2 rows, resume line, "leftovers:", 1 leftover
    assert_clean(r.stdout, lines=7)
    assert "'\\x1b]0;pwned\\x07loss'=0.25" in r.stdout
    assert [ln.split()[0] for ln in r.stdout.splitlines()[2:4]] == ["*", "100"]


def test_inspect_one_escapes_file_names(rtrain, hostile):
    r = rtrain("inspect", str(hostile / "checkpoint-200"))
    assert r.returncode == 0, r.stderr
    assert_clean(r.stdout)
    assert "not in manifest" in r.stdout
    assert repr(f"evil{CLEAR}{FORGED}.bin") in r.stdout


def test_json_output_keeps_the_exact_strings(rtrain, hostile):
    r = rtrain("inspect", str(hostile), "--json")
    entry = next(c for c in json.loads(r.stdout)["checkpoints"] if c["step"] == 200)
    assert entry["metrics"][f"{ESC_TITLE}loss"] == 0.25
    assert entry["settings"] == {"batch_size": CLEAR, f"lr{FORGED}": 1}
    one = json.loads(rtrain("inspect", str(hostile / "checkpoint-200"), "--json").stdout)
    assert f"evil{CLEAR}{FORGED}.bin" in [f["name"] for f in one["files"]]


def test_prune_escapes_names_and_reasons(rtrain, hostile):
    r = rtrain("prune", str(hostile), "--keep", "1")
    assert r.returncode == 0, r.stderr
    assert_clean(r.stdout)
    assert repr(f".tmp-checkpoint-{ESC_TITLE}{FORGED}") in r.stdout


def test_status_escapes_reasons_and_settings(rtrain, tmp_path, hostile):
    run_dir = hostile.parent
    with EventLog(run_dir / "events.jsonl") as log:
        log.emit("launch", attempt=0, argv=["python", "t.py"], resume_from=None, pid=1,
                 settings={"batch_size": CLEAR}, level=0, ckpt_dir="checkpoints")
        log.emit("classification", attempt=0, failure="crash",
                 reason=f"RuntimeError: {ESC_TITLE}{FORGED}")
    r = rtrain("status", str(run_dir))
    assert r.returncode == 0, r.stderr
    assert_clean(r.stdout)
    assert "\\x1b[2J" in r.stdout and "RuntimeError" in r.stdout


def test_safe_leaves_printable_text_alone():
    from rtrain.supervisor.core.untrusted_text import safe

    assert safe("checkpoint-100 loss=0.5 (ok)") == "checkpoint-100 loss=0.5 (ok)"
    assert safe("a\nb") == "'a\\nb'"
    assert safe("\u202eevil") == "'\\u202eevil'"  # a bidi override reorders what follows
