"""Prompt processing and token-by-token decoding, with timing for the run summary."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qinfer_runtime.errors import RunError
from qinfer_runtime.llama_forward import KVCache, LlamaForward
from qinfer_runtime.sampling import SamplingParams, sample_next
from qinfer_runtime.tokenizer import GGUFTokenizer


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


def generate(
    forward: LlamaForward,
    tokenizer: GGUFTokenizer,
    prompt: str,
    n_predict: int,
    sampling: SamplingParams,
    ctx_size: int,
    seed: int = 0,
    ignore_eos: bool = False,
    on_text: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate up to `n_predict` tokens; `on_text` receives each newly decoded piece of text as it appears."""
    prompt_ids = tokenizer.encode(prompt)
    if len(prompt_ids) >= ctx_size:
        raise RunError(f"the prompt is {len(prompt_ids)} tokens but the context holds {ctx_size}; raise --ctx-size")
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache(forward.cfg, ctx_size)
    n_predict = min(n_predict, ctx_size - len(prompt_ids))
    new: list[int] = []
    shown = ""
    stopped = False
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = forward(torch.tensor(prompt_ids), 0, cache)[-1]
        prompt_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        while len(new) < n_predict:
            token = sample_next(logits, sampling, generator)
            if token == tokenizer.eos_id and not ignore_eos:
                stopped = True
                break
            new.append(token)
            text = tokenizer.decode(new)
            # A multi-byte character can span tokens; hold it back until it decodes completely.
            if on_text is not None and not text.endswith("\ufffd"):
                on_text(text[len(shown) :])
                shown = text
            if len(new) == n_predict:
                break
            logits = forward(torch.tensor([token]), len(prompt_ids) + len(new) - 1, cache)[-1]
        decode_seconds = time.perf_counter() - t1
    text = tokenizer.decode(new)
    if on_text is not None and len(text) > len(shown):
        on_text(text[len(shown) :])
    return GenerationResult(new, text, len(prompt_ids), prompt_seconds, decode_seconds, stopped)
