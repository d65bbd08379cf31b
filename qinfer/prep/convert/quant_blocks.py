"""Q4_0 and Q8_0 blocks with the bytes the PowerInfer engine's `quantize` writes: ggml's reference quantizers
(ggml-quants.c), vectorised over arrays of rows.

The arithmetic is C's float32 arithmetic, with one step that depends on how the engine is compiled: its CMake
build (GCC, -march=native, -std=gnu11, hence -ffp-contract=fast) fuses Q4_0's `x*id + 8.5f` into one FMA on any
CPU with FMA, so that sum is rounded once rather than twice. gguf-py's `gguf.quants` rounds it twice, and writes
an all-zero Q4_0 block whose first zero is -0.0 with scale +0.0 where ggml writes -0.0.
Out of scope: non-finite weights, and blocks so small that 1/d overflows to inf (largest magnitude below 2^-125
for Q4_0, about 2^-121 for Q8_0); ggml's float to int8 conversion of what they give is undefined behaviour.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# Weights per block and bytes per block (an f16 scale, then 4-bit or 8-bit quants), from gguf's table: the layout
# the readers and the native kernels use too.
QK, Q4_0_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0]
_, Q8_0_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]
# Blocks taken through each step together: the temporaries (1 MiB of float64 at most) stay in cache, which makes
# a 1024-row read of a 7B tensor 1.5 (Q8_0) to 2 (Q4_0) times as fast as steps over the whole read.
SLAB_BLOCKS = 4096
_BELOW_HALF = np.nextafter(np.float32(0.5), np.float32(0))


def _inverse(d: np.ndarray) -> np.ndarray:
    # `d ? 1.0f/d : 0.0f`, without a division by zero.
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    return inv


def _scale_bytes(d: np.ndarray) -> np.ndarray:
    # numpy's float32 -> float16 gives the bits of both GGML_FP32_TO_FP16 (F16C `_cvtss_sh(d, 0)` and the
    # portable bit-twiddling version) for every float32 but NaNs: round to nearest even, f16 subnormals
    # included. A scale past the f16 range becomes inf in ggml too, so numpy's overflow warning is noise.
    with np.errstate(over="ignore"):
        return d.astype("<f2").view(np.uint8).reshape(-1, 2)


def _q4_0_slab(blocks: np.ndarray, out: np.ndarray) -> None:
    # Weight j of every block in row j: reductions over a block become elementwise across blocks, much faster.
    x = np.ascontiguousarray(blocks.T, dtype=np.float32)
    # C keeps the first weight of largest magnitude (strict `amax < fabsf(v)`). Only where both signs reach it
    # does "first" matter; elsewhere the larger of max and -min is that weight.
    top, bottom = x.max(axis=0), x.min(axis=0)
    big = np.where(top >= -bottom, top, bottom)
    both = np.nonzero((top == -bottom) & (top != 0))[0]
    big[both] = x[(np.abs(x[:, both]) == top[both]).argmax(axis=0), both]
    # C starts from max = +0.0f, which an all-zero block never replaces: its d is +0.0f / -8 = -0.0f whatever
    # the signs of its zeros.
    big[big == 0] = 0
    d = big / np.float32(-8)
    # The FMA's single rounding of x*id + 8.5f to float32, through float64: the product of two float32 is exact
    # there, and rounding the float64 sum cannot carry it across a float32 rounding boundary below an integer:
    # under 16 it moves the sum by 2^-50 at most, while such a product is on the boundary or 2^-49 or more away.
    fused = np.empty(x.shape, dtype=np.float32)
    np.add(np.multiply(x, _inverse(d), dtype=np.float64), 8.5, out=fused, casting="same_kind")
    # (int8_t) truncates toward zero, as numpy's cast does; the sum lies in [0.5, 16.5] for weights in scope.
    q = fused.astype(np.int8)
    np.minimum(q, 15, out=q)
    q = q.view(np.uint8)
    out[:, :2] = _scale_bytes(d)
    # Weight j in the low nibble of byte j, weight j + 16 in the high one.
    out[:, 2:] = (q[: QK // 2] | q[QK // 2 :] << 4).T


def _q8_0_slab(blocks: np.ndarray, out: np.ndarray) -> None:
    x = blocks.astype(np.float32, copy=False)
    d = np.abs(x).max(axis=1) / np.float32(127)
    v = x * _inverse(d)[:, None]
    # roundf takes halves away from zero (np.round takes them to even). Truncating v + 0.49999997f with v's sign
    # gives it for every float32; adding 0.5f instead would round 0.49999997f up to 1.
    v += np.copysign(_BELOW_HALF, v)
    out[:, :2] = _scale_bytes(d)
    out[:, 2:] = v.astype(np.int8).view(np.uint8)


def _quantize(rows: np.ndarray, block_bytes: int, slab: Callable[[np.ndarray, np.ndarray], None]) -> np.ndarray:
    if rows.shape[-1] % QK:
        raise ValueError(f"rows of {rows.shape[-1]} weights do not split into blocks of {QK}")
    blocks = rows.reshape(-1, QK)
    out = np.empty((len(blocks), block_bytes), dtype=np.uint8)
    for start in range(0, len(blocks), SLAB_BLOCKS):
        end = start + SLAB_BLOCKS
        slab(blocks[start:end], out[start:end])
    return out.reshape(*rows.shape[:-1], rows.shape[-1] // QK * block_bytes)


def quantize_q4_0(rows: np.ndarray) -> np.ndarray:
    """Q4_0 blocks of `rows` (last axis a multiple of 32; the other axes are kept, the last becomes bytes), as
    `quantize_row_q4_0_reference` computes them in the engine's build."""
    return _quantize(rows, Q4_0_BYTES, _q4_0_slab)


def quantize_q8_0(rows: np.ndarray) -> np.ndarray:
    """Q8_0 blocks of `rows` (last axis a multiple of 32; the other axes are kept, the last becomes bytes), as
    `quantize_row_q8_0_reference` computes them; nothing there for a compiler to fuse."""
    return _quantize(rows, Q8_0_BYTES, _q8_0_slab)
