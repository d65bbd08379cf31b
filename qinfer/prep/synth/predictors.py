"""The synth LLaMA's PowerInfer-style predictors: built exact from the weights, thresholded, measured, saved.

Why the predictors are exact: the rest of each gate_proj is kept at rank P/2 - 1 (its rows stay in a fixed
random subspace; P is capped at 2 * hidden), so with the bias column the sign-deciding matrix has rank P/2 and
fc2 @ relu(fc1 @ h) reproduces it, as relu(z) - relu(-z) = z. Real ReLU models get by with small predictors
for the same reason, their firing patterns are low-dimensional; here that is built in rather than learned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from qinfer.formats.predictor_dir import FC1, FC2
from qinfer.formats.torch_files import save_torch_file
from qinfer.prep.synth.model import Observed

Predictor = tuple[torch.Tensor, torch.Tensor]  # fc1.weight [P, E], fc2.weight [F, P]
PREDICTOR_RECALL = 0.97  # the threshold keeps this share of calibration firings (the sign suffices if exact)


def build_predictors(model: LlamaForCausalLM, bases: list[torch.Tensor], width: int) -> list[Predictor]:
    """Per layer fc1 [width, E] and fc2 [F, width] with fc2 @ relu(fc1 @ h) = (gate_proj * norm weight) @ h.

    That matrix factors as A @ B: A = [bias column, gate coordinates in the basis], B = [norm weight of
    channel 0; basis^T scaled by the other norm weights]; fc1 = [B; -B] and fc2 = [A, -A], zero-padded.
    """
    predictors = []
    for layer, basis in zip(model.model.layers, bases, strict=True):
        with torch.no_grad():
            gate, norm = layer.mlp.gate_proj.weight, layer.post_attention_layernorm.weight
            a = torch.cat([gate[:, :1], gate[:, 1:] @ basis], dim=1)
            b = torch.zeros(a.shape[1], gate.shape[1])
            b[0, 0] = norm[0]
            b[1:, 1:] = basis.T * norm[1:]
        r = a.shape[1]
        fc1 = torch.zeros(width, gate.shape[1])
        fc2 = torch.zeros(gate.shape[0], width)
        fc1[:r], fc1[r : 2 * r] = b, -b
        fc2[:, :r], fc2[:, r : 2 * r] = a, -a
        predictors.append((fc1, fc2))
    return predictors


def predictor_scores(predictor: Predictor, h: torch.Tensor) -> torch.Tensor:
    fc1, fc2 = predictor
    return torch.relu(h @ fc1.T) @ fc2.T


def choose_threshold(predictors: list[Predictor], seen: Observed) -> float:
    """The score above which PREDICTOR_RECALL of the observed firings lie, but never above 0 (the exact sign)."""
    with torch.no_grad():
        scores = torch.cat(
            [predictor_scores(p, h)[f] for p, h, f in zip(predictors, seen.inputs, seen.fired, strict=True)]
        )
    if not len(scores):
        return 0.0
    k = max(1, int((1.0 - PREDICTOR_RECALL) * len(scores)))
    return min(0.0, float(scores.kthvalue(k).values))


@dataclass(frozen=True)
class Stats:
    per_layer_sparsity: list[float]
    top20_share: float
    loss: float
    recall: float
    predicted_sparsity: float

    @property
    def sparsity(self) -> float:
        return sum(self.per_layer_sparsity) / len(self.per_layer_sparsity)


def top_share(fired: torch.Tensor, fraction: float = 0.2) -> float:
    """Share of all firings in `fired` [tokens, F] that its hottest `fraction` of neurons account for."""
    counts = fired.sum(dim=0).sort(descending=True).values
    total = int(counts.sum())
    return int(counts[: max(1, int(fraction * len(counts)))].sum()) / total if total else 0.0


def measure(predictors: list[Predictor], threshold: float, seen: Observed) -> Stats:
    with torch.no_grad():
        flagged = [predictor_scores(p, h) >= threshold for p, h in zip(predictors, seen.inputs, strict=True)]
    firings = sum(int(f.sum()) for f in seen.fired)
    hits = sum(int((p & f).sum()) for p, f in zip(flagged, seen.fired, strict=True))
    return Stats(
        per_layer_sparsity=[1.0 - float(f.float().mean()) for f in seen.fired],
        top20_share=sum(top_share(f) for f in seen.fired) / len(seen.fired),
        loss=seen.loss,
        recall=hits / firings if firings else 1.0,
        predicted_sparsity=1.0 - sum(float(p.float().mean()) for p in flagged) / len(flagged),
    )


def save_predictors(predictors: list[Predictor], threshold: float, predictor_dir: Path) -> None:
    predictor_dir.mkdir()
    for i, (fc1, fc2) in enumerate(predictors):
        save_torch_file({FC1: fc1, FC2: fc2}, predictor_dir / f"model_{i}.pt")
    config = json.dumps({"sparse_threshold": threshold}, indent=2) + "\n"
    (predictor_dir / "config.json").write_text(config, encoding="utf-8")
