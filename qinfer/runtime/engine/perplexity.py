"""Perplexity of a model on a text, as llama.cpp's `perplexity` measures it.

The tokenised text is cut into non-overlapping windows of `ctx` tokens, each window's first token is replaced
by BOS, and only the second half of each window is scored, so every scored token has at least ctx/2 tokens
of context. Dense mode runs each window as one prompt; sparse mode feeds it one token at a time through the
decode path, where the predictor picks the neurons, so the figure includes the predictor's misses.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import DEFAULT_KV_TYPES, KVPolicy, KVTypes
from qinfer.runtime.engine.sampling import unusable
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import make_kv_cache, non_finite_cause
from qinfer.runtime.model.forward import TransformerForward


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    stderr: float  # of the perplexity, from the spread of per-token negative log-likelihoods
    windows: int
    scored_tokens: int
    window_perplexities: list[float]


def window_logits(
    forward: TransformerForward,
    tokens: torch.Tensor,
    token_by_token: bool,
    kv_policy: KVPolicy | None = None,
    kv_types: KVTypes = DEFAULT_KV_TYPES,
) -> torch.Tensor:
    cache = make_kv_cache(forward.cfg, tokens.shape[0], policy=kv_policy, types=kv_types)
    if not token_by_token:
        logits = forward.forward(TokenBatch.prompt(tokens, 0), cache)
    else:
        steps = enumerate(tokens.tolist())
        logits = torch.cat([forward.forward(TokenBatch.decode([int(t)], [j], [0]), cache) for j, t in steps])
    if unusable(logits):
        cause = non_finite_cause(cache, 0, tokens.shape[0])
        raise UserError(f"the perplexity is not finite: the logits hold NaN or inf: {cause}")
    return logits


def perplexity(
    forward: TransformerForward,
    ids: list[int],
    ctx: int,
    bos_id: int | None,
    token_by_token: bool = False,
    on_window: Callable[[int, int, float], None] | None = None,
    kv_policy: KVPolicy | None = None,
    kv_types: KVTypes = DEFAULT_KV_TYPES,
) -> PerplexityResult:
    """`on_window(i, n, ppl_so_far)` is called after each of the n windows; `kv_policy` (default full) decides
    which KV rows the window keeps, `kv_types` their element types."""
    if ctx < 4:
        raise UserError(f"context {ctx} is too small; use at least 4 tokens")
    if ctx > forward.cfg.context_length:
        raise UserError(f"context {ctx} exceeds the model's {forward.cfg.context_length} tokens")
    n = len(ids) // ctx
    if n == 0:
        raise UserError(f"the text has {len(ids)} tokens, fewer than one window of {ctx}; use a longer text or -c")
    first = ctx // 2
    nll: list[torch.Tensor] = []
    window_ppl = []
    with torch.inference_mode():
        for i in range(n):
            tokens = torch.tensor(ids[i * ctx : (i + 1) * ctx])
            if bos_id is not None:
                tokens[0] = bos_id
            # A window cache is judged as decode meets it: every scored token sees only the rows kept before it.
            one_by_one = token_by_token or (kv_policy is not None and kv_policy.windowed)
            logits = window_logits(forward, tokens, one_by_one, kv_policy, kv_types).float().cpu()
            logp = torch.log_softmax(logits[first : ctx - 1], dim=-1)
            window = -logp.gather(1, tokens[first + 1 :, None])[:, 0].double()
            nll.append(window)
            window_ppl.append(_exp(float(window.mean())))
            if on_window is not None:
                on_window(i, n, _exp(float(torch.cat(nll).mean())))
    every = torch.cat(nll)
    mean = float(every.mean())
    spread = float(every.std()) / math.sqrt(every.numel()) if every.numel() > 1 else 0.0
    ppl = _exp(mean)
    return PerplexityResult(ppl, ppl * spread, n, every.numel(), window_ppl)


def _exp(mean_nll: float) -> float:
    """The perplexity of a mean negative log-likelihood, refused where it is not a finite number: finite logits
    (window_logits refuses the others) so far off that the perplexity overflows come from damaged weights."""
    if not math.isfinite(mean_nll) or mean_nll > math.log(sys.float_info.max):
        raise UserError("the perplexity is not finite: the model's weights are damaged; re-convert it")
    return math.exp(mean_nll)
