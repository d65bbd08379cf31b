"""A minimal install (no `serve` extra) runs a model, and `qinfer serve` says in one line which extra to install
(tests/planner checks the same for the plan's plot and the `plot` extra)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# What the `serve` and `plot` extras bring; None in sys.modules makes each import of them fail, as if uninstalled.
EXTRAS = ("fastapi", "starlette", "uvicorn", "prometheus_client", "jinja2", "llguidance", "matplotlib")
WITHOUT_EXTRAS = (
    "import sys\n"
    f"sys.modules.update(dict.fromkeys({EXTRAS!r}))\n"
    "from qinfer.cli.main import main\n"
    "sys.argv = ['qinfer', *sys.argv[1:]]\n"
    "main()\n"
)


def qinfer_without_extras(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, *args], capture_output=True, text=True, timeout=300)


def test_run_needs_no_extra(gguf_files: dict[str, Path]) -> None:
    result = qinfer_without_extras("run", "-m", str(gguf_files["pi-f16"]), "-p", "Once upon a time", "-n", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Once upon a time") and len(result.stdout) > len("Once upon a time")


def test_serve_without_its_extra_is_one_line(gguf_files: dict[str, Path]) -> None:
    result = qinfer_without_extras("serve", "-m", str(gguf_files["pi-f16"]))
    assert result.returncode == 2
    one_line = r"error: qinfer serve needs \w+, which is not installed; pip install 'qinfer\[serve\]'\n"
    assert re.fullmatch(one_line, result.stderr)
