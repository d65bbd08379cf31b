"""The `qinfer` command line: wires prep, planner and runtime into commands.

Each command group lives in its own module; importing them registers their commands on the app.
"""

from __future__ import annotations

import errno
import signal
import sys
from typing import NoReturn

import typer

from qinfer.cli import (  # noqa: F401 - they register commands
    download_command,
    perplexity_command,
    plan_command,
    prep_commands,
    profile_commands,
    profiles_command,
    run_command,
    serve_command,
)
from qinfer.cli.app import app
from qinfer.cli.stdout import StdoutError, guarded_stdout
from qinfer.cli.stop_signals import Interrupted
from qinfer.core.errors import UserError


def main() -> None:
    """Entry point: user-caused errors, a bad option value among them, end as one line on stderr and exit code 2,
    never a traceback or typer's boxed usage message; so does a stdout that cannot be written, but for a reader
    that went away (`| head`), which ends quietly as a shell expects of a broken pipe."""
    try:
        with guarded_stdout():
            code = app(standalone_mode=False)
    except StdoutError as exc:
        if exc.errno == errno.EPIPE:
            sys.exit(128 + signal.SIGPIPE)
        _fail(f"cannot write to stdout: {exc.strerror}", 2)
    except UserError as exc:
        _fail(str(exc), 2)
    except typer.TyperException as exc:  # click's usage errors: a bad value, a missing option, an unknown command
        # A missing subcommand has already printed the help, and its message is empty.
        message = exc.format_message()
        if not message:
            sys.exit(exc.exit_code)
        ctx = getattr(exc, "ctx", None)
        _fail(message if ctx is None else f"{message} (see {ctx.command_path} --help)", exc.exit_code)
    except typer.Abort:
        _fail("aborted", 1)
    except Interrupted as exc:
        # 128 + the signal's number: what a shell reports for a process the signal ended.
        _fail(f"stopped by {exc} before it finished; run the command again to finish", 128 + exc.signum)
    # Without standalone mode, --help and typer.Exit come back as their exit code; a finished command as None.
    if isinstance(code, int):
        sys.exit(code)


def _fail(message: str, code: int) -> NoReturn:
    # Plain write, on one line: rich would wrap a long path onto a second one.
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(code)
