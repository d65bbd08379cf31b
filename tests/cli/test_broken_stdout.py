"""A stdout the output cannot reach ends a command in one line on stderr, or quietly for a reader that went away,
never in a traceback; one whose encoding lacks a character of the output gets "?" in its place."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

QINFER = [sys.executable, "-m", "qinfer"]


def _stderr_line(result: subprocess.CompletedProcess[str], line: str) -> None:
    assert result.returncode == 2 and result.stderr == f"error: {line}\n", result.stderr


@pytest.mark.parametrize("args", [["profiles"], ["--help"]], ids=" ".join)
def test_a_full_stdout(args: list[str]) -> None:
    with open("/dev/full", "w") as full:
        result = subprocess.run([*QINFER, *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    _stderr_line(result, "cannot write to stdout: No space left on device")


def test_a_closed_stdout() -> None:
    command = f"{shlex.join([*QINFER, 'profiles'])} >&-"
    result = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
    _stderr_line(result, "cannot write to stdout: it is closed")


@pytest.mark.parametrize("command", ["profiles", "run"])
def test_a_reader_that_went_away(gguf_files: dict[str, Path], command: str) -> None:
    """A reader that closed (`| head`) ends the command quietly with a broken pipe's status, whether its write failed
    at the end (profiles' table, flushed on exit) or inside the command (run's text, flushed piece by piece)."""
    args = ["profiles"] if command == "profiles" else ["run", "-m", str(gguf_files["pi-f16"]), "-n", "4"]
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run([*QINFER, *args], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert result.returncode == 128 + signal.SIGPIPE and result.stderr == ""


def test_an_ascii_stdout_gets_question_marks(gguf_files: dict[str, Path]) -> None:
    model = str(gguf_files["pi-f16"])
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    result = subprocess.run(
        [*QINFER, "run", "-m", model, "-p", "Un caf\u00e9 \u2603", "-n", "2", "--temp", "0"],
        capture_output=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.startswith(b"Un caf? ?") and b"Traceback" not in result.stderr
