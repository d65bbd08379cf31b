"""The `qinfer` command line: wires qinfer_prep, planner and qinfer_runtime into commands.

Each command group lives in its own module; importing them registers their commands on the app.
"""

from __future__ import annotations

import sys

from qinfer import (  # noqa: F401 - they register commands
    download_command,
    perplexity_command,
    plan_command,
    prep_commands,
    profile_commands,
    profiles_command,
    run_command,
    serve_command,
)
from qinfer.app import app
from qinfer_core.errors import UserError


def main() -> None:
    """Entry point: user-caused errors end as one line on stderr and exit code 2, never a traceback."""
    try:
        app()
    except UserError as exc:
        # Plain write: rich would wrap a long path onto a second line.
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
