"""Per-layer activation statistics (`activation/activation_{i}.pt`) as firing probabilities."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qinfer.core.errors import UserError
from qinfer.formats.activation_files import activation_paths, activation_unit, load_counts


@dataclass(frozen=True)
class ActivationStats:
    """`firing[i][j]`: probability that neuron j of layer i fires on a token.

    Counts become probabilities by dividing by the largest count in the model: profiling corpora are long enough
    that the hottest neuron of a ReLU model fires on (almost) every token, and the files do not record the token count.
    """

    firing: tuple[np.ndarray, ...]
    digest: str


def load_activation(directory: Path, ffn_neurons: tuple[int, ...]) -> ActivationStats:
    # An expert profile's layer may be as long as a dense layer's FFN by chance; its unit tells them apart.
    if (unit := activation_unit(directory)) != "neuron":
        raise UserError(
            f"{directory} counts how often each {unit} is routed to, not neuron firings; point --activation at a "
            "dense model's `qinfer prep profile` directory"
        )
    paths = activation_paths(directory, len(ffn_neurons))
    digest = hashlib.sha256()
    counts = []
    for index, (path, f) in enumerate(zip(paths, ffn_neurons, strict=True)):
        raw = path.read_bytes()
        digest.update(f"{index}:{len(raw)}:".encode())
        digest.update(raw)
        counts.append(load_counts(path, f).detach().to(torch.float64).numpy())
    return ActivationStats(firing=to_firing(counts), digest=digest.hexdigest())


def to_firing(counts: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    top = max(float(c.max()) for c in counts) if counts else 0.0
    if top <= 0:
        raise UserError("every activation count is zero; profile the model on a non-empty corpus")
    return tuple(np.clip(c / top, 0.0, 1.0) for c in counts)


def power_law_firing(
    n_layers: int, ffn: int, *, exponent: float = 1.1, mean_firing: float = 0.12, seed: int = 0
) -> tuple[np.ndarray, ...]:
    """Synthetic statistics: rank-r neuron fires with probability ~ r^-exponent (shuffled), ~`mean_firing` on average.

    Each layer gets its own exponent jitter so that layers differ in how concentrated their hot set is.
    """
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, ffn + 1, dtype=np.float64)
    layers = []
    for _ in range(n_layers):
        p = ranks ** -(exponent * rng.uniform(0.7, 1.3))
        p = np.clip(p * mean_firing / p.mean(), 0.0, 1.0)
        layers.append(rng.permutation(p))
    return tuple(layers)
