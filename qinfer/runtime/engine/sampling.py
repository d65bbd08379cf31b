"""Choose the next token from logits: greedy, or temperature with top-k and top-p (nucleus) filtering."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Temperatures below this decode greedily: sampling at them is greedy in all but name, and float32 logits divided
# by a far smaller one (1e-300 is 0 in float32) overflow to inf and make the probabilities NaN.
MIN_TEMPERATURE = 1e-6


class NonFiniteLogits(ValueError):
    """No token can be chosen from the logits; the caller, who holds the KV cache, says why (non_finite_cause)."""


def unusable_rows(logits: torch.Tensor) -> torch.Tensor:
    """Per row of logits (the last dimension): whether it holds NaN or +inf, or nothing finite, what no token and no
    perplexity may be made of. One reduction tells all three: a row's max is NaN where the row holds a NaN, +inf
    where it holds +inf, and -inf where nothing in it is finite (an empty row has no max, and nothing finite)."""
    if logits.shape[-1] == 0:
        return torch.ones(logits.shape[:-1], dtype=torch.bool)
    return ~torch.isfinite(logits.amax(-1))


def greedy_rows(logits: torch.Tensor) -> list[int]:
    """Per row of logits [N, V]: its argmax (the first, on ties), or -1 where the row is unusable (unusable_rows). One
    max gives both, the row's largest value and where it lies: half the dispatch of a check and an argmax."""
    if logits.shape[-1] == 0:
        return [-1] * logits.shape[0]
    top, where = logits.max(-1)
    return torch.where(torch.isfinite(top), where, -1).tolist()


def unusable(logits: torch.Tensor) -> bool:
    """Whether logits (1-D, or a row per token) hold an unusable row (unusable_rows)."""
    return bool(unusable_rows(logits).any())


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from 1-D `logits`; `generator` makes the choice reproducible from a seed. Unusable logits are
    refused in every mode: greedy decoding would otherwise turn them into a token."""
    if unusable(logits):
        raise NonFiniteLogits("the model's logits are not finite (NaN or inf)")
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays in), and always the
        # most likely token: a top_p that is 0 in float32 (1e-300) would otherwise drop every one.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[0] = False
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
