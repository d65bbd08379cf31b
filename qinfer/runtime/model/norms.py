"""The norms the families use: RMSNorm (llama, bamboo) and LayerNorm with a bias (falcon, opt), in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qinfer.core.names import BIAS, Tensor, tensor_name
from qinfer.runtime.model.model_file import ModelFile

Norm = tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight and bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def layer_norm(x: torch.Tensor, norm: Norm, eps: float) -> torch.Tensor:
    weight, bias = norm
    return F.layer_norm(x, (x.shape[-1],), weight.float(), bias.float(), eps)


def norm_weights(
    model: ModelFile, part: Tensor, layer: int | None = None, device: torch.device | str = "cpu"
) -> Norm:
    return (
        model.tensor(tensor_name(part, layer)).to(device),
        model.tensor(tensor_name(part, layer, BIAS)).to(device),
    )
