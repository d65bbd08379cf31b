"""Our runtime's logits for a token sequence the way decode sees it, and transformers' for the same ids, shared by
the families' parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qinfer.core.kv_policy import F32_KV
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import KVCache
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model


def our_logits(path: Path, ids: list[int], ffn: str, split: int = 5) -> torch.Tensor:
    """A prompt of `split` tokens, then one token at a time through the KV cache (the sparse decode path)."""
    forward = load_forward(open_model(path), RuntimeOptions(ffn=ffn)).forward
    cache = KVCache(forward.cfg, 64, types=F32_KV)
    with torch.inference_mode():
        parts = [forward.forward(TokenBatch.prompt(torch.tensor(ids[:split]), 0), cache)]
        parts += [forward.forward(TokenBatch.decode([t], [split + j], [0]), cache) for j, t in enumerate(ids[split:])]
    return torch.cat(parts)


def last_logits(path: Path, ids: list[int], ffn: str) -> tuple[torch.Tensor, list[int]]:
    """`ids` as one prompt, asking for its last token's logits alone, as the engine does: past the last layer's
    attention only that token runs, and that attention takes its query alone. The logits, and the queries each
    layer's attention took."""
    forward = load_forward(open_model(path), RuntimeOptions(ffn=ffn)).forward
    cache = KVCache(forward.cfg, 64, types=F32_KV)
    queries: list[int] = []
    attend = cache.attend

    def counted(q: torch.Tensor, *args: Any) -> torch.Tensor:
        queries.append(q.shape[0])
        return attend(q, *args)

    cache.attend = counted  # type: ignore[method-assign]
    with torch.inference_mode():
        return forward.forward(TokenBatch.prompt(torch.tensor(ids), 0), cache, [len(ids) - 1])[0], queries


def reference_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' logits for `ids`, in float32, through the checkpoint's own model class."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def hf_ids(model_dir: Path, text: str) -> list[int]:
    return AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
