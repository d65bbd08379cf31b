"""The full KV cache's attention: rows past a sequence's position are hidden, whatever they hold, and a long
prompt's queries see the keys their positions allow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qinfer.core.kv_policy import F32_KV
from qinfer.core.model_spec import ModelSpec
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.kv.batch import TokenBatch, batch_step
from qinfer.runtime.kv.cache import KVCache


def test_stale_rows_past_a_position_cannot_poison_a_batch(gguf_files: dict[str, Path]) -> None:
    """A slot keeps an earlier sequence's rows past the new one's position; an f16 overflow left inf there. Two
    sequences at different positions decode together (the shorter one's mask hides the other's extra rows): the
    logits are those of a clean cache, finite."""
    engine = Engine.open(gguf_files["pi-f32"], slots=2, ctx_size=64, ffn="dense")
    forward = engine.forward
    forward.native = None  # the torch path: the one a GPU's batches and its graphed step take
    ids = engine.tokenizer.encode("Once upon a time, there was a little dog named Max.")
    logits = []
    for stale in (False, True):
        cache = KVCache(forward.cfg, 64, slots=2, types=F32_KV)
        with torch.inference_mode():
            forward(torch.tensor(ids[:4]), 0, cache, 0)
            forward(torch.tensor(ids[:9]), 0, cache, 1)
            if stale:
                cache.k[:, 0, :, 4:] = float("inf")
                cache.v[:, 0, :, 4:] = float("inf")
            logits.append(forward.forward(TokenBatch.decode([ids[4], ids[9]], [4, 9], [0, 1]), cache))
    assert torch.isfinite(logits[1]).all() and torch.equal(logits[0], logits[1])


def qkv(cfg: ModelSpec, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    q = torch.randn(tokens, cfg.heads, cfg.head_dim, generator=g)
    k = torch.randn(tokens, cfg.kv_heads, cfg.head_dim, generator=g)
    v = torch.randn(tokens, cfg.kv_heads, cfg.head_dim, generator=g)
    return q, k, v


def float64_attention(
    cfg: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: int, window: int | None
) -> torch.Tensor:
    """The query at position p over the keys it may see, in float64 [heads, head_dim]."""
    group = cfg.heads // cfg.kv_heads
    keys, values = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    first = 0 if window is None else max(0, p - window + 1)
    scores = torch.einsum("hd,khd->hk", q[p].double(), keys[first : p + 1]) / cfg.head_dim**0.5
    return torch.einsum("hk,khd->hd", scores.softmax(-1), values[first : p + 1])


@pytest.mark.parametrize("window", [None, 50])
def test_a_long_prompt_attends_causally_block_by_block(gguf_files: dict[str, Path], window: int | None) -> None:
    """A prompt's queries go 64 at a time, each block over the keys up to its last position: two chunks (70 tokens
    from position 0, then 90 from 70) give every query the float64 softmax over the keys it may see, with and
    without a sliding window."""
    cfg = Engine.open(gguf_files["pi-f32"], ctx_size=64, ffn="dense").forward.cfg
    cache = KVCache(cfg, 160, types=F32_KV)
    q, k, v = qkv(cfg, 160)
    outs = []
    for a, b in ((0, 70), (70, 160)):
        batch = TokenBatch.prompt(torch.zeros(b - a, dtype=torch.long), a)
        step = batch_step(batch, batch.positions, window)
        outs.append(cache.attend(q[a:b], k[a:b], v[a:b], 0, step))
    out = torch.cat(outs).view(160, cfg.heads, cfg.head_dim).double()
    for p in range(160):
        assert (out[p] - float64_attention(cfg, q, k, v, p, window)).abs().max() <= 1e-5, p


@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("kept", ["last", "most", "none"])
def test_a_chunk_attends_the_queries_asked_for_alone(
    gguf_files: dict[str, Path], window: int | None, kept: str
) -> None:
    """A chunk of 90 tokens from position 70 attends only the queries asked for (the last; 77 of them, in two
    blocks; none): those rows are the float64 softmax over the keys each may see, and every token's keys and values
    are stored, as the next query finds them."""
    cfg = Engine.open(gguf_files["pi-f32"], ctx_size=64, ffn="dense").forward.cfg
    cache = KVCache(cfg, 161, types=F32_KV)
    q, k, v = qkv(cfg, 161)
    queries = {"last": [89], "most": [i for i in range(90) if i % 7], "none": []}[kept]
    for a, b in ((0, 70), (70, 160)):
        batch = TokenBatch.prompt(torch.zeros(b - a, dtype=torch.long), a)
        step = batch_step(batch, batch.positions, window)
        rows = cache.query_rows(step, queries if a else None)
        assert rows == (queries if a else None)
        rows_q = q[a:b] if rows is None else q[a:b][rows]
        out = cache.attend(rows_q, k[a:b], v[a:b], 0, step, rows).view(-1, cfg.heads, cfg.head_dim).double()
    assert out.shape[0] == len(queries)
    for row, i in enumerate(queries):
        assert (out[row] - float64_attention(cfg, q, k, v, 70 + i, window)).abs().max() <= 1e-5, i
    batch = TokenBatch.decode([0], [160], [0])
    step = batch_step(batch, batch.positions, window)
    last = cache.attend(q[160:], k[160:], v[160:], 0, step).view(cfg.heads, cfg.head_dim).double()
    assert (last - float64_attention(cfg, q, k, v, 160, window)).abs().max() <= 1e-5
