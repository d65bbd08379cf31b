"""Checkpoints whose every number is made from seeded integers, so that their bytes are the same on any CPU.

The synth builders train (or multiply) in float arithmetic, whose last bits differ with the CPU's instruction set
and torch's kernels for it; a test of output bytes needs inputs that do not. Each weight becomes k / 2^s for seeded
integers k (exact in float32), in place, keeping every tensor's name, shape, dtype and the file's layout; the
tokenizer files, which no float arithmetic makes, stay as built.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

WIDTH = 255  # integers in [-WIDTH, WIDTH]


def seeded_like(t: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """A tensor of t's shape and dtype holding k / (WIDTH * 2^bits) for seeded integers k, scaled down with the
    width of the rows so that products stay in range; 1-D tensors (norms, biases) centre on 1 or 0 alike."""
    k = rng.integers(-WIDTH, WIDTH + 1, size=tuple(t.shape), dtype=np.int64)
    fan_in = t.shape[-1] if t.dim() > 1 else 1
    scale = 2.0 ** -(int(np.log2(fan_in)) // 2) / WIDTH  # a power of two: the product is exact
    return torch.from_numpy(k.astype(np.float64) * scale).to(t.dtype)


def reseed(directory: Path, seed: int) -> None:
    """Rewrite every tensor of the safetensors and torch files under `directory` with seeded values."""
    rng = np.random.Generator(np.random.PCG64(seed))
    for path in sorted(directory.rglob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata()
            tensors = {name: f.get_tensor(name) for name in sorted(f.keys())}
        save_file({name: seeded_like(t, rng) for name, t in tensors.items()}, str(path), metadata)
    for path in sorted(directory.rglob("*.pt")):
        state = torch.load(path, weights_only=True)
        torch.save({name: seeded_like(t, rng) for name, t in sorted(state.items())}, path)


def write_integer_power_law_activation(directory: Path, layers: int = 2, f: int = 256, seed: int = 0) -> None:
    """Activation counts 2^20 // rank per neuron, shuffled per layer: a power law with integer counts."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.Generator(np.random.PCG64(seed))
    for i in range(layers):
        counts = rng.permutation((1 << 20) // np.arange(1, f + 1))
        torch.save(torch.from_numpy(counts.astype(np.float32)), directory / f"activation_{i}.pt")
