"""The loop that keeps the engine's slots busy, shared by `qinfer run` (generate.py) and the server (worker.py):
waiting sequences join free slots between steps, each step advances every running sequence by one token (or a
group of greedy steps by several) and the prompts in the slots by a chunk (engine.py), and each token is turned into
the text it adds."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from qinfer.runtime.engine.engine import Engine, Request, StepOutput
from qinfer.runtime.engine.token_text import TokenText


@dataclass
class Sequence:
    """One request on its way through the engine, and the text it has produced."""

    request: Request
    output: TokenText
    cancelled: bool = False
    admitted: float = 0.0  # time.perf_counter() when it took a slot
    prompt_seconds: float = 0.0  # from then until its prompt was in the cache (beside other sequences' tokens)
    decode_started: float = 0.0  # time.perf_counter() once it was, and its first token sampled
    decode_seconds: float = 0.0  # from then until it finished
    cached_tokens: int = 0  # of its prompt, the tokens whose rows a slot held already (not computed again)


S = TypeVar("S", bound=Sequence)


@dataclass(frozen=True)
class Delivery(Generic[S]):
    """What a step gave one sequence: its new text and the engine's output, or the error that refused it a slot."""

    sequence: S
    piece: str
    out: StepOutput | None
    refused: Exception | None = None
    generated: int = 0  # the sequence's tokens so far, this one's included (a step can bring it several)

    @property
    def finished(self) -> bool:
        return self.refused is not None or (self.out is not None and self.out.finished)


class Admission(Generic[S]):
    def __init__(self, engine: Engine):
        self.engine = engine
        self.waiting: deque[S] = deque()
        self.running: dict[int, S] = {}  # slot -> sequence

    def add(self, sequence: S) -> None:
        self.waiting.append(sequence)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Delivery[S]]:
        """Free the slots of cancelled sequences, admit waiting ones into free slots, then one engine step for all
        running ones (or a group of steps, where the engine groups greedy ones: Engine.step). A request the engine
        refuses fails alone, and is returned at once, before any step that could fail and lose it; the next call
        steps. A prompt whose chunk fails a step fails alone too (Engine.step); any other exception from the step
        propagates, the sequences still running (see `fail_running`)."""
        for slot, sequence in list(self.running.items()):
            if sequence.cancelled:
                self.engine.cancel(slot)
                del self.running[slot]
        done: list[Delivery[S]] = []
        while self.waiting and self.engine.free_slots() > 0:
            sequence = self.waiting.popleft()
            if sequence.cancelled:
                continue
            try:
                slot = self.engine.submit(sequence.request)
            except Exception as exc:  # noqa: BLE001 - a request the engine refuses must fail only itself
                done.append(Delivery(sequence, "", None, exc))
                continue
            sequence.admitted = time.perf_counter()
            sequence.cached_tokens = self.engine.reused_tokens(slot)
            self.running[slot] = sequence
        if done or not self.running:
            return done
        outputs = self.engine.step(group=True)
        now = time.perf_counter()
        for out in outputs:
            sequence = self.running[out.slot]
            if not sequence.decode_started:  # its first output: this step completed its prompt
                sequence.decode_started = now
                sequence.prompt_seconds = now - sequence.admitted
            piece = sequence.output.add(out.token, out.finished)
            if out.finished:
                sequence.decode_seconds = now - sequence.decode_started
                del self.running[out.slot]
            done.append(Delivery(sequence, piece, out, generated=len(sequence.output.tokens)))
        return done

    def drop_all(self) -> list[S]:
        """Every sequence, running or waiting, out of the engine (a server shutting down); the sequences, to be told."""
        dropped = [*self.fail_running(), *self.waiting]
        self.waiting.clear()
        return dropped

    def fail_running(self) -> list[S]:
        """Free every running sequence's slot (after a failed step); the sequences, to be told."""
        failed = list(self.running.values())
        for slot in self.running:
            self.engine.cancel(slot)
        self.running.clear()
        return failed
