"""How well predictors pick the firing neurons, and what masking the FFN by their picks does to the model."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from qinfer.core.architectures import Architecture
from qinfer.prep.profile.corpus_reader import batches
from qinfer.prep.profile.ffn_taps import counted_module, ffn_inputs, forward_hooks, hooked

Predictor = tuple[torch.Tensor, torch.Tensor]  # fc1.weight [P, E], fc2.weight [F, P]


@dataclass(frozen=True)
class LayerQuality:
    layer: int
    rank: int
    recall: float  # share of firing neurons that the predictor flags
    precision: float  # share of flagged neurons that fire
    predicted_sparsity: float  # share of neurons the predictor leaves out
    true_sparsity: float  # share of neurons that do not fire
    size_share: float  # predictor parameters / the layer's FFN parameters (3 * E * F)


def predictor_logits(predictor: Predictor, h: torch.Tensor) -> torch.Tensor:
    fc1, fc2 = predictor
    return torch.relu(h.to(fc1.dtype) @ fc1.T) @ fc2.T


def layer_quality(layer: int, predictor: Predictor, predicted: torch.Tensor, fired: torch.Tensor) -> LayerQuality:
    fc1, fc2 = predictor
    true_pos = float((predicted & fired).sum())
    hidden, ffn = fc1.shape[1], fc2.shape[0]
    return LayerQuality(
        layer=layer,
        rank=fc1.shape[0],
        recall=true_pos / max(float(fired.sum()), 1.0),
        precision=true_pos / max(float(predicted.sum()), 1.0),
        predicted_sparsity=1.0 - float(predicted.float().mean()),
        true_sparsity=1.0 - float(fired.float().mean()),
        size_share=(fc1.numel() + fc2.numel()) / (3 * hidden * ffn),
    )


@contextlib.contextmanager
def predictor_sparse_ffn(
    layers: list[nn.Module], arch: Architecture, predictors: list[Predictor], threshold: float
) -> Iterator[None]:
    """While active, each FFN computes only the neurons its predictor flags, as the sparse engine does: the gate
    output (up's, where there is no gate) of the others is zeroed, so after the ReLU they contribute nothing."""
    captured: dict[int, torch.Tensor] = {}

    def on_gate(i: int) -> Callable[..., torch.Tensor]:
        def hook(_module: nn.Module, _args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            mask = predictor_logits(predictors[i], captured.pop(i)) >= threshold
            return out * mask.to(out.dtype)

        return hook

    with hooked(forward_hooks(layers, counted_module(arch), on_gate)), ffn_inputs(layers, captured, arch):
        yield


def mean_nll(model: nn.Module, windows: list[torch.Tensor], batch_size: int, device: torch.device) -> float:
    """Mean next-token negative log-likelihood (nats) over the windows; exp of it is the perplexity."""
    total, count = 0.0, 0
    with torch.inference_mode():
        for batch in batches(iter(windows), batch_size):
            ids = batch.to(device)
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
            total += float(nll)
            count += ids[:, 1:].numel()
    return total / count if count else math.nan
