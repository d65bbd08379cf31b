"""KV-cache rows as llama.cpp's Q8_0 blocks, in torch: what the torch path writes and reads back of a q8_0 cache
(the native step, decode_layer.c, writes the same bytes and reads them in place).

A block of 32 values is its f16 scale d = max|x| / 127 and 32 int8 q = round(x / d), each value d * q; rounding is
quantize_row_q8_0_ref's: x times 1 / d (d before its f16 rounding), to the nearest integer, halves away from zero.
"""

from __future__ import annotations

import torch

from qinfer.core.kv_policy import CACHE_TYPES, Q8_0

BLOCK, BLOCK_BYTES = CACHE_TYPES[Q8_0]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a multiple of 32) as uint8 [..., n / 32 * 34]: per block, d's two bytes, then the 32 q."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = blocks * torch.where(d == 0, 0.0, 1.0 / d)
    # C's roundf: torch.round takes halves to even, so a half is moved away from zero by hand.
    whole = scaled.trunc()
    q = torch.where((scaled - whole).abs() >= 0.5, whole + scaled.sign(), whole).to(torch.int8)
    return torch.cat((d.half().view(torch.uint8), q.view(torch.uint8)), dim=-1).flatten(-2)


def dequantize_rows(data: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 32 * 34] back to float32 [..., n]: d * q."""
    blocks = data.reshape(*data.shape[:-1], -1, BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (d * q).flatten(-2)
