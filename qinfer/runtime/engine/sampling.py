"""Choose the next token from logits: greedy, or temperature with top-k and top-p (nucleus) filtering."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    """Per row of CPU logits [N, V]: its argmax (the first, on ties), or -1 where the row is unusable (unusable_rows):
    the largest value is NaN, +inf or -inf exactly there. numpy's argmax: torch's max over a row of 128,256 logits
    took 70 us, numpy's 5 (AMD EPYC Zen 5)."""
    if logits.shape[-1] == 0:
        return [-1] * logits.shape[0]
    rows = logits.float().numpy()
    where = rows.argmax(-1)
    # Indexing, not take_along_axis: 2.7 against 4.8 us a step over 1,024 logits.
    top = rows[np.arange(rows.shape[0]), where]
    return np.where(np.isfinite(top), where, -1).tolist()


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
        return greedy_rows(logits[None])[0]
    scores, ids = candidates(logits.float() / params.temperature, params.top_k, params.top_p)
    uniform = float(torch.rand((), generator=generator, dtype=torch.float64))
    choice = draw(torch.softmax(scores, dim=-1), uniform)
    return choice if ids is None else int(ids[choice])


def draw(probs: torch.Tensor, uniform: float) -> int:
    """The index of 1-D CPU `probs` (summing to 1, or nearly) where `uniform` (in [0, 1)) falls in their running sum: an
    index drawn with its probability, for a uniform number drawn. torch.multinomial took 2 ms over 128,256 tokens,
    this 0.15."""
    cdf = probs.cumsum(0, dtype=torch.float64).numpy()
    # The first running sum above the point (which lies below the last, uniform being below 1) ends at an index of
    # nonzero probability.
    return int(np.searchsorted(cdf, uniform * cdf[-1], "right"))


# Top-p over a whole vocabulary first looks for its tokens among this many of the most likely.
NUCLEUS_FEW = 256


def candidates(scores: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scores that top-k and then top-p (nucleus) filtering keep of 1-D CPU `scores`, most likely first, with
    their token ids (None: every token, in order). Top-k keeps exactly k, scores tied with the k-th included or not
    as the top-k finds them (as llama.cpp's does). Top-p keeps the smallest run of the most likely tokens whose
    probability reaches top_p, the token that crosses it included, the probabilities being a softmax over the top k.
    Without a top k the run is sought among the NUCLEUS_FEW most likely first, and among all where it goes past them:
    torch's sort of 128,256 scores took 8.8 ms, its top 256 0.2 and numpy's sort 1.2."""
    n = scores.numel()
    k = top_k if 0 < top_k < n else n
    if top_p >= 1.0:
        return (scores, None) if k == n else torch.topk(scores, k)
    if k < n or k <= NUCLEUS_FEW:
        values, ids = torch.topk(scores, k)
        return _nucleus(values, ids, torch.logsumexp(values, 0), top_p)
    total = torch.logsumexp(scores, 0)
    values, ids = _nucleus(*torch.topk(scores, NUCLEUS_FEW), total, top_p)
    if len(values) < NUCLEUS_FEW:
        return values, ids
    ids = torch.from_numpy(np.argsort(-scores.numpy()))
    return _nucleus(scores[ids], ids, total, top_p)


def _nucleus(
    values: torch.Tensor, ids: torch.Tensor, total: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The run of `values` (falling, with their `ids`) that top-p keeps, their probabilities exp(value - total)."""
    probs = (values - total).exp()
    # The tokens kept are those before which less than top_p lies; the most likely always stays, for a top_p so
    # small that float32 makes it 0.
    kept = max(1, int((probs.cumsum(0) - probs < top_p).sum()))
    return values[:kept], ids[:kept]
