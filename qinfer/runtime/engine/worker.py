"""One thread owns the Engine: it takes submitted requests into the admission loop (admission.py), which admits
them into free slots and steps all running ones together, and feeds each request's text to its asyncio queue. HTTP
handlers only submit jobs, read events and cancel."""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

from qinfer.runtime.engine.admission import Admission, Sequence
from qinfer.runtime.engine.engine import Engine, Request
from qinfer.runtime.engine.token_text import TokenText
from qinfer.runtime.kernels.row_kernels import release_threads


@dataclass(frozen=True)
class Event:
    text: str  # new text since the previous event of this job
    finished: bool
    reason: str | None  # "stop", "length" or "error"
    completion_tokens: int
    error: str | None = None
    unavailable: bool = False  # the error is the server's going away, not this request's fault


SHUTTING_DOWN = "the server is shutting down; send the request again once it is back, or to another server"


@dataclass(kw_only=True)
class Job(Sequence):
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    # Whether the reader takes the text piece by piece (a stream, or a whole response cut at stop strings); else only
    # the finished text is sent, and the event loop is not woken for each token.
    every_piece: bool = True
    unsent: list[str] = field(default_factory=list)  # joined once: a string grown a token at a time is quadratic

    def emit(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _put_all(pairs: list[tuple[Job, Event]]) -> None:
    for job, event in pairs:
        job.events.put_nowait(event)


class EngineWorker:
    def __init__(self, engine: Engine, idle_poll_s: float = 0.2):
        """Takes `engine` over from the calling thread, which loaded it: that thread's OpenMP team ends, so that
        the engine thread's alone spins at its barriers (row_kernels.release_threads)."""
        self.engine = engine
        release_threads()
        self._idle_poll_s = idle_poll_s
        self._incoming: queue.Queue[Job] = queue.Queue()
        self._admission: Admission[Job] = Admission(engine)
        self._stop = threading.Event()
        self.closing = threading.Event()  # set once shutdown began: nothing new is taken, every job is ended
        self._thread = threading.Thread(target=self._run, name="qinfer-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """End the engine thread, waiting at most `timeout_s` for the step under way (a daemon thread: a long prefill
        or a graph's capture must not hold the process past a shutdown's deadline)."""
        self.close()
        self._stop.set()
        self._thread.join(timeout_s)

    def close(self) -> None:
        """Begin shutdown: the engine thread ends every queued and running job with a final error event at its next
        step, so that their clients are answered now rather than after everything queued was generated. Safe from a
        signal handler (it sets a flag)."""
        self.closing.set()

    def submit(self, request: Request, every_piece: bool = True) -> Job:
        """Queue `request`; call from the event loop that reads the job's events: one per piece of text, or with
        `every_piece` False the text in one event once it is finished."""
        output = TokenText(self.engine.tokenizer.decode, request.prompt_ids)
        job = Job(request, output, loop=asyncio.get_running_loop(), every_piece=every_piece)
        self._incoming.put(job)
        self.engine.arrival.value = 1
        return job

    def cancel(self, job: Job) -> None:
        """Free the job's slot (or its place in the queue) at the engine's next step; harmless once it finished."""
        job.cancelled = True

    def stats(self) -> dict[str, int]:
        busy = len(self._admission.running)
        waiting = len(self._admission.waiting) + self._incoming.qsize()
        return {
            "slots": self.engine.slots,
            "busy_slots": busy,
            "free_slots": self.engine.slots - busy,
            "waiting": waiting,
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            self._take(block=not self._admission.busy)
            if self.closing.is_set():
                for job in self._admission.drop_all():
                    job.emit(Event("", True, "error", len(job.output.tokens), SHUTTING_DOWN, unavailable=True))
                continue
            try:
                delivered = self._admission.step()
            except Exception as exc:  # noqa: BLE001 - the thread must outlive a failed step and tell its clients
                for job in self._admission.fail_running():
                    job.emit(Event("", True, "error", len(job.output.tokens), f"the engine failed: {exc}"))
                continue
            events: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = {}
            for done in delivered:
                job, out = done.sequence, done.out
                if out is None:
                    event = Event("", True, "error", 0, str(done.refused))
                elif out.finished or (done.piece and job.every_piece):
                    text = "".join([*job.unsent, done.piece])
                    job.unsent.clear()
                    event = Event(text, out.finished, out.reason, done.generated, out.error)
                else:
                    if done.piece:
                        job.unsent.append(done.piece)
                    continue
                events.setdefault(job.loop, []).append((job, event))
            # A step's events go to each event loop in one call: a wake of the loop per job took a tenth of the
            # engine thread's time (the tiny model, 32 clients).
            for loop, pairs in events.items():
                loop.call_soon_threadsafe(_put_all, pairs)

    def _take(self, block: bool) -> None:
        # Cleared before the queue is read: a job queued after the read sets it again, for the next group to see.
        self.engine.arrival.value = 0
        try:
            if block:
                self._admission.add(self._incoming.get(timeout=self._idle_poll_s))
            while True:
                self._admission.add(self._incoming.get_nowait())
        except queue.Empty:
            pass
