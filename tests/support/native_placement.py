"""Where the native layer step puts a batch (kernels/decode_layer.py's Placement), asked as a forward call asks it
or counted as the layers run, for the tests that check which calls the kernel takes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qinfer.runtime.kernels.decode_layer import CacheRows, DecodeLayers, NativeStep, Placement
from qinfer.runtime.kv.batch import TokenBatch


def placement_of(forward: Any, batch: TokenBatch, cache: CacheRows) -> Placement | None:
    """The placement `forward`'s layer step gives `batch` over `cache`, as TransformerForward.forward asks it."""
    native = forward.native
    assert native is not None
    cos, _ = forward.rope(batch.positions)
    return native.placement(forward.embed_tokens(batch), batch, cos, cache, forward.ffn)


def counting_runs(monkeypatch: pytest.MonkeyPatch) -> dict[Placement, list[int]]:
    """The layers the native step runs from now on, in order, by the placement of their calls' tokens."""
    calls: dict[Placement, list[int]] = {}
    real = DecodeLayers.run

    def run(self: DecodeLayers, i: int, h: torch.Tensor, call: NativeStep, cache: CacheRows) -> torch.Tensor:
        calls.setdefault(call.placement, []).append(i)
        return real(self, i, h, call, cache)

    monkeypatch.setattr(DecodeLayers, "run", run)
    return calls
