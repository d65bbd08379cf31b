"""Where the native layer step puts a batch (kernels/decode_layer.py's Placement), asked as a forward call asks it,
for the tests that check which calls the kernel takes."""

from __future__ import annotations

from typing import Any

from qinfer.runtime.kernels.decode_layer import CacheRows, Placement
from qinfer.runtime.kv.batch import TokenBatch


def placement_of(forward: Any, batch: TokenBatch, cache: CacheRows) -> Placement | None:
    """The placement `forward`'s layer step gives `batch` over `cache`, as TransformerForward.forward asks it."""
    native = forward.native
    assert native is not None
    cos, _ = forward.rope(batch.positions)
    return native.placement(forward.embed_tokens(batch), batch, cos, cache, forward.ffn)
