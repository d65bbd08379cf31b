"""ReLU FFN of one layer, dense or over a subset of neurons, for the three FFN variants.

Neuron i is row i of gate, up and down_t. Variants: llama relu(gate) * up, bamboo relu(gate) * relu(up),
falcon relu(up) (no gate). A neuron contributes only where it is selected for that token (`mask`), so a
selection from the predictor gives the predictor's output and the true active set gives the dense output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from qinfer_core.errors import UserError
from qinfer_runtime import row_kernels
from qinfer_runtime.weight_rows import gather_rows, linear, weighted_row_sum

Variant = Literal["llama", "bamboo", "falcon"]
VARIANTS: dict[str, Variant] = {"llama": "llama", "bamboo": "bamboo", "falcon": "falcon"}


@dataclass
class FFNWeights:
    """One layer's FFN and predictor; fc1 [P, E] and fc2 [F, P] are absent in a dense GGUF."""

    variant: Variant
    up: torch.Tensor
    down_t: torch.Tensor
    gate: torch.Tensor | None = None
    fc1: torch.Tensor | None = None
    fc2: torch.Tensor | None = None

    @property
    def neurons(self) -> int:
        return self.up.shape[0]

    @property
    def has_predictor(self) -> bool:
        return self.fc1 is not None and self.fc2 is not None


def activations(variant: Variant, x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
    """Per-neuron activation [T, k] for input x [T, E] and the (gathered) gate/up rows."""
    u = linear(x, up)
    if variant == "falcon":
        return F.relu(u)
    if gate is None:
        raise UserError(f"a {variant} FFN needs ffn_gate")
    g = F.relu(linear(x, gate))
    return g * (F.relu(u) if variant == "bamboo" else u)


def dense_ffn(w: FFNWeights, x: torch.Tensor) -> torch.Tensor:
    return weighted_row_sum(activations(w.variant, x, w.gate, w.up), w.down_t)


def sparse_rows(
    variant: Variant,
    x: torch.Tensor,
    gate: torch.Tensor | None,
    up: torch.Tensor,
    down_t: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """FFN output [T, E] from neurons `ids` (row ids into these weights); `mask` [T, len(ids)] keeps, per token,
    only the neurons selected for it (None: all of them)."""
    if ids.numel() == 0:
        return torch.zeros(x.shape[0], down_t.shape[1], device=x.device)
    if (out := row_kernels.sparse_ffn(variant, x, gate, up, down_t, ids, mask)) is not None:
        return out
    # `activations` consumes both gathers before anything reuses their scratch buffers.
    gate_rows = None if gate is None else gather_rows(gate, ids, "gate")
    act = activations(variant, x, gate_rows, gather_rows(up, ids, "up"))
    if mask is not None:
        act = act * mask.to(act.device)
    return weighted_row_sum(act, down_t, ids)


def predicted_mask(w: FFNWeights, h: torch.Tensor, threshold: float) -> torch.Tensor:
    """Neurons the predictor flags for each token of h [T, E]: fc2(relu(fc1(h))) >= threshold, as bool [T, F]."""
    if w.fc1 is None or w.fc2 is None:
        raise UserError("this model file has no predictors (fc1/fc2): use a PowerInfer GGUF, or run it dense")
    return linear(F.relu(linear(h, w.fc1)), w.fc2) >= threshold


def true_mask(w: FFNWeights, x: torch.Tensor) -> torch.Tensor:
    """The neurons whose activation is non-zero for each token (the oracle a perfect predictor would match)."""
    return activations(w.variant, x, w.gate, w.up) != 0
