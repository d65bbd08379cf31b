"""Rotary position embeddings: the model's frequencies, one step's cos/sin tables, and the two ways of rotating.

`pairs` rotates adjacent dimensions (x[2i], x[2i+1]): ggml's default rope, for which a converter reorders q/k rows
(LLaMA). `neox` rotates x[i] against x[i + d/2] (rotate-half): Falcon and Qwen2, whose rows stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from qinfer.core.errors import UserError
from qinfer.core.names import Tensor, tensor_name
from qinfer.runtime.model.model_file import ModelFile


def inv_freq(model: ModelFile) -> torch.Tensor:
    """Rope's frequencies, each divided by the file's factor for it where its rope is scaled (rope_freqs, as
    llama.cpp applies them); made once per model, not per layer and step."""
    cfg = model.config
    freq = 1.0 / (cfg.rope_base ** (torch.arange(0, cfg.rope_dim, 2, dtype=torch.float32) / cfg.rope_dim))
    name = tensor_name(Tensor.ROPE_FREQS)
    factors = model.tensors.get(name)
    if factors is None:
        return freq
    # check_model lets only F32 through for a 1-D tensor. A divisor of 0, or NaN, makes NaN logits far from their
    # cause; a negative one turns the rotation backwards with no sign at all.
    divisors = factors.float()
    if not bool(torch.isfinite(divisors).all() and (divisors > 0).all()):
        raise UserError(f"{model.path}: {name} holds a divisor that is not a finite positive number; re-convert it")
    return freq / divisors


def rope_tables(freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.float()[:, None] * freq[None, :]
    return angles.cos(), angles.sin()


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of each head; x is [T, heads, head_dim]."""
    pairs = x.unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x[i] against x[i + d/2] in each head; x is [T, heads, head_dim]."""
    first, second = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((first * c - second * s, second * c + first * s), dim=-1)


ROTATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "pairs": rotate_pairs,
    "neox": rotate_half,
}
