"""Model shapes for planner tests that need only the sizes: the fields a layout reads, the rest fixed."""

from __future__ import annotations

from qinfer.core.model_spec import ModelSpec


def shape_spec(arch: str, *, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int) -> ModelSpec:
    """A spec with no known context (0) and a norm epsilon nothing here reads."""
    return ModelSpec(
        arch=arch, name="test", vocab_size=vocab, context_length=0, hidden=hidden, layers=layers, ffn=ffn,
        heads=heads, kv_heads=kv_heads, norm_eps=1e-6,
    )  # fmt: skip
