"""SIGTERM and SIGINT as an exception in the main thread, for a command that has something to clean up on the way
out: by default SIGTERM ends Python at once, and SIGINT's KeyboardInterrupt typer turns into a silent exit."""

from __future__ import annotations

import contextlib
import functools
import signal
from collections.abc import Callable, Iterator
from types import FrameType
from typing import ParamSpec, TypeVar

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
P = ParamSpec("P")
R = TypeVar("R")


class Interrupted(BaseException):
    """Raised wherever the main thread is when a stop signal arrives, so that every `finally` on the way out runs
    (a solver's subprocess is stopped, temporary files go); a BaseException, as KeyboardInterrupt is, so that no
    `except Exception` swallows it. The entry point reports it as one line."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    def stop(signum: int, _frame: FrameType | None) -> None:
        for each in STOP_SIGNALS:
            signal.signal(each, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        raise Interrupted(signum)

    previous = {each: signal.signal(each, stop) for each in STOP_SIGNALS}
    try:
        yield
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)


def stops_cleanly(command: Callable[P, R]) -> Callable[P, R]:
    """A command run under `stop_signals_raise`: SIGTERM, which would end Python at once, leaving a temporary output
    of gigabytes behind, removes it as Ctrl-C does, and both end in the one line the entry point gives. Like Ctrl-C,
    it takes effect once the library call running (a torch op, a tokenizer) returns; SIGKILL stops at once."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with stop_signals_raise():
            return command(*args, **kwargs)

    return run
