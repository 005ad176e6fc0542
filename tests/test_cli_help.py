"""What `rtrain --help` and `rtrain launch --help` show first: launch, and its options in four
panels a user scans by topic."""

from __future__ import annotations

import re

import typer.main
from typer.testing import CliRunner

from rtrain.supervisor.cli import LaunchCommand, app

PANELS = ["Options", "Common", "Restarts", "Distributed", "Storage"]


def test_launch_is_listed_first():
    out = CliRunner().invoke(app, ["--help"]).output
    listed = re.findall(r"^  ([a-z-]+)\s", out.split("Commands:")[1], flags=re.M)
    assert listed[0] == "launch" and len(listed) == 7


def test_launch_options_come_in_panels_and_each_option_has_one():
    out = CliRunner().invoke(app, ["launch", "--help"]).output
    headings = re.findall(r"^([A-Z][a-z]+):$", out, flags=re.M)
    assert headings == PANELS
    options = out.split("\nCommon:")[0].split("\nOptions:")[1]
    assert re.findall(r"^  (-.+?)  ", options, flags=re.M) == ["-h, --help"]
    command = typer.main.get_command(app).commands["launch"]
    assert isinstance(command, LaunchCommand)
    params = command.get_params(command.make_context("launch", ["--help"], resilient_parsing=True))
    names = {p.name for p in params if p.param_type_name == "option"} - {"help"}
    assert names == set(LaunchCommand.panels)  # no option forgotten, no stale name
