"""One thread owns the Engine: it admits waiting requests into free slots, steps all running ones together and feeds
each request's text to its asyncio queue. HTTP handlers only submit jobs, read events and cancel."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from dataclasses import dataclass, field

from qinfer_runtime.engine import Engine, Request, StepOutput
from qinfer_runtime.token_text import TokenText


@dataclass(frozen=True)
class Event:
    text: str  # new text since the previous event of this job
    finished: bool
    reason: str | None  # "stop", "length" or "error"
    completion_tokens: int
    error: str | None = None


@dataclass
class Job:
    request: Request
    loop: asyncio.AbstractEventLoop
    output: TokenText
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: bool = False

    def emit(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineWorker:
    def __init__(self, engine: Engine, idle_poll_s: float = 0.2):
        self.engine = engine
        self._idle_poll_s = idle_poll_s
        self._incoming: queue.Queue[Job] = queue.Queue()
        self._waiting: deque[Job] = deque()
        self._running: dict[int, Job] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qinfer-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def submit(self, request: Request) -> Job:
        """Queue `request`; call from the event loop that reads the job's events."""
        output = TokenText(self.engine.tokenizer.decode, request.prompt_ids)
        job = Job(request, asyncio.get_running_loop(), output)
        self._incoming.put(job)
        return job

    def cancel(self, job: Job) -> None:
        """Free the job's slot (or its place in the queue) at the engine's next step; harmless once it finished."""
        job.cancelled = True

    def stats(self) -> dict[str, int]:
        busy = len(self._running)
        waiting = len(self._waiting) + self._incoming.qsize()
        return {
            "slots": self.engine.slots,
            "busy_slots": busy,
            "free_slots": self.engine.slots - busy,
            "waiting": waiting,
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            self._take(block=not self._running and not self._waiting)
            self._drop_cancelled()
            self._admit()
            if not self._running:
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - the thread must outlive a failed step and tell its clients
                self._fail_running(f"the engine failed: {exc}")
                continue
            for out in outputs:
                self._deliver(out)

    def _take(self, block: bool) -> None:
        try:
            if block:
                self._waiting.append(self._incoming.get(timeout=self._idle_poll_s))
            while True:
                self._waiting.append(self._incoming.get_nowait())
        except queue.Empty:
            pass

    def _drop_cancelled(self) -> None:
        for slot, job in list(self._running.items()):
            if job.cancelled:
                self.engine.cancel(slot)
                del self._running[slot]

    def _admit(self) -> None:
        while self._waiting and self.engine.free_slots() > 0:
            job = self._waiting.popleft()
            if job.cancelled:
                continue
            try:
                slot = self.engine.submit(job.request)
            except Exception as exc:  # noqa: BLE001 - a bad prompt must fail only its own request
                job.emit(Event("", True, "error", 0, str(exc)))
                continue
            self._running[slot] = job

    def _deliver(self, out: StepOutput) -> None:
        job = self._running[out.slot]
        piece = job.output.add(out.token, out.finished)
        if out.finished:
            del self._running[out.slot]
        if piece or out.finished:
            job.emit(Event(piece, out.finished, out.reason, len(job.output.tokens), out.error))

    def _fail_running(self, message: str) -> None:
        for slot, job in list(self._running.items()):
            self.engine.cancel(slot)
            job.emit(Event("", True, "error", len(job.output.tokens), message))
        self._running.clear()
