"""Llama-3.1's "llama3" rope scaling as a file holds it: one divisor per rotated frequency (rope_freqs), as
llama.cpp's converter writes it and its rope (and ours) divides each frequency by it."""

from __future__ import annotations

import math

import numpy as np

from qinfer.core.model_spec import ModelSpec


def llama3_rope_factors(spec: ModelSpec) -> np.ndarray:
    """[rope_dim / 2] float32: 1 for wavelengths shorter than the original context / high_freq_factor, `factor`
    for those longer than it / low_freq_factor, and a blend of the two between."""
    scaling = spec.rope_scaling
    assert scaling is not None
    dims = np.arange(0, spec.rope_dim, 2, dtype=np.float64) / spec.rope_dim
    wavelengths = 2 * math.pi * spec.rope_base**dims
    low_wavelength = scaling.original_context / scaling.low_freq_factor
    high_wavelength = scaling.original_context / scaling.high_freq_factor
    smooth = (scaling.original_context / wavelengths - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = 1 / ((1 - smooth) / scaling.factor + smooth)
    factors = np.where(
        wavelengths < high_wavelength, 1.0, np.where(wavelengths > low_wavelength, scaling.factor, blended)
    )
    return factors.astype(np.float32)
