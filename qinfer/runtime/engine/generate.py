"""Generate text for one prompt or several at once through the engine, with timing for the run summary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qinfer.core.errors import UserError
from qinfer.runtime.engine.admission import Admission, Sequence
from qinfer.runtime.engine.engine import Engine, Request
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.engine.token_text import TokenText


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: int
    prompt_seconds: float
    decode_seconds: float
    stopped_at_eos: bool
    decode_started: float = 0.0  # time.perf_counter() at its first token

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # The first new token comes from the prompt pass; each later one, and an EOS, costs one decode step.
        steps = len(self.tokens) if self.stopped_at_eos else max(len(self.tokens) - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass(kw_only=True)
class _Prompt(Sequence):
    index: int
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
    admission: Admission[_Prompt] = Admission(engine)
    prompted = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        request = Request(ids, n_predict, sampling, seed + i, ignore_eos)
        prompted.append(_Prompt(request, TokenText(tokenizer.decode, ids), index=i))
        admission.add(prompted[-1])
    while admission.busy:
        for done in admission.step():
            if done.refused is not None:
                raise done.refused
            assert done.out is not None
            if done.out.error is not None:
                raise UserError(f"generation failed: {done.out.error}")
            if on_text is not None and done.piece:
                on_text(done.sequence.index, done.piece)
            if done.out.finished:
                done.sequence.stopped = done.out.reason == "stop"
    return [_result(p) for p in prompted]


def _result(p: _Prompt) -> GenerationResult:
    out = p.output
    return GenerationResult(
        out.tokens, out.text(), len(out.prompt_ids), p.prompt_seconds, p.decode_seconds, p.stopped, p.decode_started
    )


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
