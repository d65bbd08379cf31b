"""Generate text for one prompt or several at once through the engine, with timing for the run summary."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from qinfer_core.errors import UserError
from qinfer_runtime.engine import Engine, Request
from qinfer_runtime.sampling import SamplingParams
from qinfer_runtime.token_text import TokenText


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: int
    prompt_seconds: float
    decode_seconds: float
    stopped_at_eos: bool

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # The first new token comes from the prompt pass; each later one, and an EOS, costs one decode step.
        steps = len(self.tokens) if self.stopped_at_eos else max(len(self.tokens) - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class _Progress:
    output: TokenText
    prompt_seconds: float
    stopped: bool = False


def generate_many(
    engine: Engine,
    prompts: list[str],
    n_predict: int,
    sampling: SamplingParams,
    seed: int = 0,
    ignore_eos: bool = False,
    on_text: Callable[[int, str], None] | None = None,
) -> list[GenerationResult]:
    """Decode all prompts together (prompt i with seed + i); `on_text(i, piece)` streams new text of prompt i.

    Prompts wait for a free slot when there are more of them than the engine has slots.
    """
    tokenizer = engine.tokenizer
    waiting = list(enumerate(prompts))
    running: dict[int, int] = {}  # slot -> prompt index
    progress: dict[int, _Progress] = {}
    decode_seconds = 0.0
    while waiting or running:
        while waiting and engine.free_slots():
            i, prompt = waiting.pop(0)
            ids = tokenizer.encode(prompt)
            t0 = time.perf_counter()
            slot = engine.submit(Request(ids, n_predict, sampling, seed + i, ignore_eos))
            progress[i] = _Progress(TokenText(tokenizer.decode, ids), time.perf_counter() - t0)
            running[slot] = i
        t0 = time.perf_counter()
        outputs = engine.step()
        decode_seconds += time.perf_counter() - t0
        for out in outputs:
            if out.error is not None:
                raise UserError(f"generation failed: {out.error}")
            index = running[out.slot]
            p = progress[index]
            piece = p.output.add(out.token, out.finished)
            if on_text is not None and piece:
                on_text(index, piece)
            if out.finished:
                p.stopped = out.reason == "stop"
                del running[out.slot]
    # Sequences decode together, so each one's decode time is the run's.
    return [_result(p, decode_seconds) for _, p in sorted(progress.items())]


def _result(p: _Progress, decode_seconds: float) -> GenerationResult:
    out = p.output
    return GenerationResult(out.tokens, out.text(), len(out.prompt_ids), p.prompt_seconds, decode_seconds, p.stopped)


def generate(
    engine: Engine,
    prompt: str,
    n_predict: int,
    sampling: SamplingParams,
    seed: int = 0,
    ignore_eos: bool = False,
    on_text: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate up to `n_predict` tokens; `on_text` receives each newly decoded piece of text as it appears."""
    show = None if on_text is None else (lambda _i, piece: on_text(piece))
    return generate_many(engine, [prompt], n_predict, sampling, seed, ignore_eos, show)[0]
