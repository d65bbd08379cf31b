"""stdout as the commands write to it: characters its encoding lacks are replaced rather than fatal, and a write
that fails (a full disk, a closed descriptor, a reader that went away) raises `StdoutError`, so that the entry point
can end it in one line, or quietly for a broken pipe, never a traceback."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
from collections.abc import Iterator


class StdoutError(Exception):
    """A write to stdout failed; errno and strerror say why. Not an OSError: click ends a command whose write
    fails with EPIPE in its own way (exit 1), where the entry point ends it as a shell expects of a broken pipe."""

    def __init__(self, errno: int | None, strerror: str | None):
        super().__init__(errno, strerror)
        self.errno = errno
        self.strerror = strerror


class _StdoutBytes(io.RawIOBase):
    """fd 1's bytes, its failures raised as StdoutError; `fd` None: the process started with stdout closed."""

    def __init__(self, fd: int | None):
        super().__init__()
        self._fd = fd
        self.discarding = False

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:
        size = memoryview(data).nbytes
        if self.discarding:
            return size
        if self._fd is None:
            raise StdoutError(errno.EBADF, "it is closed")
        try:
            return os.write(self._fd, data)
        except OSError as exc:
            raise StdoutError(exc.errno, exc.strerror) from None

    def fileno(self) -> int:
        if self._fd is None:
            raise io.UnsupportedOperation("stdout is closed")
        return self._fd

    def isatty(self) -> bool:
        return self._fd is not None and os.isatty(self._fd)


@contextlib.contextmanager
def guarded_stdout() -> Iterator[None]:
    """Within the block, sys.stdout replaces what its encoding lacks with "?" and raises StdoutError where a write
    fails, the last flush included. A stdout already redirected (a test's capture) is left as it is."""
    original = sys.stdout
    if original is not sys.__stdout__:
        yield
        return
    raw = _StdoutBytes(None if original is None else original.fileno())
    # A user's own error handler (PYTHONIOENCODING=ascii:backslashreplace) is kept; only the fatal one is replaced.
    errors = "replace" if original is None or original.errors == "strict" else original.errors
    stream = io.TextIOWrapper(
        io.BufferedWriter(raw),
        encoding="utf-8" if original is None else original.encoding,
        errors=errors,
        line_buffering=original is not None and original.line_buffering,
        write_through=original is not None and original.write_through,  # python -u
    )
    sys.stdout = stream
    try:
        yield
        stream.flush()
    finally:
        with contextlib.suppress(OSError, StdoutError):
            stream.flush()
        # What could not be written is lost either way; discarding it keeps the stream's close, when it is
        # collected, from reporting the failure a second time.
        raw.discarding = True
        sys.stdout = original
