"""FFN runners for one device: dense, and predictor-sparse (or oracle-sparse, for testing)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import torch

from qinfer.runtime.ffn.schedule import FFNSchedule
from qinfer.runtime.ffn.sparse import (
    FFNWeights,
    active_ids,
    dense_ffn,
    gate_mask,
    predicted_mask,
    sparse_rows,
    true_mask,
)

# predictor: fc2(relu(fc1(h))) over the threshold; gate: a calibrated model's |act(gate)| over its layer's threshold;
# oracle: the true active set (testing).
Selector = Literal["predictor", "gate", "oracle"]


class DenseRunner:
    def __init__(self, layers: list[FFNWeights]):
        # Dense means every neuron: a calibrated model's gate thresholds are not applied, on either path.
        self.layers = [replace(w, gate_threshold=0.0) for w in layers]

    def __call__(self, layer: int, x: torch.Tensor, h: torch.Tensor, prefill: bool) -> torch.Tensor:
        return dense_ffn(self.layers[layer], x)

    def native_rows(self) -> tuple[Sequence[FFNWeights], float | None]:
        """For the native layer step (kernels/decode_layer.py): every neuron of every layer."""
        return self.layers, None


def select(w: FFNWeights, x: torch.Tensor, h: torch.Tensor, threshold: float, selector: Selector) -> torch.Tensor:
    """Per-token neuron selection [T, F]: the predictor's, the gate's, or the true active set (oracle)."""
    if selector == "gate":
        return gate_mask(w, x)
    return true_mask(w, x) if selector == "oracle" else predicted_mask(w, h, threshold)


class SparseRunner:
    """Decode computes only the selected neurons' rows; prefill stays dense. With a `schedule`, the native layer
    step reads a layer's dense rows instead wherever the schedule finds them quicker for the step's tokens."""

    def __init__(
        self,
        layers: list[FFNWeights],
        threshold: float,
        selector: Selector = "predictor",
        schedule: FFNSchedule | None = None,
    ):
        self.layers = layers
        self.threshold = threshold
        self.selector = selector
        self.schedule = schedule

    def native_rows(self) -> tuple[Sequence[FFNWeights], float | None] | None:
        """For the native layer step (kernels/decode_layer.py): the predictor's neurons, or every neuron whose gate
        passes its threshold (the step's dense path skips the others); not the oracle's."""
        if self.selector == "gate":
            return self.layers, None
        return (self.layers, self.threshold) if self.selector == "predictor" else None

    def __call__(self, layer: int, x: torch.Tensor, h: torch.Tensor, prefill: bool) -> torch.Tensor:
        w = self.layers[layer]
        if prefill:
            return dense_ffn(w, x)
        mask = select(w, x, h, self.threshold, self.selector)
        ids = active_ids(mask)
        # With one token every selected neuron is selected for it: no per-token mask needed.
        token_mask = mask[:, ids] if x.shape[0] > 1 else None
        return sparse_rows(w.form, x, w.gate, w.up, w.down_t, ids, token_mask, w.up_bias)
