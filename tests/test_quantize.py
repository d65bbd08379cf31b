"""`qinfer prep quantize`: bytes against hand-built blocks, the type rules, metadata and magic, row dequantization."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from qinfer_core.errors import UserError
from qinfer_core.gguf_reader import metadata, open_gguf
from qinfer_core.gguf_writer import TensorPlan, write_gguf
from qinfer_prep.quantize import quantize_gguf
from qinfer_runtime.quant_rows import dequantize_rows

Q4_0, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0


def q4_0_block(x: list[float]) -> bytes:
    """One Q4_0 block from the format: d = the signed value of largest magnitude / -8, q = trunc(x / d + 8.5)
    clamped to 15, stored as f16 d then 16 bytes with weight i in the low and weight i + 16 in the high nibble."""
    big = max(x, key=abs)
    d = big / -8
    q = [min(15, int(v / d + 8.5)) for v in x]
    return struct.pack("<e", d) + bytes(q[i] | q[i + 16] << 4 for i in range(16))


def q8_0_block(x: list[float]) -> bytes:
    d = max(abs(v) for v in x) / 127
    return struct.pack("<e", d) + struct.pack("<32b", *(round(v / d) for v in x))


# Weights whose scales are exact in f16, so the hand computation needs no rounding subtleties.
ROW_A = [float(v) for v in range(-8, 8)] * 2  # largest magnitude -8: d = 1, q = v + 8
ROW_B = [0.5 * v for v in range(-7, 9)] * 2  # largest magnitude +4: d = -0.5, q = 8 - 2v
ROW_C = [float(v) for v in range(-16, 16)]  # one block of 32 distinct weights


def write_tiny(path: Path, tensors: dict[str, np.ndarray], powerinfer: bool) -> Path:
    def add(writer: GGUFWriter) -> None:
        writer.add_file_type(0)
        writer.add_string("tokenizer.ggml.model", "llama")
        writer.add_token_list(["<unk>", "a", "ü"])

    plans = [TensorPlan(name, a.shape, a.dtype, lambda a=a: a) for name, a in tensors.items()]
    write_gguf(path, "llama", add, plans, powerinfer=powerinfer)
    return path


@pytest.fixture
def tiny_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    return write_tiny(
        tmp_path / "in.powerinfer.gguf",
        {
            "blk.0.ffn_up.weight": np.array([ROW_A, ROW_B, ROW_C], dtype=np.float32),
            "blk.0.attn_norm.weight": rng.standard_normal(32).astype(np.float32),
            "blk.0.fc2.weight": rng.standard_normal((64, 48)).astype(np.float16),
            "output.weight": np.array([ROW_C, ROW_A], dtype=np.float32),
        },
        powerinfer=True,
    )


def raw(path: Path, name: str) -> tuple[GGMLQuantizationType, bytes]:
    t = next(t for t in open_gguf(path).tensors if t.name == name)
    return t.tensor_type, t.data.tobytes()


def test_q4_0_bytes_match_blocks_built_by_hand(tiny_file: Path, tmp_path: Path) -> None:
    out = quantize_gguf(tiny_file, tmp_path / "q4.powerinfer.gguf", "Q4_0").outfile
    kind, data = raw(out, "blk.0.ffn_up.weight")
    assert kind == Q4_0
    assert data == q4_0_block(ROW_A) + q4_0_block(ROW_B) + q4_0_block(ROW_C)
    # ROW_A spelt out: d = 1.0, weight i and weight i + 16 are both i - 8, so byte i holds nibble i twice.
    assert q4_0_block(ROW_A) == struct.pack("<e", 1.0) + bytes(i | i << 4 for i in range(16))
    # The output projection is Q8_0 under either target.
    kind, data = raw(out, "output.weight")
    assert (kind, data) == (Q8_0, q8_0_block(ROW_C) + q8_0_block(ROW_A))


def test_q8_0_bytes_match_blocks_built_by_hand(tiny_file: Path, tmp_path: Path) -> None:
    out = quantize_gguf(tiny_file, tmp_path / "q8.powerinfer.gguf", "Q8_0").outfile
    kind, data = raw(out, "blk.0.ffn_up.weight")
    assert (kind, data) == (Q8_0, q8_0_block(ROW_A) + q8_0_block(ROW_B) + q8_0_block(ROW_C))


def test_type_rules_metadata_and_magic(tiny_file: Path, tmp_path: Path) -> None:
    result = quantize_gguf(tiny_file, tmp_path / "q4.powerinfer.gguf", "Q4_0")
    out = result.outfile
    assert out.read_bytes()[:4] == b"PWRI"
    types = {t.name: t.tensor_type for t in open_gguf(out).tensors}
    assert types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32
    # Rows of 48 do not split into blocks of 32: the tensor stays F16 and is reported.
    assert types["blk.0.fc2.weight"] == GGMLQuantizationType.F16
    assert result.kept_f16 == ["blk.0.fc2.weight"]
    before, after = metadata(open_gguf(tiny_file)), metadata(open_gguf(out))
    assert after.pop("general.file_type") == 2
    assert after.pop("general.quantization_version") == 2
    before.pop("general.file_type")
    assert after == before
    dense = write_tiny(tmp_path / "in.gguf", {"output.weight": np.ones((2, 32), np.float16)}, powerinfer=False)
    q = quantize_gguf(dense, tmp_path / "q8.gguf", "Q8_0").outfile
    assert q.read_bytes()[:4] == b"GGUF"
    assert metadata(open_gguf(q))["general.file_type"] == 7


def test_converted_model_quantizes_like_the_gguf_package(
    gguf_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reads of 7 rows: several per tensor, the last one short, as a 7B tensor is read in slices.
    monkeypatch.setattr("qinfer_prep.quantize.ROWS_PER_READ", 7)
    src = gguf_files["pi-f16"]
    out = quantize_gguf(src, tmp_path / "tiny.q4.powerinfer.gguf", "Q4_0").outfile
    expected = {t.name: t for t in open_gguf(src).tensors}
    tensors = open_gguf(out).tensors
    assert [t.name for t in tensors] == list(expected)
    for t in tensors:
        source = expected[t.name].data
        if source.ndim == 1:
            assert t.tensor_type == GGMLQuantizationType.F32
            continue
        want = Q8_0 if t.name == "output.weight" else Q4_0
        assert t.tensor_type == want, t.name
        assert np.array_equal(t.data, quantize(source, want)), t.name
    assert {t.name for t in tensors if t.name.endswith(("fc1.weight", "fc2.weight", "ffn_down_t.weight"))} <= {
        t.name for t in tensors if t.tensor_type == Q4_0
    }


@pytest.mark.parametrize("qtype", [Q4_0, Q8_0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chosen_rows_dequantize_like_the_gguf_package(qtype: GGMLQuantizationType, dtype: torch.dtype) -> None:
    weights = np.random.default_rng(1).standard_normal((40, 96)).astype(np.float32)
    weights[3] = 0.0  # an all-zero block has scale 0
    blocks = quantize(weights, qtype)
    expected = dequantize(blocks, qtype)
    rows = torch.tensor([3, 0, 39, 17, 17])
    ours = dequantize_rows(torch.from_numpy(blocks), qtype, rows, dtype)
    assert ours.dtype == dtype and ours.shape == (5, 96)
    assert torch.equal(ours, torch.from_numpy(expected[rows.numpy()]).to(dtype))
    assert torch.equal(dequantize_rows(torch.from_numpy(blocks), qtype), torch.from_numpy(expected))


def test_refuses_bad_input(tiny_file: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="unknown quantization type"):
        quantize_gguf(tiny_file, tmp_path / "x.gguf", "Q5_K")
    with pytest.raises(UserError, match="not found"):
        quantize_gguf(tmp_path / "missing.gguf", tmp_path / "x.gguf")
    once = quantize_gguf(tiny_file, tmp_path / "q4.gguf").outfile
    with pytest.raises(UserError, match="already Q"):
        quantize_gguf(once, tmp_path / "twice.gguf")
    with pytest.raises(UserError, match="replace the input"):
        quantize_gguf(tiny_file, tiny_file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.powerinfer.gguf", "q4.gguf"]


def test_quantize_command(tiny_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli.q4.powerinfer.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "qinfer", "prep", "quantize", str(tiny_file), str(out), "Q4_0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "kept F16 (rows not a multiple of 32): blk.0.fc2.weight" in done.stderr
    assert out.read_bytes() == quantize_gguf(tiny_file, tmp_path / "api.gguf").outfile.read_bytes()
    failed = subprocess.run(
        [sys.executable, "-m", "qinfer", "prep", "quantize", str(tmp_path / "none.gguf"), str(out), "Q4_0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode == 2
    assert failed.stderr.strip().splitlines() == [f"error: model file not found: {tmp_path / 'none.gguf'}"]
