"""Every command explains itself, and the command groups exist."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from qinfer.cli.main import app

COMMANDS = [[], ["prep"], ["prep", "synth"], ["prep", "convert"], ["prep", "convert-dense"], ["plan"], ["run"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "qinfer")
def test_help_describes_every_option(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    options = [line for line in result.output.splitlines() if line.lstrip("│ ").startswith("--")]
    for line in options:
        if "--help" not in line:
            # An option line carries words after its name and type, not just the flag.
            assert len(line.split()) > 4, line


def test_groups_list_their_commands() -> None:
    top = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    assert all(word in top for word in ("prep", "plan", "run"))
    prep = CliRunner().invoke(app, ["prep", "--help"], env={"COLUMNS": "200"}).output
    assert all(word in prep for word in ("synth", "convert", "convert-dense"))


def _every_command(group: object, path: list[str]) -> list[list[str]]:
    found = [path]
    for name, command in getattr(group, "commands", {}).items():
        found += _every_command(command, [*path, name])
    return found


@pytest.mark.parametrize("command", _every_command(typer.main.get_command(app), []), ids=" ".join)
def test_help_fits_a_standard_terminal(command: list[str]) -> None:
    """At 80 columns no option name or word is cut short ("--reset-gpu-in…"): a flag that is off unless given shows
    alone, without a --no- twin taking a column of its own."""
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0 and "…" not in result.output, result.output
