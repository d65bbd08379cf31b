"""Where the native layer step puts a batch (kernels/decode_layer.py's Placement), asked as a forward call asks it
or counted as the layers run, for the tests that check which calls the kernel takes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from qinfer.runtime.kernels.decode_layer import CacheRows, DecodeLayers, Placement
from qinfer.runtime.kv.batch import TokenBatch


def placement_of(forward: Any, batch: TokenBatch, cache: CacheRows) -> Placement | None:
    """The placement `forward`'s layer step gives `batch` over `cache`, as TransformerForward.forward asks it."""
    native = forward.native
    assert native is not None
    return native.placement(forward.embed_tokens(batch), batch, forward.inv_freq, cache, forward.ffn)


def counting_runs(monkeypatch: pytest.MonkeyPatch) -> dict[Placement, list[int]]:
    """The layers the native step runs from now on, in order, by the placement of their calls' tokens: each call runs
    every layer, first to last."""
    calls: dict[Placement, list[int]] = {}
    real = DecodeLayers.step

    def step(
        self: DecodeLayers, h: torch.Tensor, batch: Any, cache: CacheRows, placement: Placement, *rest: Any
    ) -> Any:
        calls.setdefault(placement, []).extend(range(len(self.layers)))
        return real(self, h, batch, cache, placement, *rest)

    monkeypatch.setattr(DecodeLayers, "step", step)
    return calls
