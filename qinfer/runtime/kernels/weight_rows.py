"""The one place where the runtime reads weights: whole matrices for matmuls, and rows (neurons) by id.

Weights are torch tensors in the file's dtype (F32/F16 views of the mapped GGUF, or device copies of them),
or quantized matrices whose rows are expanded only when gathered. Every product returns float32: on the CPU, F16
and quantized rows go through the native kernels (row_kernels: float32 sums, or integer products against the
input quantized to Q8_0), a decode step's Q4_0 rows on a GPU through a Triton kernel (hot_ffn.matvec), elsewhere
the product runs in the weight's (expanded) dtype.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from qinfer.runtime.kernels import row_kernels
from qinfer.runtime.kernels.quant_rows import QuantizedMatrix, TransposedQuantized, expand_chunk_rows

# Up to this many tokens a weighted row sum runs as an embedding bag, which reads each selected row once and
# needs no copy; beyond it a matmul on gathered float32 rows wins.
BAG_MAX_TOKENS = 16
# Up to this many tokens a Q4_0 matrix on a GPU is read by the row kernel (hot_ffn.matvec); a prompt's many tokens
# amortise expanding it for torch's matmul.
GPU_ROW_TOKENS = 16
_scratch = threading.local()


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedMatrix) -> torch.Tensor:
    """x @ weight.T in the weight's dtype, as float32 (F16 rows in the native kernel take x in float32)."""
    if (out := row_kernels.matvec(x, weight)) is not None:
        return out
    if isinstance(weight, QuantizedMatrix):
        if weight.device.type == "cuda" and weight.qtype == GGMLQuantizationType.Q4_0 and x.shape[0] <= GPU_ROW_TOKENS:
            # Triton ships with CUDA builds of torch: the blocks are read once, never expanded.
            from qinfer.runtime.kernels.hot_ffn import matvec

            return matvec(x, weight)
        return _expanded_linear(x, weight.row_range, weight.shape[0], weight.chunk_rows())
    if weight.dtype == torch.float16 and weight.device.type == "cpu":
        # CPUs without half-precision arithmetic run torch's f16 matmul at a third of its float32 speed.
        step = expand_chunk_rows(weight.shape[1], 4)
        return _expanded_linear(x, lambda start, end: weight[start:end].float(), weight.shape[0], step)
    return F.linear(x.to(weight.dtype), weight).float()


def row_slice(weight: torch.Tensor | QuantizedMatrix, start: int, rows: int) -> torch.Tensor | QuantizedMatrix:
    """Rows start..start+rows of a weight, as a view that keeps its type (a fused matrix's parts)."""
    if isinstance(weight, QuantizedMatrix):
        return QuantizedMatrix(weight.blocks[start : start + rows], weight.qtype, weight.dtype)
    return weight[start : start + rows]


def _expanded_linear(
    x: torch.Tensor, row_range: Callable[[int, int], torch.Tensor], rows: int, step: int
) -> torch.Tensor:
    """x @ weight.T over `step` rows at a time, each chunk expanded to a float copy (prompts, and quantized
    matrices on a GPU), so the copy stays a bounded transient."""
    out = torch.empty(x.shape[0], rows, device=x.device)
    for start in range(0, rows, step):
        chunk = row_range(start, min(start + step, rows))
        out[:, start : start + chunk.shape[0]] = F.linear(x.to(chunk.dtype), chunk).float()
    return out


def gather_rows(weight: torch.Tensor | QuantizedMatrix, ids: torch.Tensor, scratch: str | None = None) -> torch.Tensor:
    """Rows `ids` of `weight` ([F, E] with row i = neuron i) as a dense [len(ids), E] tensor on the weight's device.

    With `scratch`, a CPU result lands in this thread's reusable buffer of that name and stays valid only until
    the next call with the same name: a fresh multi-megabyte allocation per step costs page faults that can
    take longer than the copy itself.
    """
    if isinstance(weight, QuantizedMatrix):
        return weight.rows(ids)
    ids = ids.to(weight.device)
    if scratch is None or weight.device.type != "cpu":
        return torch.index_select(weight, 0, ids)
    buffers: dict[tuple[str, torch.dtype, int, bool], torch.Tensor] = _scratch.__dict__.setdefault("buffers", {})
    # A buffer made under inference mode cannot be written outside it (and the other way round).
    key = (scratch, weight.dtype, weight.shape[1], torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.shape[0] < ids.numel():
        grown = max(ids.numel(), 2 * (0 if buf is None else buf.shape[0]))
        buf = buffers[key] = torch.empty(grown, weight.shape[1], dtype=weight.dtype)
    return torch.index_select(weight, 0, ids, out=buf[: ids.numel()])


def rows_to(weight: torch.Tensor, ids: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of rows `ids` on `device`, in the stored dtype (GPU residency and rows shipped per step)."""
    return gather_rows(weight, ids).to(device)


def weighted_row_sum(
    act: torch.Tensor, weight: torch.Tensor | QuantizedMatrix | TransposedQuantized, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """sum_j act[t, j] * weight[ids[j]] for each token t, as float32 [T, E]; ids None means all rows.

    This is the down projection in the PowerInfer row layout (down_t [F, E]). A dense GGUF's down_t is the
    transposed view of a contiguous [E, F] matrix, where a plain linear is fastest. Row-major [F, E] with a
    vector on the left is a slow path for CPU half-precision matmuls, so few tokens go through an embedding bag.
    """
    if isinstance(weight, TransposedQuantized):
        if ids is None:
            return linear(act, weight.matrix)
        # Rows of the transpose are columns of the stored blocks: only an oracle check of a dense file gets here.
        weight = weight.matrix.dense().T
    if (out := row_kernels.weighted_rows(act, weight, ids)) is not None:
        return out
    if isinstance(weight, QuantizedMatrix):
        weight = weight.dense() if ids is None else weight.rows(ids)
        return act.to(weight.dtype).matmul(weight).float()
    if ids is None and weight.T.is_contiguous():
        return linear(act, weight.T)
    if weight.device.type != "cpu" or weight.T.is_contiguous():
        rows = weight if ids is None else gather_rows(weight, ids)
        return act.to(rows.dtype).matmul(rows).float()
    n, k = act.shape
    row_ids = torch.arange(weight.shape[0]) if ids is None else ids
    if n <= BAG_MAX_TOKENS:
        offsets = torch.arange(0, n * k, k)
        out = F.embedding_bag(
            row_ids.repeat(n), weight, offsets, mode="sum", per_sample_weights=act.reshape(-1).to(weight.dtype)
        )
        return out.float()
    rows = weight if ids is None else gather_rows(weight, ids)
    return act.matmul(rows.float())
