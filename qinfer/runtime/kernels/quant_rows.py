"""Dequantize chosen rows of a Q4_0 or Q8_0 tensor held as its raw blocks, so a sparse FFN expands only the
neurons it uses.

Block layouts (ggml): Q4_0 = f16 scale d, then 16 bytes whose low nibbles are weights 0-15 and high nibbles
weights 16-31, each weight = d * (nibble - 8); Q8_0 = f16 scale d, then 32 int8, each weight = d * q. The
arithmetic is float32 as in the gguf package, so the rows come out bit-identical to its dequantization.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QUANTIZED_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)
# Whole-matrix products expand this many bytes of rows at a time, so the float copy stays a bounded transient
# (inside the planner's scratch reserve on a GPU) instead of the size of the matrix.
EXPAND_CHUNK_BYTES = 16 << 20


def expand_chunk_rows(cols: int, element_size: int) -> int:
    """Rows of `cols` values of `element_size` bytes that fit one expansion chunk (at least one)."""
    return max(1, EXPAND_CHUNK_BYTES // (cols * element_size))


def _q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    nibbles = blocks[..., 2:]
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).to(torch.int8) - 8
    return blocks[..., :2], q


def _q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return blocks[..., :2], blocks[..., 2:].contiguous().view(torch.int8)


_SPLIT = {GGMLQuantizationType.Q4_0: _q4_0, GGMLQuantizationType.Q8_0: _q8_0}


def dequantize_rows(
    data: torch.Tensor,
    qtype: GGMLQuantizationType,
    rows: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows `rows` (all when None) of `data`, uint8 [R, row_bytes] raw blocks, as `dtype` [len(rows), row_len]."""
    if qtype not in _SPLIT:
        raise ValueError(f"{qtype.name} is not a row-dequantizable type ({', '.join(t.name for t in _SPLIT)})")
    picked = data if rows is None else data.index_select(0, rows.to(data.device))
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = picked.view(picked.shape[0], -1, type_size)
    scale, q = _SPLIT[qtype](blocks)
    d = scale.contiguous().view(torch.float16).float()
    return (d * q.float()).to(dtype).reshape(picked.shape[0], -1)


class QuantizedMatrix:
    """A Q4_0/Q8_0 weight kept as its raw blocks (uint8 [R, row_bytes], or [N, R, row_bytes] for a stack of experts,
    each of which indexing gives); rows are expanded to `dtype` on demand.

    It answers the few tensor questions the runtime asks of a weight (shape, dtype, device, element_size)
    as the dequantized matrix would, so FFN code sizes buffers for the expanded rows it will hold. Moving it
    (`to`) moves the blocks: a device copy stays quantized, as the planner budgets it.
    """

    def __init__(self, blocks: torch.Tensor, qtype: GGMLQuantizationType, dtype: torch.dtype = torch.float32):
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        self.blocks = blocks
        self.qtype = qtype
        self.dtype = dtype
        self.shape = torch.Size((*blocks.shape[:-1], blocks.shape[-1] // type_size * block_size))

    def __getitem__(self, j: int) -> QuantizedMatrix:
        """Matrix j of a stack (a mixture of experts' [N, rows, blocks]): a view of its blocks, not a copy."""
        return self.like(self.blocks[j])

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.blocks, self.qtype, ids, self.dtype)

    def dense(self) -> torch.Tensor:
        return dequantize_rows(self.blocks, self.qtype, None, self.dtype)

    def row_range(self, start: int, end: int) -> torch.Tensor:
        return dequantize_rows(self.blocks[start:end], self.qtype, None, self.dtype)

    def chunk_rows(self) -> int:
        """Rows per expansion chunk (EXPAND_CHUNK_BYTES of expanded rows)."""
        return expand_chunk_rows(self.shape[1], self.element_size())

    @property
    def T(self) -> TransposedQuantized:  # noqa: N802 - mirrors torch.Tensor.T
        return TransposedQuantized(self)

    def like(self, blocks: torch.Tensor) -> QuantizedMatrix:
        """Other blocks of this type and row length (a subset of rows, a device copy, empty slots)."""
        return QuantizedMatrix(blocks, self.qtype, self.dtype)

    def raw_rows(self, ids: torch.Tensor, device: torch.device | str) -> QuantizedMatrix:
        """Rows `ids`, still quantized, on `device` (Q4_0 moves 18 bytes per 32 weights where float32 moves 128)."""
        return self.like(self.blocks.index_select(0, ids.to(self.device)).to(device))

    def to(self, device: torch.device | str) -> QuantizedMatrix:
        return self.like(self.blocks.to(device))


# A weight as the runtime holds it: a float tensor (a view of the mapped file, or a device copy) or raw blocks.
Weight = torch.Tensor | QuantizedMatrix


class TransposedQuantized:
    """The transpose of a quantized matrix, as a dense GGUF's ffn_down [E, F] is read for the down_t [F, E] row
    layout: whole products use the matrix itself; picking its rows (columns of the file's) expands it."""

    def __init__(self, matrix: QuantizedMatrix):
        self.matrix = matrix
        self.shape = torch.Size((matrix.shape[1], matrix.shape[0]))
        self.dtype = matrix.dtype

    @property
    def device(self) -> torch.device:
        return self.matrix.device
