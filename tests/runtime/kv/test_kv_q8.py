"""The q8_0 KV cache: its rows are llama.cpp's Q8_0 blocks (against a float64 replay of quantize_row_q8_0_ref's rule
and byte layout), 34 bytes per 32 values; the torch path attends over exactly the dequantized rows, within a stated
distance of the f32 cache; a head_dim that is not whole blocks is refused in one line, by `qinfer run` too; a GPU's
cache stays f16. The native step over q8_0 rows: tests/runtime/kernels/test_decode_layer.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import F32_KV, GPU_KV_TYPES, KVPolicy, KVTypes
from qinfer.runtime.kv.batch import Step, TokenBatch
from qinfer.runtime.kv.cache import KVCache, Rows, cache_types, make_kv_cache
from qinfer.runtime.kv.q8_rows import dequantize_rows, quantize_rows
from qinfer.runtime.kv.window import WindowKVCache
from qinfer.runtime.model.forward import TransformerForward
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model
from tests.support.cli_in_process import run_in_process

Q8 = KVTypes("q8_0", "q8_0")
CTX = 64


def reference_blocks(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_0_ref in float64, row by row: per 32 values d = max|x| / 127 stored as f16 (little-endian),
    then 32 int8 round(x / d), halves away from zero."""
    blocks = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / 127
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(d == 0, 0.0, blocks / d)
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int8)
    scale = d.astype(np.float16).astype("<f2").view(np.uint8)
    return np.concatenate((scale, q.view(np.uint8)), axis=-1).reshape(*x.shape[:-1], -1)


def test_rows_are_llama_cpps_q8_0_blocks() -> None:
    """Random rows of several scales, a zero block among them: the scales' bytes are the reference's, and so is every
    q but where x / d lies within float rounding of a half (float32's 1 / d against float64's division)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, 128, generator=gen) * torch.logspace(-3, 3, 8)[None, :, None]
    x[0, 0, :32] = 0.0
    mine = quantize_rows(x).numpy()
    assert mine.shape == (64, 8, 4 * 34)
    theirs = reference_blocks(x.numpy())
    blocks_mine, blocks_theirs = mine.reshape(-1, 34), theirs.reshape(-1, 34)
    assert np.array_equal(blocks_mine[:, :2], blocks_theirs[:, :2])
    q_mine, q_theirs = blocks_mine[:, 2:].view(np.int8), blocks_theirs[:, 2:].view(np.int8)
    d = np.abs(x.numpy().astype(np.float64).reshape(-1, 32)).max(axis=1, keepdims=True) / 127
    with np.errstate(divide="ignore", invalid="ignore"):
        fraction = np.abs(np.where(d == 0, 0.0, x.numpy().reshape(-1, 32) / d)) % 1
    near_half = np.abs(fraction - 0.5) < 1e-4
    assert near_half.mean() < 1e-3
    assert np.array_equal(q_mine[~near_half], q_theirs[~near_half])
    assert np.abs(q_mine.astype(int) - q_theirs.astype(int)).max() <= 1
    assert not blocks_mine[0].any()  # the zero block: d = 0, every q 0


def test_halves_round_away_from_zero() -> None:
    """A block whose largest value is 127 has d = 1 exactly: 2.5 is 3 and -2.5 is -3 (C's roundf, not torch's
    round-half-to-even), and d = 1.0 is the f16 bytes 00 3c."""
    x = torch.zeros(32)
    x[:5] = torch.tensor([127.0, 2.5, -2.5, 0.5, -126.5])
    row = quantize_rows(x)
    assert row[:2].tolist() == [0x00, 0x3C]
    assert row[2:].view(torch.int8)[:5].tolist() == [127, 3, -3, 1, -127]
    assert torch.equal(dequantize_rows(row)[:5], torch.tensor([127.0, 3.0, -3.0, 1.0, -127.0]))


def test_memory_is_34_bytes_per_32_values(wide_heads: Path) -> None:
    cfg = open_model(wide_heads).config
    values = cfg.layers * 3 * cfg.kv_heads * CTX * cfg.head_dim  # of K, and of V, for 3 slots
    assert KVCache(cfg, CTX, 3, types=Q8).nbytes == 2 * values // 32 * 34
    assert KVCache(cfg, CTX, 3, types=KVTypes("q8_0", "f16")).nbytes == values // 32 * 34 + values * 2


class RoundedCache(KVCache):
    """An f32 cache whose every row is first rounded through reference_blocks: what a q8_0 cache holds."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, step: Step, queries: Rows = None
    ) -> torch.Tensor:
        return super().attend(q, rounded(k), rounded(v), layer, step, queries)


def rounded(x: torch.Tensor) -> torch.Tensor:
    blocks = reference_blocks(x.numpy()).reshape(*x.shape[:-1], -1, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float64)
    return torch.from_numpy((d * blocks[..., 2:].view(np.int8)).reshape(x.shape)).float()


def decode(forward: TransformerForward, cache: KVCache) -> torch.Tensor:
    """Two prompts in slots 0 and 1, then 12 steps of both together (the batched path) and 4 of slot 1 alone."""
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    kept, forward.native = forward.native, None  # the torch path
    try:
        with torch.inference_mode():
            rows = [forward.forward(TokenBatch.prompt(torch.tensor(ids[: 3 + s]), 0, s), cache)[-1] for s in (0, 1)]
            for j in range(12):
                rows += forward.forward(TokenBatch.decode(ids[5 + j : 7 + j], [3 + j, 4 + j], [0, 1]), cache).unbind()
            for j in range(4):
                rows += forward.forward(TokenBatch.decode([ids[20 + j]], [16 + j], [1]), cache).unbind()
    finally:
        forward.native = kept
    return torch.stack(rows)


def test_the_torch_path_attends_over_the_dequantized_rows(wide_heads: Path) -> None:
    """Prompts and decode steps through a q8_0 cache give the logits of an f32 cache holding the reference's
    dequantized rows; they differ from the exact f32 cache's by the rounding, which stays under 2% of the largest
    logit (0.4% on this model)."""
    forward = load_forward(open_model(wide_heads), RuntimeOptions(ffn="dense")).forward
    assert isinstance(forward, TransformerForward)
    q8 = decode(forward, KVCache(forward.cfg, CTX, 2, types=Q8))
    reference = decode(forward, RoundedCache(forward.cfg, CTX, 2, types=F32_KV))
    assert (q8 - reference).abs().max() <= 1e-5 * reference.abs().max()
    exact = decode(forward, KVCache(forward.cfg, CTX, 2, types=F32_KV))
    assert 0 < (q8 - exact).abs().max() <= 0.02 * exact.abs().max()


def test_heads_that_are_not_whole_blocks_are_refused(gguf_files: dict[str, Path]) -> None:
    """The tiny model's heads are 16 wide: q8_0 is refused before anything is allocated, in one line that says what
    to use instead; the window cache, which keeps float32 whatever the types, is not."""
    cfg = open_model(gguf_files["pi-f16"]).config
    assert cfg.head_dim == 16
    with pytest.raises(UserError, match=r"^-ctv q8_0 stores blocks of 32 values, .* heads have 16; use -ctv f16$"):
        make_kv_cache(cfg, CTX, types=KVTypes("f16", "q8_0"))
    assert isinstance(make_kv_cache(cfg, CTX, policy=KVPolicy("window", 8), types=Q8), WindowKVCache)
    run = ["run", "-m", str(gguf_files["pi-f16"]), "-p", "Once upon a time", "-n", "2", "--temp", "0"]
    refused = run_in_process(*run, "-ctk", "q8_0", "-ctv", "q8_0")
    assert refused.returncode != 0 and refused.stdout == ""
    assert refused.stderr.strip().endswith("heads have 16; use -ctk f16") and refused.stderr.count("\n") == 1


def test_qinfer_run_takes_a_q8_cache(wide_heads: Path) -> None:
    run = ["run", "-m", str(wide_heads), "-p", "Once upon a time", "-n", "6", "--temp", "0", "--ignore-eos"]
    done = run_in_process(*run, "-ctk", "q8_0", "-ctv", "q8_0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Once upon a time") and len(done.stdout.strip()) > len("Once upon a time")


def test_a_gpu_cache_stays_f16() -> None:
    assert cache_types(Q8, "cuda") == GPU_KV_TYPES == KVTypes("f16", "f16")
    assert cache_types(Q8, "cpu") == Q8
