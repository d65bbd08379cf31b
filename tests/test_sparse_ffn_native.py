"""The native sparse FFN kernel: float64-exact up to float32 sums, strides, tails, gating, build and fallback."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from qinfer_runtime import sparse_ffn_native
from qinfer_runtime.sparse_ffn import sparse_rows

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler to build the kernel"
)


@pytest.fixture
def fresh_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache, so the kernel is built (or fails to build) inside the test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    sparse_ffn_native.kernel.cache_clear()
    yield tmp_path / "qinfer" / "kernels"
    sparse_ffn_native.kernel.cache_clear()


def _half_rows(rows: int, cols: int, stride: int, seed: int) -> torch.Tensor:
    """[rows, cols] f16 rows inside wider storage (row stride `stride`), with subnormal halves and negative zero in
    the last columns, which the kernel converts without vector lanes when cols % 16 != 0."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(rows, stride, generator=g) / cols**0.5).half()
    special = torch.tensor([6e-8, -3e-5, -0.0, 1.5]).half()
    wide[:, cols - 4 : cols] = special * torch.randn(rows, 1, generator=g).sign().half()
    return wide[:, :cols]


def _reference(variant: str, x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor, down_t: torch.Tensor,
               ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
    xd = x.double()
    u = xd @ up[ids].double().T
    if variant == "falcon":
        act = torch.relu(u)
    else:
        assert gate is not None
        g = torch.relu(xd @ gate[ids].double().T)
        act = g * (torch.relu(u) if variant == "bamboo" else u)
    return act @ down_t[ids].double()


@needs_compiler
@pytest.mark.parametrize("variant", ["llama", "bamboo", "falcon"])
@pytest.mark.parametrize("cols", [100, 256])
def test_kernel_matches_float64(variant: str, cols: int) -> None:
    rows = 57
    gate = None if variant == "falcon" else _half_rows(rows, cols, cols + 28, 0)
    up, down_t = _half_rows(rows, cols, cols + 12, 1), _half_rows(rows, cols, cols, 2)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([0, 3, 4, 9, 10, 11, 20, 33, 41, 42, 56])
    assert sparse_ffn_native.applies(variant, x, gate, up, down_t)
    out = sparse_ffn_native.sparse_ffn(variant, x, gate, up, down_t, ids)
    ref = _reference(variant, x, gate, up, down_t, ids)
    assert out.shape == (1, cols) and out.dtype == torch.float32
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    # Neurons whose gate does not fire are skipped, not approximated: the same ids minus them give the same sum.
    if gate is not None:
        firing = ids[(x @ gate[ids].float().T)[0] > 0]
        assert 0 < firing.numel() < ids.numel()
        assert torch.equal(sparse_ffn_native.sparse_ffn(variant, x, gate, up, down_t, firing), out)


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
    out = sparse_ffn_native.sparse_ffn("bamboo", x, gate, up, down_t, ids)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@needs_compiler
def test_sparse_rows_takes_the_kernel_for_one_f16_token_only(monkeypatch: pytest.MonkeyPatch) -> None:
    gate, up, down_t = (_half_rows(40, 64, 64, s) for s in range(3))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    ids = torch.arange(0, 40, 3)
    calls: list[int] = []
    real = sparse_ffn_native.sparse_ffn

    def counting(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(sparse_ffn_native, "sparse_ffn", counting)
    native = sparse_rows("llama", x[:1], gate, up, down_t, ids, None)
    assert calls == [1]
    sparse_rows("llama", x, gate, up, down_t, ids, torch.ones(2, ids.numel(), dtype=torch.bool))
    sparse_rows("llama", x[:1], gate.float(), up.float(), down_t.float(), ids, None)
    assert calls == [1]  # batches and f32 weights stay on torch
    monkeypatch.setenv("QINFER_NATIVE", "0")
    torch_path = sparse_rows("llama", x[:1], gate, up, down_t, ids, None)
    assert calls == [1]
    assert torch.allclose(native, torch_path, rtol=0, atol=5e-3)


@needs_compiler
def test_kernel_builds_into_an_empty_cache(fresh_kernel: Path) -> None:
    assert sparse_ffn_native.kernel() is not None
    built = sorted(p.name for p in fresh_kernel.iterdir())
    assert len(built) == 1 and built[0].startswith("sparse_ffn_") and built[0].endswith(".so")


def test_without_a_compiler_the_torch_path_runs(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CC", str(fresh_kernel / "no-such-cc"))
    assert sparse_ffn_native.kernel() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sparse FFN kernel not built" in err and "torch" in err
    gate, up, down_t = (_half_rows(40, 64, 64, s) for s in range(3))
    x, ids = torch.randn(1, 64), torch.arange(0, 40, 2)
    assert not sparse_ffn_native.applies("llama", x, gate, up, down_t)
    out = sparse_rows("llama", x, gate, up, down_t, ids, None)
    ref = _reference("llama", x, gate, up, down_t, ids)
    assert (out.double() - ref).abs().max() <= 5e-3 * ref.abs().max()
    assert not list(fresh_kernel.glob("*.tmp"))
