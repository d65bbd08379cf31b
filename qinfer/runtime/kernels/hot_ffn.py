"""The GPU's share of a sparse FFN, as two Triton kernels over the rows resident in its slots, with the selection
made inside the kernels: no list of active neurons is built, and no row that no token selects is read.

`activate` gives act[t, s] for each token t and slot s: act(gate . x) * up . x (or relu(up . x) for the ungated
form), zero where slot s is not selected for token t. A slot holds neuron `slot_neuron[s]` (-1: empty). What selects:
- the predictor's scores [T, F] at each slot's neuron, over `threshold` (`>=`, as qinfer.runtime.ffn.sparse);
- a calibrated model's gate: |act(gate . x)| over `threshold` (`>`), its gate rows read whole and its up rows only
  where selected;
- nothing: every filled slot (a dense FFN over the slots).
`down` then sums act[t, s] * down_t[s] over the slots, reading only the rows some token uses, a group of slots per
program; the groups' partial sums are added in a fixed order, so a step's result does not depend on scheduling.

`matvec` is the plain product x @ w.T over the same row reader, for the dense parts of a Q4_0 file on the GPU at a
decode step's few tokens (torch would expand the whole matrix to floats first).

Rows are float (f16, bf16, f32) or Q4_0 blocks (dequantized in the kernel, so the slots stay at Q4_0 size). Shapes
are fixed by the batch and the slot count, so the kernels can be captured in a CUDA graph. Triton ships with CUDA
builds of torch; on a machine without a GPU the tests run these kernels through Triton's interpreter
(TRITON_INTERPRET=1) against a float64 reference.
"""

from __future__ import annotations

from enum import IntEnum

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from qinfer.core.architectures import FfnForm
from qinfer.runtime.kernels.quant_rows import QuantizedMatrix, Weight

Q4_0_BLOCK, Q4_0_BYTES = 32, 18
ROWS_PER_PROGRAM = 32
# A program holds [tokens, rows, columns] products in registers: larger batches take more programs.
TOKENS_PER_PROGRAM = 8
# Tokens x columns of those products in one program's loop (activate, matvec) or output (down), so that a wider
# token block takes fewer columns at a time: at 8 tokens x 128 columns the kernels spilled (255 registers and 104-320
# bytes of stack, built for sm_90 by triton 3.6 and 3.9 as their launcher specialises them), where 2 x 128, 4 x 64 and
# 8 x 32 take at most 231 registers and no stack (tests/support/hopper_build.py).
PRODUCTS_PER_LOOP = 256
# The down product sums this many slots in one program's loop; the groups' partial sums are added in order, from
# scratch of slots / ROWS_PER_GROUP x tokens x E floats (360 KB for a 7B layer's 11008 slots and one token).
ROWS_PER_GROUP = 512


class Select(IntEnum):
    PREDICTOR = 0
    GATE = 1
    ALL = 2


@triton.jit
def _rows(w_ptr, rows, cols, row_stride, ok, Q4: tl.constexpr):
    """Rows `rows` at columns `cols` of a weight as float32 [R, C]; `ok` masks the loads (no memory is read for a
    masked-off element). Q4_0: an f16 scale, then 16 bytes whose low nibbles are weights 0-15 and high 16-31."""
    if Q4:
        j = cols % 32
        block = rows[:, None] * row_stride + (cols // 32 * 18)[None, :]
        lo = tl.load(w_ptr + block, mask=ok, other=0).to(tl.int32)
        hi = tl.load(w_ptr + block + 1, mask=ok, other=0).to(tl.int32)
        scale = (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        byte = tl.load(w_ptr + block + 2 + (j % 16)[None, :], mask=ok, other=0).to(tl.int32)
        q = (byte >> (j // 16 * 4)[None, :]) & 15
        return (q - 8).to(tl.float32) * scale
    else:
        return tl.load(w_ptr + rows[:, None] * row_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _dots(x_ptr, x_stride, toks, tok_ok, w_ptr, w_stride, rows, need, N_COLS: tl.constexpr, Q4: tl.constexpr,
          BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """x[t] . w[r] for every token and row, reading only rows where `need`."""
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    for start in range(0, N_COLS, BLOCK_E):
        cols = start + tl.arange(0, BLOCK_E)
        col_ok = cols < N_COLS
        x_ok = tok_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + toks[:, None] * x_stride + cols[None, :], mask=x_ok, other=0.0)
        w = _rows(w_ptr, rows, cols, w_stride, need[:, None] & col_ok[None, :], Q4=Q4)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    return acc


@triton.jit
def _activate_kernel(x_ptr, scores_ptr, slot_neuron_ptr, gate_ptr, up_ptr, act_ptr, threshold,
                     n_tok, n_rows, x_stride, scores_stride, w_stride, act_stride, N_COLS: tl.constexpr,
                     SELECT: tl.constexpr, GATED: tl.constexpr, SILU: tl.constexpr, RELU_UP: tl.constexpr,
                     Q4: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_E: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < n_tok
    neuron = tl.load(slot_neuron_ptr + rows, mask=rows < n_rows, other=-1)
    live = neuron >= 0
    chosen = tok_ok[:, None] & live[None, :]
    if SELECT == 0:
        scores = tl.load(scores_ptr + toks[:, None] * scores_stride + neuron[None, :], mask=chosen, other=0.0)
        chosen = chosen & (scores >= threshold)
    if GATED:
        # The gate decides by itself: its rows are read for every filled slot, up's only where it fires.
        gate_need = live if SELECT == 1 else tl.max(chosen.to(tl.int32), axis=0) > 0
        g = _dots(x_ptr, x_stride, toks, tok_ok, gate_ptr, w_stride, rows, gate_need,
                  N_COLS=N_COLS, Q4=Q4, BLOCK_T=BLOCK_T, BLOCK_R=BLOCK_R, BLOCK_E=BLOCK_E)  # fmt: skip
        g = g / (1.0 + tl.exp(-g)) if SILU else tl.maximum(g, 0.0)
        if SELECT == 1:
            chosen = chosen & (tl.abs(g) > threshold)
    need = tl.max(chosen.to(tl.int32), axis=0) > 0
    u = _dots(x_ptr, x_stride, toks, tok_ok, up_ptr, w_stride, rows, need,
              N_COLS=N_COLS, Q4=Q4, BLOCK_T=BLOCK_T, BLOCK_R=BLOCK_R, BLOCK_E=BLOCK_E)  # fmt: skip
    if GATED:
        if RELU_UP:
            u = tl.maximum(u, 0.0)
        act = g * u
    else:
        act = tl.maximum(u, 0.0)
    act = tl.where(chosen, act, 0.0)
    out_ok = tok_ok[:, None] & (rows < n_rows)[None, :]
    tl.store(act_ptr + toks[:, None] * act_stride + rows[None, :], act, mask=out_ok)


@triton.jit
def _down_kernel(act_ptr, down_ptr, partial_ptr, n_tok, n_cols, n_rows, act_stride, w_stride, GROUP_ROWS: tl.constexpr,
                 Q4: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    group = tl.program_id(1)
    toks = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < n_tok
    col_ok = cols < n_cols
    part = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for start in range(0, GROUP_ROWS, BLOCK_R):
        rows = group * GROUP_ROWS + start + tl.arange(0, BLOCK_R)
        act_ok = tok_ok[:, None] & (rows < n_rows)[None, :]
        act = tl.load(act_ptr + toks[:, None] * act_stride + rows[None, :], mask=act_ok, other=0.0)
        need = tl.max((act != 0.0).to(tl.int32), axis=0) > 0
        w = _rows(down_ptr, rows, cols, w_stride, need[:, None] & col_ok[None, :], Q4=Q4)
        part += tl.sum(act[:, :, None] * w[None, :, :], axis=1)
    out = partial_ptr + (group * n_tok + toks[:, None]) * n_cols + cols[None, :]
    tl.store(out, part, mask=tok_ok[:, None] & col_ok[None, :])


@triton.jit
def _matvec_kernel(x_ptr, w_ptr, out_ptr, n_tok, n_rows, x_stride, w_stride, out_stride, N_COLS: tl.constexpr,
                   Q4: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok, row_ok = toks < n_tok, rows < n_rows
    acc = _dots(x_ptr, x_stride, toks, tok_ok, w_ptr, w_stride, rows, row_ok,
                N_COLS=N_COLS, Q4=Q4, BLOCK_T=BLOCK_T, BLOCK_R=BLOCK_R, BLOCK_E=BLOCK_E)  # fmt: skip
    tl.store(out_ptr + toks[:, None] * out_stride + rows[None, :], acc, mask=tok_ok[:, None] & row_ok[None, :])


def _raw(w: Weight) -> tuple[torch.Tensor, int, bool]:
    """The tensor a kernel reads, its row stride (elements; bytes for Q4_0) and whether it is Q4_0."""
    if isinstance(w, QuantizedMatrix):
        if w.qtype != GGMLQuantizationType.Q4_0:
            raise ValueError(f"the GPU's FFN kernels read F16, BF16, F32 and Q4_0 rows, not {w.qtype.name}")
        return w.blocks, w.blocks.stride(0), True
    if w.stride(1) != 1:
        raise ValueError("the GPU's FFN kernels read rows stored contiguously")
    return w, w.stride(0), False


def _token_block(tokens: int) -> int:
    """Tokens per program: a decode batch's, up to TOKENS_PER_PROGRAM; more go to further programs."""
    return min(TOKENS_PER_PROGRAM, max(2, triton.next_power_of_2(tokens)))


def _column_block(block_t: int) -> int:
    """Columns per loop (or per program, for down) of a product over `block_t` tokens (PRODUCTS_PER_LOOP)."""
    return PRODUCTS_PER_LOOP // block_t


def activate(
    form: FfnForm,
    x: torch.Tensor,
    gate: Weight | None,
    up: Weight,
    slot_neuron: torch.Tensor,
    select: Select,
    threshold: float = 0.0,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """act [T, S] (float32) for x [T, E] over the S slots of gate/up [S, E]; see the module notes for `select`."""
    if select == Select.PREDICTOR and scores is None:
        raise ValueError("selecting by the predictor needs its scores")
    if form.gated and gate is None:
        raise ValueError("a gated FFN needs its gate rows")
    up_raw, stride, q4 = _raw(up)
    gate_raw = up_raw
    if gate is not None:
        gate_raw, *layout = _raw(gate)
        if layout != [stride, q4]:
            raise ValueError("the GPU's FFN kernels read gate and up rows of one type and row length")
    tokens, slots = x.shape[0], slot_neuron.shape[0]
    x = x.float().contiguous()
    act = torch.empty(tokens, slots, dtype=torch.float32, device=x.device)
    picks = x if scores is None else scores.float().contiguous()
    block_t = _token_block(tokens)
    _activate_kernel[(triton.cdiv(slots, ROWS_PER_PROGRAM), triton.cdiv(tokens, block_t))](
        x, picks, slot_neuron, gate_raw, up_raw, act, float(threshold), tokens, slots,
        x.stride(0), picks.stride(0), stride, act.stride(0), N_COLS=up.shape[1],
        SELECT=int(select), GATED=form.gated, SILU=form.act == "silu", RELU_UP=form.relu_up, Q4=q4,
        BLOCK_T=block_t, BLOCK_R=ROWS_PER_PROGRAM, BLOCK_E=_column_block(block_t),
    )  # fmt: skip
    return act


def down(act: torch.Tensor, down_t: Weight) -> torch.Tensor:
    """sum over slots s of act[t, s] * down_t[s], as float32 [T, E]."""
    raw, stride, q4 = _raw(down_t)
    tokens, slots = act.shape
    cols = down_t.shape[1]
    groups = triton.cdiv(slots, ROWS_PER_GROUP)
    block_t = _token_block(tokens)
    partial = torch.empty(groups, tokens, cols, dtype=torch.float32, device=act.device)
    block_e = _column_block(block_t)
    _down_kernel[(triton.cdiv(cols, block_e), groups, triton.cdiv(tokens, block_t))](
        act.contiguous(), raw, partial, tokens, cols, slots, act.stride(0), stride, GROUP_ROWS=ROWS_PER_GROUP,
        Q4=q4, BLOCK_T=block_t, BLOCK_R=ROWS_PER_PROGRAM, BLOCK_E=block_e,
    )  # fmt: skip
    return partial.sum(0)


def hot_ffn(
    form: FfnForm,
    x: torch.Tensor,
    gate: Weight | None,
    up: Weight,
    down_t: Weight,
    slot_neuron: torch.Tensor,
    select: Select,
    threshold: float = 0.0,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FFN output [T, E] of the selected neurons among the slots."""
    return down(activate(form, x, gate, up, slot_neuron, select, threshold, scores), down_t)


def matvec(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [T, E] @ w.T as float32 [T, R], for w [R, E] float or Q4_0 rows."""
    raw, stride, q4 = _raw(w)
    tokens, rows = x.shape[0], w.shape[0]
    x = x.float().contiguous()
    out = torch.empty(tokens, rows, dtype=torch.float32, device=x.device)
    block_t = _token_block(tokens)
    _matvec_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM), triton.cdiv(tokens, block_t))](
        x, raw, out, tokens, rows, x.stride(0), stride, out.stride(0), N_COLS=w.shape[1], Q4=q4,
        BLOCK_T=block_t, BLOCK_R=ROWS_PER_PROGRAM, BLOCK_E=_column_block(block_t),
    )  # fmt: skip
    return out
