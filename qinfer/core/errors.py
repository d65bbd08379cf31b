from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """A problem the user can fix: a missing or corrupt file, a model of another shape, settings that cannot work.

    Every layer raises this one class; the CLI prints its message as one line and exits with code 2. Messages quote
    names read from files, which may hold anything, so control characters (a newline in a key's name) are shown
    escaped and can never break the line.
    """

    def __init__(self, message: str):
        super().__init__("".join(c if c.isprintable() else repr(c)[1:-1] for c in message))


@contextmanager
def needs_extra(extra: str, purpose: str) -> Iterator[None]:
    """Imports in this block belong to the optional dependencies `extra` installs (pyproject.toml): one that is
    missing is a user error naming the extra, not a traceback."""
    try:
        yield
    except ModuleNotFoundError as exc:
        package = (exc.name or "").split(".")[0]
        if not package or package == "qinfer":
            raise
        raise UserError(f"{purpose} needs {package}, which is not installed; pip install 'qinfer[{extra}]'") from None
