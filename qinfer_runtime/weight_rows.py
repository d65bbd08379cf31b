"""The one place where the runtime reads weights: whole matrices for matmuls, and rows (neurons) by id.

Weights are torch tensors in the file's dtype (F32/F16 views of the mapped GGUF, or device copies of them);
every matmul runs in that dtype and returns float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in the weight's dtype, as float32."""
    return F.linear(x.to(weight.dtype), weight).float()


def gather_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of `weight` ([F, E] with row i = neuron i) as a dense [len(ids), E] tensor on the weight's device."""
    return torch.index_select(weight, 0, ids.to(weight.device))


def rows_to(weight: torch.Tensor, ids: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of rows `ids` on `device`, in the stored dtype (GPU residency and rows shipped per step)."""
    return gather_rows(weight, ids).to(device)
