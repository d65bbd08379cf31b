"""`qinfer ARGS` through its entry point in the test's own process, for cases where a separate process would only
add seconds of library loading (each module keeps at least one real `python -m qinfer` run)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

from qinfer.cli.main import main


def run_in_process(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Exit code, stdout and stderr of `qinfer ARGS`, as a finished process would report them."""
    out, err, here, argv = io.StringIO(), io.StringIO(), Path.cwd(), sys.argv
    try:
        os.chdir(cwd or here)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            sys.argv = ["qinfer", *args]
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(here)
        sys.argv = argv
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
