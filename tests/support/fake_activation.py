"""Synthetic activation files for planner and split tests: a power law over neurons, shuffled per layer; given
expert counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from qinfer.formats.activation_files import write_activations


def write_power_law_activation(directory: Path, layers: int = 2, f: int = 256, seed: int = 0) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(layers):
        counts = (1000.0 / np.arange(1, f + 1)) ** 1.2
        torch.save(torch.tensor(rng.permutation(counts), dtype=torch.float32), directory / f"activation_{i}.pt")


def write_expert_activation(directory: Path, counts: list[list[int]], tokens: int) -> None:
    """A mixture's activation directory as `prep profile` writes one: per layer the tokens that chose each expert,
    and a summary whose unit is the expert."""
    write_activations(directory, torch.tensor(counts, dtype=torch.int64), tokens, {"unit": "expert"})
