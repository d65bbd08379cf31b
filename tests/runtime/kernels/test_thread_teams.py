"""A thread that hands the kernels to another ends its own OpenMP team (row_kernels.release_threads), as the
thread that loads a model for the server's engine thread does (EngineWorker): libgomp counts every thread's team,
and where the teams together outnumber the cores its barriers sleep instead of spinning."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from qinfer.runtime.engine.engine import Engine, Request
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.kernels import row_kernels

TASKS = Path("/proc/self/task")
TEAM = 3  # threads a parallel region takes here: two of them are the team's own, started for it
pytestmark = [
    pytest.mark.skipif(not TASKS.is_dir(), reason="reads the process's threads from /proc"),
    pytest.mark.skipif(not row_kernels.enabled(), reason="no C compiler builds the kernels"),
]
T = TypeVar("T")


def _threads() -> set[int]:
    return {int(task.name) for task in TASKS.iterdir()}


def _in_a_new_thread(body: Callable[[], T]) -> T:
    """body's result, run in a thread of its own with TEAM threads for parallel work: the thread has no team yet."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(body())
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    threads = torch.get_num_threads()
    torch.set_num_threads(TEAM)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(threads)
    if errors:
        raise errors[0]
    return results[0]


def _gone(team: set[int], timeout_s: float = 5.0) -> set[int]:
    """Which of `team` still run once they had timeout_s to end."""
    deadline = time.monotonic() + timeout_s
    while team & _threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return team & _threads()


def test_release_ends_the_calling_threads_team() -> None:
    w, x = torch.randn(64, 256).half(), torch.randn(2, 256)

    def body() -> tuple[set[int], set[int]]:
        before = _threads()
        assert row_kernels.matvec(x, w) is not None
        team = _threads() - before
        row_kernels.release_threads()
        return team, _gone(team)

    team, left = _in_a_new_thread(body)
    assert len(team) == TEAM - 1
    assert left == set()


def test_the_engine_worker_ends_the_team_of_the_thread_that_loaded_the_engine(gguf_files: dict[str, Path]) -> None:
    def body() -> tuple[set[int], set[int]]:
        before = _threads()
        engine = Engine.open(gguf_files["pi-f16"], ctx_size=64)
        engine.submit(Request([1, 2, 3], 2, SamplingParams(temperature=0.0), ignore_eos=True))
        while engine.active_slots():
            engine.step()
        team = _threads() - before
        EngineWorker(engine)
        return team, _gone(team)

    team, left = _in_a_new_thread(body)
    assert len(team) == TEAM - 1
    assert left == set()
