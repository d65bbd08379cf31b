"""The full KV cache's batched attention: rows past a sequence's position are hidden, whatever they hold."""

from __future__ import annotations

from pathlib import Path

import torch

from qinfer.core.kv_policy import F32_KV
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.kv.batch import TokenBatch
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
