"""The command line behaves like one: a mistyped rtrain option is named (an error before the
script, a warning after it), every hint names an option that exists, and `status`, `inspect`,
`prune` and `report` find the run they are run inside."""

from __future__ import annotations

import re

import pytest
from harness import write_events

from rtrain.supervisor.commands.option_typos import misspelt_after_script, one_edit_away

LAUNCH_OPTIONS = ["--resume", "--resume-arg", "--run-dir", "--ckpt-dir", "--max-restarts",
                  "--set", "--quiet", "-q", "--nnodes"]


@pytest.mark.parametrize("a, b, near", [
    ("--resum", "--resume", True), ("--resumee", "--resume", True),
    ("--rseume", "--resume", True), ("--resuem", "--resume", True),
    ("--resume", "--resume", False), ("--rsm", "--resume", False),
    ("--ckpt-dri", "--ckpt-dir", True), ("--cpkt-dri", "--ckpt-dir", False)])
def test_one_edit(a, b, near):
    assert one_edit_away(a, b) is near and one_edit_away(b, a) is near


def test_only_near_misses_of_long_options_are_warned():
    lines = misspelt_after_script(
        ["--resum", "auto", "--lr=0.1", "--ckpt_dir", "x", "--resume", "--max-restart=3",
         "--nodes", "-x", "--seed"], LAUNCH_OPTIONS)
    assert [line.split()[0] for line in lines] == ["--resum", "--max-restart", "--nodes"]
    assert lines[0] == ("--resum looks like rtrain's --resume; it goes to the script as written "
                        "(rtrain options are spelt exactly and go before the script)")


@pytest.mark.parametrize("args, nearest", [
    (["--bogus", "x.py"], "--nnodes"), (["--resum", "auto", "x.py"], "--resume"),
    (["--resume", "auto", "--max-restart=3", "x.py"], "--max-restarts"), (["-z", "x.py"], "-m")])
def test_an_unknown_option_before_the_script_is_a_usage_error(rtrain, tmp_path, args, nearest):
    (tmp_path / "x.py").write_text("")
    r = rtrain("launch", *args, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    name = args[2] if args[0] == "--resume" else args[0]
    assert line == (f"rtrain: error: no such option {name.split('=')[0]} for rtrain launch (the "
                    f"nearest is {nearest}); the script's own options go after the script")
    assert not (tmp_path / "rtrain-run").exists()


def test_a_misspelt_option_after_the_script_is_warned_and_handed_on(rtrain, tmp_path):
    # The script is missing, so the launch stops at once (no process here): the warning comes
    # first, and after `--` nothing is judged.
    r = rtrain("launch", "absent.py", "--resum", "auto", "--lr", "1", "--", "--resum",
               cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "rtrain: warning: --resum looks like rtrain's --resume; it goes to the script as "
        "written (rtrain options are spelt exactly and go before the script)",
        f"rtrain: error: no such script 'absent.py' (relative to {tmp_path})"]


def test_a_command_after_double_dash_is_not_an_option(rtrain, tmp_path):
    r = rtrain("launch", "--", "--not-a-command", cwd=tmp_path)
    assert r.returncode == 2
    assert "neither a .py script nor a command on PATH" in r.stderr


def _hints(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))


@pytest.fixture
def foreign_run(tmp_path, make_ckpt):
    """A run whose checkpoints live outside it (`--ckpt-dir ../out`), with one checkpoint."""
    run_dir = tmp_path / "rtrain-run"
    write_events(run_dir, [("launch", {"attempt": 0, "argv": ["python", "train.py"],
                                       "ckpt_dir": str(tmp_path / "out")})])
    make_ckpt(tmp_path / "out", 7)
    return run_dir


@pytest.mark.parametrize("command", [["status"], ["report"], ["inspect"],
                                     ["prune", "--keep", "1"]])
def test_hints_name_options_the_command_has(rtrain, tmp_path, command):
    """A command that says "pass --run-dir" takes --run-dir, and it works."""
    r = rtrain(*command, "--run-dir", str(tmp_path / "nothing"), cwd=tmp_path)
    assert r.returncode == 2 and "No such option" not in r.stderr
    assert _hints(r.stderr) == {"--run-dir"}
    help_text = rtrain(command[0], "--help").stdout
    assert _hints(r.stderr) <= _hints(help_text)


def test_commands_find_the_run_they_are_run_inside(rtrain, foreign_run):
    r = rtrain("status", "--json", cwd=foreign_run)
    assert r.returncode == 0, r.stderr
    assert '"run_dir": "' + str(foreign_run) in r.stdout
    r = rtrain("inspect", cwd=foreign_run)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{foreign_run.parent / 'out'}: 1 checkpoint")
    r = rtrain("prune", "--keep", "1", "--dry-run", cwd=foreign_run)
    assert r.returncode == 0 and "checkpoint-7" in r.stdout, r.stdout + r.stderr


def test_run_dir_option_reads_the_run(rtrain, foreign_run):
    r = rtrain("inspect", "--run-dir", str(foreign_run), cwd=foreign_run.parent.parent)
    assert r.returncode == 0 and r.stdout.startswith(
        f"{foreign_run.parent / 'out'}: 1 checkpoint"), r.stdout + r.stderr
    r = rtrain("status", "--run-dir", str(foreign_run), cwd=foreign_run.parent.parent)
    assert r.returncode == 0 and r.stdout.startswith(f"run {foreign_run}:"), r.stderr
    r = rtrain("status", str(foreign_run), "--run-dir", "other")
    assert r.returncode == 2 and "pass one" in r.stderr


def test_a_module_keeps_its_first_argument_and_its_typos_are_warned(rtrain, tmp_path,
                                                                     monkeypatch):
    """`-m pkg --lr 1`: click puts `--lr` in the SCRIPT slot; it is the module's, not an
    unknown rtrain option, and it reaches the module (it used to be dropped)."""
    from rtrain.supervisor.launch import spec
    from rtrain.supervisor.proc.torchrun import TorchrunSpec, torchrun_command

    assert spec.child_command("--lr", "pkg", ["1"], "py") == ["py", "-m", "pkg", "--lr", "1"]
    got = torchrun_command(TorchrunSpec(nproc_per_node=2), "--lr", "pkg", ["1"], "py")
    assert got[-4:] == ["-m", "pkg", "--lr", "1"]
    launched = []
    monkeypatch.setattr("rtrain.supervisor.launch.loop.launch",
                        lambda s: launched.append(s.command) or 0)
    r = rtrain("launch", "-m", "pkg", "--resum", "x", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("rtrain: warning: --resum looks like rtrain's --resume")
    assert launched[0][1:] == ["-m", "pkg", "--resum", "x"]
