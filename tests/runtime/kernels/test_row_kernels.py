"""The native row kernels: float64-exact up to float32 sums for F16, Q4_0 and Q8_0 rows (strides, tails, gating,
several tokens; quantized rows against the input quantized to Q8_0 blocks, within ggml's documented error of the
float product), the dispatch from the runtime's products, the build, and the fallback without a compiler."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from qinfer.core.architectures import ARCHITECTURES
from qinfer.core.errors import UserError
from qinfer.runtime.ffn import sparse
from qinfer.runtime.ffn.sparse import FFNWeights, dense_ffn, kernel_ffn, selected_rows, sparse_rows
from qinfer.runtime.kernels import quant_rows, row_kernels
from qinfer.runtime.kernels.quant_rows import QuantizedMatrix
from qinfer.runtime.kernels.weight_rows import linear

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler to build the kernel"
)
# Every test here runs on each kernel build: native, AVX2 and plain C (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("kernel_build")


def _half_rows(rows: int, cols: int, stride: int, seed: int) -> torch.Tensor:
    """[rows, cols] f16 rows inside wider storage (row stride `stride`), with subnormal halves and negative zero in
    the last columns, which the kernel converts without vector lanes when cols % 16 != 0."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(rows, stride, generator=g) / cols**0.5).half()
    special = torch.tensor([6e-8, -3e-5, -0.0, 1.5]).half()
    wide[:, cols - 4 : cols] = special * torch.randn(rows, 1, generator=g).sign().half()
    return wide[:, :cols]


def q8_input(x: torch.Tensor) -> torch.Tensor:
    """x [T, n] as the kernels see it against quantized rows, in float64: per block of 32, d = max|x| / 127 and
    round(x / d) (half away from zero, as C's roundf), all in float32 as the kernel computes them."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = (blocks * torch.where(d != 0, 1 / d, 0)).double()
    q = scaled.sign() * (scaled.abs() + 0.5).floor()
    return (q * d.double()).reshape(x.shape)


Weights = torch.Tensor | QuantizedMatrix | None


def _input(x: torch.Tensor, weight: Weights) -> torch.Tensor:
    return q8_input(x) if isinstance(weight, QuantizedMatrix) else x.double()


def _activations(variant: str, x: torch.Tensor, gate: Weights, up: Weights, ids: torch.Tensor) -> torch.Tensor:
    """Per-neuron activations [T, len(ids)] of neurons ids, in float64."""
    assert up is not None
    u = _input(x, up) @ _float(up)[ids].double().T
    if variant == "falcon":
        return torch.relu(u)
    assert gate is not None
    g = torch.relu(_input(x, gate) @ _float(gate)[ids].double().T)
    return g * (torch.relu(u) if variant == "bamboo" else u)


def _reference(variant: str, x: torch.Tensor, gate: Weights, up: Weights, down_t: Weights,
               ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
    assert down_t is not None
    return _activations(variant, x, gate, up, ids) @ _float(down_t)[ids].double()


@needs_compiler
@pytest.mark.parametrize("variant", ["llama", "bamboo", "falcon"])
@pytest.mark.parametrize("cols", [100, 256])
def test_kernel_matches_float64(variant: str, cols: int) -> None:
    rows = 57
    gate = None if variant == "falcon" else _half_rows(rows, cols, cols + 28, 0)
    up, down_t = _half_rows(rows, cols, cols + 12, 1), _half_rows(rows, cols, cols, 2)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([0, 3, 4, 9, 10, 11, 20, 33, 41, 42, 56])
    out = row_kernels.sparse_ffn(ARCHITECTURES[variant].ffn, x, gate, up, down_t, ids)
    assert out is not None
    ref = _reference(variant, x, gate, up, down_t, ids)
    assert out.shape == (1, cols) and out.dtype == torch.float32
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    # Neurons whose gate does not fire are skipped, not approximated: the same ids minus them give the same sum.
    if gate is not None:
        firing = ids[(x @ gate[ids].float().T)[0] > 0]
        assert 0 < firing.numel() < ids.numel()
        assert torch.equal(row_kernels.sparse_ffn(ARCHITECTURES[variant].ffn, x, gate, up, down_t, firing), out)


@needs_compiler
def test_subnormal_halves_convert_exactly() -> None:
    """Every weight sits in the columns past the last vector lane and is a subnormal half, so the output depends
    only on the kernel's scalar conversion; x is large there to lift the products far above float32 rounding."""
    g = torch.Generator().manual_seed(5)

    def subnormal_rows(rows: int) -> torch.Tensor:
        bits = torch.randint(1, 1024, (rows, 4), generator=g) | (torch.randint(0, 2, (rows, 4), generator=g) << 15)
        w = torch.zeros(rows, 100, dtype=torch.float16)
        w[:, 96:] = bits.to(torch.int16).view(torch.float16)
        return w

    gate, up, down_t = subnormal_rows(30), subnormal_rows(30), subnormal_rows(30)
    x = torch.zeros(1, 100)
    x[0, 96:] = torch.tensor([3e6, -2e6, 4e6, 1e6])
    ids = torch.arange(30)
    ref = _reference("bamboo", x, gate, up, down_t, ids)
    assert ref.abs().max() > 0
    out = row_kernels.sparse_ffn(ARCHITECTURES["bamboo"].ffn, x, gate, up, down_t, ids)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def _quantized(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int) -> QuantizedMatrix:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) / cols**0.5
    return QuantizedMatrix(torch.from_numpy(quants.quantize(w, qtype)), qtype)


def _float(t: torch.Tensor | QuantizedMatrix) -> torch.Tensor:
    """The weights as the gguf package dequantizes them (the values the kernels must use)."""
    return t.dense() if isinstance(t, QuantizedMatrix) else t.float()


Q4, Q8 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0


@needs_compiler
@pytest.mark.parametrize(("gate_type", "up_type", "down_type"), [(Q4, Q4, Q4), (Q8, Q8, Q8), (None, Q4, Q8)])
@pytest.mark.parametrize("variant", ["llama", "falcon"])
def test_quantized_rows_match_float64(gate_type: object, up_type: object, down_type: object, variant: str) -> None:
    """96 columns are three blocks, split between the threads' output slices at a block edge; None is F16."""
    rows, cols = 45, 96

    def weight(qtype: object, seed: int) -> torch.Tensor | QuantizedMatrix:
        return _half_rows(rows, cols, cols, seed) if qtype is None else _quantized(rows, cols, qtype, seed)  # type: ignore[arg-type]

    gate = None if variant == "falcon" else weight(gate_type, 0)
    up, down_t = weight(up_type, 1), weight(down_type, 2)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(6))
    ids = torch.tensor([0, 2, 3, 17, 18, 30, 44])
    out = row_kernels.sparse_ffn(ARCHITECTURES[variant].ffn, x, gate, up, down_t, ids)
    assert out is not None
    ref = _reference(variant, x, gate, up, down_t, ids)
    assert ref.abs().max() > 0
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@needs_compiler
@pytest.mark.parametrize("qtype", [Q4, Q8])
@pytest.mark.parametrize("tokens", [1, 3])
def test_quantized_matvec_matches_float64(qtype: GGMLQuantizationType, tokens: int) -> None:
    w = _quantized(45, 320, qtype, 7)
    x = torch.randn(tokens, 320, generator=torch.Generator().manual_seed(8))
    out = row_kernels.matvec(x, w)
    assert out is not None and out.shape == (tokens, 45)
    ref = q8_input(x) @ w.dense().double().T
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def _ggml_test_data(n: int, offset: float) -> np.ndarray:
    """ggml's test-quantize-fns input: 0.1 + 2 cos(i + offset)."""
    return (0.1 + 2 * np.cos(np.arange(n) + offset)).astype(np.float32)


@needs_compiler
@pytest.mark.parametrize("qtype", [Q4, Q8])
def test_quantized_dot_within_ggmls_documented_error(qtype: GGMLQuantizationType) -> None:
    """ggml's test-quantize-fns allows a quantized dot product (weights quantized, input quantized to Q8_0) to be
    off from the float dot of the unquantized vectors by 0.02 per element, on its own test data (rows of 4096
    columns, 32 x 128, its test size)."""
    n = 32 * 128
    w = np.stack([_ggml_test_data(n, 0.0), _ggml_test_data(n, 0.5)])
    x = torch.from_numpy(np.stack([_ggml_test_data(n, 1.0)]))
    out = row_kernels.matvec(x, QuantizedMatrix(torch.from_numpy(quants.quantize(w, qtype)), qtype))
    assert out is not None
    exact = x.double() @ torch.from_numpy(w).double().T
    assert ((out.double() - exact).abs() / n).max() <= 0.02


@needs_compiler
@pytest.mark.parametrize("qtype", [None, Q4, Q8])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("cols", [96, 8224])
def test_weighted_rows_match_float64_and_skip_idle_rows(qtype: object, tokens: int, cols: int) -> None:
    """The down product of a prompt's dense FFN: all rows, or picked ones; a row no token uses is never read (here
    it holds infinities, which would turn the sum into NaN). Each thread sums a slice of the columns, AVX-512 Q4_0
    four blocks at a time and then block by block: at 8224 columns (257 blocks) a slice has both."""
    rows = 45
    w = _half_rows(rows, cols, cols, 14) if qtype is None else _quantized(rows, cols, qtype, 14)  # type: ignore[arg-type]
    act = torch.relu(torch.randn(tokens, rows, generator=torch.Generator().manual_seed(15)))
    act[:, 7] = 0.0
    if qtype is None:
        w[7] = float("inf")
    else:
        w.blocks[7, :2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # an infinite f16 scale
    for ids in (None, torch.tensor([0, 3, 7, 8, 44])):
        picked = torch.arange(rows) if ids is None else ids
        out = row_kernels.weighted_rows(act[:, picked], w, ids)
        assert out is not None and out.shape == (tokens, cols) and torch.isfinite(out).all()
        used = picked[picked != 7]
        ref = act[:, used].double() @ _float(w)[used].double()
        assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_linear_on_quantized_rows_expands_only_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU a product over quantized rows takes the kernel for any number of tokens, a prompt included (40
    tokens: the blocked integer product, or on AVX-512 VNNI the sixteen-row kernel); without the kernel
    (QINFER_NATIVE=0) it expands 7 rows at a time, never the whole matrix."""
    w = _quantized(45, 64, Q4, 9)
    expanded: list[int] = []
    real = QuantizedMatrix.row_range

    def counting(self: QuantizedMatrix, start: int, end: int) -> torch.Tensor:
        expanded.append(end - start)
        return real(self, start, end)

    monkeypatch.setattr(QuantizedMatrix, "row_range", counting)
    monkeypatch.setattr(quant_rows, "EXPAND_CHUNK_BYTES", 7 * 64 * 4)
    prompt = torch.randn(40, 64, generator=torch.Generator().manual_seed(10))
    native = row_kernels.kernel() is not None
    ref = (q8_input(prompt) if native else prompt.double()) @ w.dense().double().T
    assert (linear(prompt, w).double() - ref).abs().max() < 1e-5
    assert expanded == ([] if native else [7] * 6 + [3])
    monkeypatch.setenv("QINFER_NATIVE", "0")
    expanded.clear()
    assert (linear(prompt, w).double() - prompt.double() @ w.dense().double().T).abs().max() < 1e-5
    assert expanded == [7] * 6 + [3]


@needs_compiler
@pytest.mark.parametrize("qtype", [None, Q4, Q8])
@pytest.mark.parametrize("tokens", [15, 40])
def test_products_over_many_tokens_match_float64(kernel_build: str, qtype: object, tokens: int) -> None:
    """Prompts: tokens go in blocks of 16, each row unpacked once per tile of them (F16 in tiles of 8, 4, 2 and 1,
    or the blocked product; Q4_0 in tiles of 4, 2 and 1 over groups of eight blocks, here 320 columns: one group and
    a tail of two blocks; quantized rows past 16 tokens in the blocked integer product, or on AVX-512 VNNI below 24
    in the sixteen-row kernel)."""
    cols = 320
    w = _half_rows(33, cols, cols, 21) if qtype is None else _quantized(33, cols, qtype, 21)  # type: ignore[arg-type]
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(22))
    out = row_kernels.matvec(x, w)
    if qtype is None and kernel_build == "scalar" and tokens > row_kernels.TOKEN_BLOCK:
        assert out is None  # without SIMD, torch's float32 matmul takes long F16 prompts
        return
    assert out is not None and out.shape == (tokens, 33)
    ref = _input(x, w) @ _float(w).double().T
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@needs_compiler
@pytest.mark.parametrize("cols", [20, 32, 48, 64, 80, 100])
def test_short_f16_rows_match_float64(cols: int) -> None:
    """One token against F16 rows as short as an attention head's (the cache's rows take the same dot product):
    below, at and past four vectors, a vector at a time and then lane by lane, with subnormal halves in the last
    columns."""
    w = _half_rows(9, cols, cols, 29)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(30))
    out = row_kernels.matvec(x, w)
    assert out is not None and out.shape == (1, 9)
    ref = x.double() @ w.double().T
    assert (out.double() - ref).abs().max() <= 1e-6 * ref.abs().max()


@needs_compiler
@pytest.mark.parametrize("rows", [4, 11])
def test_one_token_f16_rows_read_together_sum_as_each_row_alone(rows: int) -> None:
    """A one-token F16 product reads its rows four at a time (two under AVX2): each row's sum is the one it gets
    alone, bit for bit, and float64's up to float32 sums. 11 rows leave three (one under AVX2) to the one-row
    kernel; 1004 columns pass the four-vector loop, then go a vector at a time, then lane by lane, under both
    vector widths."""
    w = _half_rows(rows, 1004, 1040, 31)
    x = torch.randn(1, 1004, generator=torch.Generator().manual_seed(32))
    out = row_kernels.matvec(x, w)
    alone = [row_kernels.matvec(x, w[r : r + 1]) for r in range(rows)]
    assert out is not None and all(row is not None for row in alone)
    assert torch.equal(out, torch.cat(alone, dim=1))  # type: ignore[arg-type]
    ref = x.double() @ w.double().T
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@needs_compiler
@pytest.mark.parametrize("qtype", [Q4, Q8])
@pytest.mark.parametrize(
    ("tokens", "cols"), [(11, 8224), (17, 96), (27, 96), (49, 96), (17, 8224), (57, 8224), (130, 8224)]
)
def test_the_blocked_quantized_product_matches_float64(kernel_build: str, qtype: GGMLQuantizationType, tokens: int,
                                                       cols: int) -> None:  # fmt: skip
    """Quantized rows against more than 16 tokens go through the blocked integer product (from 24 under AVX-512
    VNNI, from 10 in AMX's tile unit), exact to float32 sums of the same integer block products (AVX2's Q4_0 tile
    takes the weights' offset off the scaled sums, within the same bound): 37 rows (off every row tile), token
    counts off every token tile (11: under AMX one tile of its tile unit, the last input repeated; elsewhere the
    row kernels), 3 blocks and 257 (past several chunks of columns, by one block), and at 8224 columns 130 tokens,
    more than one token block (those whose inputs fill 1 MiB)."""
    w = _quantized(37, cols, qtype, 25)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(26))
    out = row_kernels.matvec(x, w)
    assert out is not None and out.shape == (tokens, 37)
    ref = q8_input(x) @ w.dense().double().T
    assert (out.double() - ref).abs().max() <= 2e-6 * ref.abs().max()


@needs_compiler
@pytest.mark.parametrize("qtype", [Q4, Q8])
@pytest.mark.parametrize("tokens", [1, 2, 5, 15, 16, 23])
@pytest.mark.parametrize(("rows", "cols"), [(37, 96), (16, 8224), (3, 64)])
def test_quantized_rows_sixteen_at_a_time_match_float64(kernel_build: str, qtype: GGMLQuantizationType, tokens: int,
                                                        rows: int, cols: int) -> None:  # fmt: skip
    """Quantized rows against fewer than 24 tokens (more, or with AMX from 10, go to the blocked product), which
    AVX-512 VNNI takes sixteen rows at a time (each block transposed in registers, a lane per row) and the other
    builds row by row: exact to float32 sums of the same integer block products, for token counts
    that use every token tile (16, 8, 4, 2, 1) and row counts that leave a partial row tile, fill one exactly, or
    stay under one."""
    w = _quantized(rows, cols, qtype, 27)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(28))
    out = row_kernels.matvec(x, w)
    assert out is not None and out.shape == (tokens, rows)
    ref = q8_input(x) @ w.dense().double().T
    assert (out.double() - ref).abs().max() <= 2e-6 * ref.abs().max()


@needs_compiler
@pytest.mark.parametrize("tokens", [1, 20])
def test_inputs_quantize_as_roundf(tokens: int) -> None:
    """The input's Q8_0 bytes are roundf's, halves away from zero, in the vector quantizer too: against rows that
    each pick one column (Q8_0, scale 1), an input block whose largest value is 127 (scale 1) comes back as its
    rounded values, for one token and for a prompt (the blocked product)."""
    values = torch.tensor([127, 2.5, -2.5, 3.5, -0.5, 0.5, 1.4999999, -126.5, 0.49999997, 7, -7.5, 0] + [0.25] * 20)
    identity = torch.zeros(32, 34, dtype=torch.uint8)
    identity[:, :2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # f16 1.0, little-endian
    identity[torch.arange(32), 2 + torch.arange(32)] = 1
    x = values.repeat(tokens, 1)
    out = row_kernels.matvec(x, QuantizedMatrix(identity, Q8))
    assert out is not None
    exact = values.double()  # 0.49999997 + 0.5 is 1 in float32
    assert torch.equal(out, (exact.sign() * (exact.abs() + 0.5).floor()).float().repeat(tokens, 1))


@needs_compiler
@pytest.mark.parametrize("rows", [13, 101])
@pytest.mark.parametrize("cols", [100, 4100, 8200])
@pytest.mark.parametrize("tokens", [3, 4, 7, 40, 53])
def test_the_blocked_f16_product_matches_float64(kernel_build: str, tokens: int, cols: int, rows: int) -> None:
    """F16 rows against many tokens go through the blocked product (tiles of rows by tokens, from 3 tokens under
    AVX2 and 4 under AVX-512, rows in blocks of up to 48, columns 4096 at a time, or 2048 from 48 tokens), whose
    edges repeat a row or a token: row counts off the tile within one block and past two, token counts off the
    tile, columns off the vector width and past one, two or four blocks of columns. A build without SIMD leaves
    more than a block of tokens to torch."""
    w = _half_rows(rows, cols, cols + 8, 23)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(24))
    out = row_kernels.matvec(x, w)
    if kernel_build == "scalar" and tokens > row_kernels.TOKEN_BLOCK:
        assert out is None
        return
    assert out is not None and out.shape == (tokens, rows)
    ref = x.double() @ w.double().T
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@needs_compiler
@pytest.mark.parametrize("qtype", [None, Q4, Q8])
@pytest.mark.parametrize("variant", ["llama", "bamboo", "falcon"])
@pytest.mark.parametrize(("tokens", "neurons"), [(17, "every"), (70, "every"), (40, "few"), (81, "most")])
def test_a_prompts_neurons_in_the_kernel_match_float64(
    qtype: object, variant: str, tokens: int, neurons: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's FFN over a PowerInfer file's rows, over every neuron (dense_ffn) or a scattered subset (the split's
    CPU part). The first rows' products (a ReLU gate's, or up's without a gate) go first, for every token in one
    matrix product, over a few neurons' rows alone or over all rows, and reach the kernel with chunks of up to 64
    tokens (one of 17, 40 or 64, and a last one of 6 or 17), which computes only the rest of the neurons they
    fire."""
    rows, cols = 45, 96
    products: list[tuple[int, int]] = []
    given: list[bool] = []

    def counted(x: torch.Tensor, weight: torch.Tensor | QuantizedMatrix) -> torch.Tensor:
        products.append((x.shape[0], weight.shape[0]))
        return sparse_linear(x, weight)

    def kernel(*args: object, first: torch.Tensor | None = None) -> torch.Tensor | None:
        given.append(first is not None)
        return sparse_ffn(*args, first=first)  # type: ignore[arg-type]

    sparse_linear, sparse_ffn = sparse.linear, row_kernels.sparse_ffn
    monkeypatch.setattr(sparse, "linear", counted)
    monkeypatch.setattr(row_kernels, "sparse_ffn", kernel)

    def weight(seed: int) -> torch.Tensor | QuantizedMatrix:
        return _half_rows(rows, cols, cols, seed) if qtype is None else _quantized(rows, cols, qtype, seed)  # type: ignore[arg-type]

    form = ARCHITECTURES[variant].ffn
    gate = None if variant == "falcon" else weight(0)
    w = FFNWeights(form=form, up=weight(1), down_t=weight(2), gate=gate)  # type: ignore[arg-type]
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(23))
    few = torch.tensor([0, 3, 4, 10, 22, 23, 31, 44])
    every = torch.arange(rows)
    ids = {"every": every, "few": few, "most": every[~torch.isin(every, few)]}[neurons]
    out = dense_ffn(w, x) if neurons == "every" else kernel_ffn(w, x, ids)
    ref = _reference(variant, x, gate, w.up, w.down_t, ids)
    assert out is not None and out.shape == (tokens, cols)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert products == [(tokens, len(few) if neurons == "few" else rows)]
    assert given == [True] * -(-tokens // row_kernels.GIVEN_TOKENS)


@needs_compiler
def test_first_products_come_one_per_token_and_neuron_without_a_mask() -> None:
    """The kernel reads `first` as [tokens, neurons] scratch that it writes over: any other shape, or a mask beside
    it, is refused before the kernel runs."""
    rows, cols, tokens = 45, 96, 4
    gate, up, down_t = (_half_rows(rows, cols, cols, seed) for seed in range(3))
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(3))
    ids = torch.arange(0, rows, 3)
    form = ARCHITECTURES["llama"].ffn
    first = x @ gate[ids].float().T
    out = row_kernels.sparse_ffn(form, x, gate, up, down_t, ids, first=first)
    ref = _reference("llama", x, gate, up, down_t, ids)
    assert out is not None and (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(first, x @ gate[ids].float().T)  # the caller's products stay as they were
    with pytest.raises(ValueError, match="without a mask"):
        row_kernels.sparse_ffn(form, x, gate, up, down_t, ids, first=first[:, 1:])
    with pytest.raises(ValueError, match="without a mask"):
        row_kernels.sparse_ffn(form, x, gate, up, down_t, ids, torch.ones(tokens, ids.numel(), dtype=torch.bool), first)


@needs_compiler
@pytest.mark.parametrize("qtype", [None, Q4])
@pytest.mark.parametrize("variant", ["llama", "bamboo"])
def test_several_tokens_each_with_their_own_neurons(qtype: object, variant: str) -> None:
    """A decode batch: each token sums only the neurons its mask row keeps (one row picks none at all)."""
    rows, cols, tokens = 45, 96, 4

    def weight(seed: int) -> torch.Tensor | QuantizedMatrix:
        return _half_rows(rows, cols, cols, seed) if qtype is None else _quantized(rows, cols, qtype, seed)  # type: ignore[arg-type]

    gate, up, down_t = weight(0), weight(1), weight(2)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(11))
    ids = torch.arange(0, rows, 2)
    fires = _activations(variant, x, gate, up, ids) != 0
    # Tokens 0, 1 and 3 each drop some of their firing neurons and keep others; token 2 keeps none.
    mask = torch.ones(tokens, ids.numel(), dtype=torch.bool)
    mask[2] = False
    for t in (0, 1, 3):
        firing = torch.nonzero(fires[t]).flatten()
        assert firing.numel() >= 2
        mask[t, firing[t % 2 :: 2]] = False
    out = row_kernels.sparse_ffn(ARCHITECTURES[variant].ffn, x, gate, up, down_t, ids, mask)
    assert out is not None and out.shape == (tokens, cols)
    assert not out[2].any()
    for t in (0, 1, 3):
        ref = _reference(variant, x[t : t + 1], gate, up, down_t, ids[mask[t]])
        assert (out[t].double() - ref[0]).abs().max() <= 1e-5 * ref.abs().max()


@needs_compiler
@pytest.mark.parametrize("qtype", [None, Q4])
@pytest.mark.parametrize("variant", ["llama", "bamboo", "falcon"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_selected_neurons_less_the_skipped_match_float64(qtype: object, variant: str, tokens: int) -> None:
    """A split's host part: the kernel lists the neurons some token selects and the device does not hold, each token
    summing only its own (one token selects none), and counts what it computed and what it skipped."""
    rows, cols = 45, 96

    def weight(seed: int) -> torch.Tensor | QuantizedMatrix:
        return _half_rows(rows, cols, cols, seed) if qtype is None else _quantized(rows, cols, qtype, seed)  # type: ignore[arg-type]

    gate, up, down_t = weight(0), weight(1), weight(2)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, cols, generator=g)
    selected = torch.rand(tokens, rows, generator=g) < 0.4
    selected[-1] = tokens == 1  # a batch's last token selects nothing; one token alone selects every neuron
    skip = torch.rand(rows, generator=g) < 0.3
    form, first = ARCHITECTURES[variant].ffn, None if variant == "falcon" else gate
    done = row_kernels.selected_ffn(form, x, first, up, down_t, selected, skip)
    assert done is not None
    out, computed, skipped = done
    listed = selected.any(0)
    assert (computed, skipped) == (int((listed & ~skip).sum()), int((listed & skip).sum()))
    assert computed > 0 and skipped > 0
    for t in range(tokens):
        ids = torch.nonzero(selected[t] & ~skip).flatten()
        if ids.numel() == 0:
            assert not out[t].any()
            continue
        ref = _reference(variant, x[t : t + 1], gate, up, down_t, ids)
        assert (out[t].double() - ref[0]).abs().max() <= 1e-5 * ref.abs().max()
    # Without the kernel, torch's path computes the same neurons and counts.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QINFER_NATIVE", "0")
        assert row_kernels.selected_ffn(form, x, first, up, down_t, selected, skip) is None
        fallback, *counts = selected_rows(form, x, first, up, down_t, selected, skip)
    assert counts == [computed, skipped]
    assert torch.allclose(fallback, out, rtol=2e-2, atol=2e-2 * float(out.abs().max()))
    # Every selected neuron held elsewhere (a decode step the GPU covers): nothing computed, all of it counted.
    done = row_kernels.selected_ffn(form, x, first, up, down_t, selected, selected.any(0))
    assert done is not None and not done[0].any() and done[1:] == (0, int(selected.any(0).sum()))


@needs_compiler
def test_selected_neurons_past_the_rows_are_refused() -> None:
    """A selection wider than the rows (a plan or file that does not match the model) reads nothing."""
    gate, up, down_t = (_half_rows(64, 96, 96, seed) for seed in range(3))
    selected = torch.zeros(1, 80, dtype=torch.bool)
    selected[0, 70] = True
    with pytest.raises(UserError, match="corrupt"):
        row_kernels.selected_ffn(ARCHITECTURES["llama"].ffn, torch.randn(1, 96), gate, up, down_t, selected, None)


@needs_compiler
def test_sparse_rows_takes_the_kernel_for_f16_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    gate, up, down_t = (_half_rows(40, 64, 64, s) for s in range(3))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    ids = torch.arange(0, 40, 3)
    mask = torch.rand(2, ids.numel(), generator=torch.Generator().manual_seed(13)) < 0.5
    taken: list[bool] = []
    real = row_kernels.sparse_ffn

    def recording(*args: object) -> torch.Tensor | None:
        out = real(*args)  # type: ignore[arg-type]
        taken.append(out is not None)
        return out

    monkeypatch.setattr(row_kernels, "sparse_ffn", recording)
    one = sparse_rows(ARCHITECTURES["llama"].ffn, x[:1], gate, up, down_t, ids, None)
    batch = sparse_rows(ARCHITECTURES["llama"].ffn, x, gate, up, down_t, ids, mask)
    sparse_rows(ARCHITECTURES["llama"].ffn, x[:1], gate.float(), up.float(), down_t.float(), ids, None)
    monkeypatch.setenv("QINFER_NATIVE", "0")
    torch_one = sparse_rows(ARCHITECTURES["llama"].ffn, x[:1], gate, up, down_t, ids, None)
    torch_batch = sparse_rows(ARCHITECTURES["llama"].ffn, x, gate, up, down_t, ids, mask)
    # F16 tokens, alone or masked in a batch: kernel; float32 rows and QINFER_NATIVE=0 stay on torch.
    assert taken == [True, True, False, False, False]
    assert torch.allclose(one, torch_one, rtol=2e-3, atol=5e-3)  # the torch path rounds to f16
    assert torch.allclose(batch, torch_batch, rtol=2e-3, atol=5e-3)


@needs_compiler
@pytest.mark.parametrize("crafted", ["up has one row", "gate is narrower", "down_t has one row", "negative id"])
def test_shapes_that_do_not_fit_are_refused_before_anything_is_read(crafted: str) -> None:
    """A header can claim any shape: a kernel given rows or columns that its ids and input do not fit reads nothing
    and the runtime says the file is corrupt, instead of reading past the tensor."""
    llama = ARCHITECTURES["llama"].ffn
    gate, up, down_t = (_half_rows(64, 96, 96, seed) for seed in range(3))
    ids, x = torch.tensor([0, 5, 63]), torch.randn(1, 96)
    if crafted == "up has one row":
        up = up[:1]
    elif crafted == "gate is narrower":
        gate = gate[:, :64]
    elif crafted == "down_t has one row":
        down_t = down_t[:1]
    else:
        ids = torch.tensor([0, -1])
    with pytest.raises(UserError, match="corrupt"):
        row_kernels.sparse_ffn(llama, x, gate, up, down_t, ids)


@needs_compiler
def test_weighted_rows_and_matvec_check_their_rows() -> None:
    w = _half_rows(8, 64, 64, 0)
    with pytest.raises(UserError, match="corrupt"):
        row_kernels.weighted_rows(torch.ones(1, 2), w, torch.tensor([3, 8]))
    with pytest.raises(UserError, match="corrupt"):
        row_kernels.weighted_rows(torch.ones(1, 9), w)  # nine rows of act for eight rows of weights
    blocks = torch.from_numpy(quants.quantize(np.ones((4, 64), dtype=np.float32), GGMLQuantizationType.Q8_0))
    narrow = QuantizedMatrix(blocks, GGMLQuantizationType.Q8_0)
    with pytest.raises(UserError, match="corrupt"):
        row_kernels.matvec(torch.ones(1, 96), narrow)  # an input wider than the rows
    assert row_kernels.matvec(torch.ones(1, 64), narrow) is not None
