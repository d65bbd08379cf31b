"""Synthetic activation files for planner and split tests: a power law over neurons, shuffled per layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def write_power_law_activation(directory: Path, layers: int = 2, f: int = 256, seed: int = 0) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(layers):
        counts = (1000.0 / np.arange(1, f + 1)) ** 1.2
        torch.save(torch.tensor(rng.permutation(counts), dtype=torch.float32), directory / f"activation_{i}.pt")
