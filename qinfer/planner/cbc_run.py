"""Run pulp's CBC so that it never outlives the solve: pulp writes the program to files, starts CBC with
subprocess.Popen and waits for it, with no `finally`; an exception in the wait (Ctrl-C, or SIGTERM that the CLI
raises as one) would leave CBC running and its files behind, as CBC's own errors leave the files."""

from __future__ import annotations

import subprocess
import tempfile
import threading
from typing import Any

import pulp
from pulp.apis import coin_api

# Seconds CBC is given to end on SIGTERM before it is killed.
STOP_GRACE = 5.0
# pulp starts CBC through coin_api's `subprocess`, which a solve replaces for its duration: one solve at a time.
_ONE_SOLVE = threading.Lock()


class _RecordingSubprocess:
    """The subprocess module as coin_api sees it during a solve: the real one, except that it keeps the processes
    it starts."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    def Popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen[Any]:  # subprocess's name, which pulp calls
        process = subprocess.Popen(*args, **kwargs)
        self.started.append(process)
        return process


def solve_with_cbc(prob: pulp.LpProblem, solver: pulp.LpSolver_CMD) -> None:
    """`prob.solve(solver)`, with CBC's files in a private temporary directory that goes whatever happens, and the
    CBC process stopped if the solve ends before it does."""
    recording = _RecordingSubprocess()
    with _ONE_SOLVE, tempfile.TemporaryDirectory(prefix="qinfer-cbc-") as files:
        solver.tmpDir = files
        coin_api.subprocess = recording  # type: ignore[assignment]
        try:
            prob.solve(solver)
        finally:
            coin_api.subprocess = subprocess  # type: ignore[assignment]
            for process in recording.started:
                _stop(process)


def _stop(process: subprocess.Popen[Any]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
