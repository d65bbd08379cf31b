"""A thread that hands the kernels to another ends its own OpenMP team (row_kernels.release_threads), as the
thread that loads a model for the server's engine thread does (EngineWorker): libgomp counts every thread's team,
and where the teams together outnumber the cores its barriers sleep instead of spinning. The threads are read from
/proc; where the kernels' OpenMP is not libgomp, or the engine's torch runs another, a team's threads are not the
kernels' to end, and the tests say so."""

from __future__ import annotations

import ctypes
import os
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
    pytest.mark.skipif(
        any(name in os.environ for name in ("OMP_THREAD_LIMIT", "OMP_DYNAMIC")), reason="OpenMP told to size teams"
    ),
]
T = TypeVar("T")


def _runtime_of(library: ctypes.CDLL) -> str:
    """The file of the OpenMP runtime `library` calls: the mapping its omp_get_max_threads lies in ("" for none)."""
    entry = getattr(library, "omp_get_max_threads", None)
    address = ctypes.cast(entry, ctypes.c_void_p).value if entry is not None else None
    if address is None:
        return ""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(end, 16) for end in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) > 5 else ""
    return ""


def _needs_libgomp(torch_too: bool) -> None:
    kernels = _runtime_of(row_kernels.kernel())  # type: ignore[arg-type]
    if "libgomp" not in Path(kernels).name:
        pytest.skip(f"the kernels' OpenMP is {kernels or 'unknown'}, not libgomp")
    if torch_too:
        libtorch = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        if _runtime_of(libtorch) != kernels:
            pytest.skip("torch runs an OpenMP of its own beside the kernels'")


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
    _needs_libgomp(torch_too=False)
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
    _needs_libgomp(torch_too=True)

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
