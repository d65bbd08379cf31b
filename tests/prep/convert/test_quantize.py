"""`qinfer prep quantize`: bytes against hand-built blocks (rounding ties included), the type rules, metadata and
magic, row dequantization."""

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

from qinfer.core.architectures import ARCHITECTURES
from qinfer.core.errors import UserError
from qinfer.core.model_spec import ModelSpec
from qinfer.formats.gguf_reader import metadata, open_gguf
from qinfer.formats.gguf_writer import TensorPlan, write_gguf
from qinfer.prep.convert.quant_blocks import quantize_q4_0, quantize_q8_0
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.runtime.kernels.quant_rows import dequantize_rows
from tests.support.cli_in_process import run_in_process

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


# The smallest complete model whose tensors hold the rows above: E = 32, F = 64, vocabulary 2, and predictors of
# width 48, whose rows (48 values) do not split into blocks of 32.
TINY_SPEC = ModelSpec(
    arch="llama", name="tiny", vocab_size=2, context_length=16, hidden=32, layers=1, ffn=64, heads=1, kv_heads=1,
    norm_eps=1e-6, rope_dim=32,
)  # fmt: skip


def write_tiny(path: Path, rows: dict[str, np.ndarray], powerinfer: bool) -> Path:
    """A complete tiny llama file (random weights) whose named tensors start with the given rows."""
    arch, rng = ARCHITECTURES["llama"], np.random.default_rng(0)
    tensors = {}
    for name, shape in arch.tensors(TINY_SPEC, [48] if powerinfer else None).items():
        dtype = np.float16 if name.endswith("fc2.weight") else np.float32
        tensor = rng.standard_normal(shape).astype(dtype)
        if name in rows:
            tensor[: len(rows[name])] = rows[name]
        tensors[name] = tensor

    def add(writer: GGUFWriter) -> None:
        writer.add_name(TINY_SPEC.name)
        writer.add_context_length(TINY_SPEC.context_length)
        writer.add_embedding_length(TINY_SPEC.hidden)
        writer.add_block_count(TINY_SPEC.layers)
        writer.add_feed_forward_length(TINY_SPEC.ffn)
        arch.add_metadata(writer, TINY_SPEC)
        writer.add_file_type(0)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["a", "ü"])

    plans = [TensorPlan(name, a.shape, a.dtype, lambda a=a: a) for name, a in tensors.items()]
    write_gguf(path, "llama", add, plans, powerinfer=powerinfer)
    return path


@pytest.fixture
def tiny_file(tmp_path: Path) -> Path:
    rows = {"blk.0.ffn_up.weight": np.array([ROW_A, ROW_B, ROW_C]), "output.weight": np.array([ROW_C, ROW_A])}
    return write_tiny(tmp_path / "in.powerinfer.gguf", rows, powerinfer=True)


def raw(path: Path, name: str) -> tuple[GGMLQuantizationType, bytes]:
    t = next(t for t in open_gguf(path).tensors if t.name == name)
    return t.tensor_type, t.data.tobytes()


def test_q4_0_bytes_match_blocks_built_by_hand(tiny_file: Path, tmp_path: Path) -> None:
    out = quantize_gguf(tiny_file, tmp_path / "q4.powerinfer.gguf", "Q4_0").outfile
    kind, data = raw(out, "blk.0.ffn_up.weight")
    assert kind == Q4_0
    assert data[: 3 * 18] == q4_0_block(ROW_A) + q4_0_block(ROW_B) + q4_0_block(ROW_C)
    # ROW_A spelt out: d = 1.0, weight i and weight i + 16 are both i - 8, so byte i holds nibble i twice.
    assert q4_0_block(ROW_A) == struct.pack("<e", 1.0) + bytes(i | i << 4 for i in range(16))
    # The output projection is Q8_0 under either target.
    kind, data = raw(out, "output.weight")
    assert (kind, data) == (Q8_0, q8_0_block(ROW_C) + q8_0_block(ROW_A))


def test_q8_0_bytes_match_blocks_built_by_hand(tiny_file: Path, tmp_path: Path) -> None:
    out = quantize_gguf(tiny_file, tmp_path / "q8.powerinfer.gguf", "Q8_0").outfile
    kind, data = raw(out, "blk.0.ffn_up.weight")
    assert (kind, data[: 3 * 34]) == (Q8_0, q8_0_block(ROW_A) + q8_0_block(ROW_B) + q8_0_block(ROW_C))


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
    dense = write_tiny(tmp_path / "in.gguf", {"output.weight": np.ones((2, 32))}, powerinfer=False)
    q = quantize_gguf(dense, tmp_path / "q8.gguf", "Q8_0").outfile
    assert q.read_bytes()[:4] == b"GGUF"
    assert metadata(open_gguf(q))["general.file_type"] == 7


def test_converted_model_quantizes_in_slices_as_whole_tensors(
    gguf_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reads of 7 rows: several per tensor, the last one short, as a 7B tensor is read in slices.
    monkeypatch.setattr("qinfer.prep.convert.quantize.ROWS_PER_READ", 7)
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
        whole = quantize_q8_0(source) if want == Q8_0 else quantize_q4_0(source)
        assert np.array_equal(t.data, whole), t.name
    assert {t.name for t in tensors if t.name.endswith(("fc1.weight", "fc2.weight", "ffn_down_t.weight"))} <= {
        t.name for t in tensors if t.tensor_type == Q4_0
    }


def block(values: dict[int, float]) -> np.ndarray:
    """One block of 32 float32 weights, zero but at the given positions."""
    x = np.zeros(32, dtype=np.float32)
    for i, v in values.items():
        x[i] = v
    return x


def q4_bytes(scale: str, *lead: int) -> bytes:
    """A Q4_0 block spelt out: the f16 scale as little-endian hex, its first quant bytes, then bytes 0x88 (two
    quants 8, the code of a zero weight)."""
    return bytes.fromhex(scale) + bytes(lead) + b"\x88" * (16 - len(lead))


# x*id + 8.5 on either side of a float32 rounding boundary. max = 8 - 2^-21 gives d = -(1 - 2^-24), whose f16 is
# -1.0 (bc00), and id = float32(1 / d) = -(1 + 2^-23). Weight 0: x*id + 8.5 = 0.5 - 2^-21 + 2^-44, quant 0.
# Weight 1 (and 17), -(0.5 - 9*2^-24): x*id + 8.5 = 9 - 2^-21 - 9*2^-47 exactly, just below the float32 midpoint
# 9 - 2^-21 between 9 - 2^-20 and 9. The engine's fused multiply-add rounds it once, to 9 - 2^-20: quant 8.
# gguf-py rounds the product first, to 0.5 - 2^-21, and the sum then lands on the midpoint and ties to even, 9.
# Weight 2, -(0.5 - 5*2^-24): x*id + 8.5 = 9 - 2^-22 - 5*2^-47, which float32 rounds up to 9: quant 9 although
# the exact sum's integer part is 8, since C truncates the float32 sum.
FMA_TIE = block({0: 8 - 2**-21, 1: -(0.5 - 9 * 2**-24), 2: -(0.5 - 5 * 2**-24), 17: -(0.5 - 9 * 2**-24)})
FMA_TIE_Q4_0 = q4_bytes("00bc", 0x80, 0x88, 0x89)  # gguf-py: 00bc 80 99 89 88...

Q4_0_CASES = {
    "fused rounding tie": (FMA_TIE, FMA_TIE_Q4_0),
    # Equal magnitudes: the first one is the signed max. -2 first: d = 0.25 (3400), id = 4, so -2 -> 0.5 -> 0,
    # 2 -> 16.5 -> 16, clamped to 15, 1 -> 12.5 -> 12. +2 first: d = -0.25 (b400), id = -4, 1 -> 4.5 -> 4.
    "magnitude tie, negative first": (block({0: -2, 1: 2, 2: 1}), q4_bytes("0034", 0x80, 0x8F, 0x8C)),
    "magnitude tie, positive first": (block({0: 2, 1: -2, 2: 1}), q4_bytes("00b4", 0x80, 0x8F, 0x84)),
    # C's max starts at +0.0 and stays there: d = +0.0 / -8 = -0.0 (8000), id = 0, every quant 8, whatever the
    # zeros' signs (gguf-py takes -0.0 from the block and writes d = +0.0, 0000).
    "all zero": (block({}), q4_bytes("0080")),
    "all zero, first -0.0": (block({0: -0.0, 7: -0.0}), q4_bytes("0080")),
    # One weight, -3 at position 21 (high nibble of byte 5): d = 0.375 (3600), id = float32(8/3) = 11184811 * 2^-22,
    # x*id = -(2^25 + 1) * 2^-22 = -(8 + 2^-22), + 8.5 -> 0.
    "single weight": (block({21: -3}), q4_bytes("0036", 0x88, 0x88, 0x88, 0x88, 0x88, 0x08)),
    # Scales in the f16 subnormal range (steps of 2^-24), rounded to nearest even; weight 0 is the max, quant 0.
    # d = 3*2^-25 = 1.5 steps -> 2 (0200); d = 2^-25 = 0.5 step -> 0 (0000); d = 3*2^-26 = 0.75 step -> 1 (0100).
    "f16 subnormal scale, tie up to even": (block({0: -3 * 2**-22}), q4_bytes("0200", 0x80)),
    "f16 subnormal scale, tie down to even": (block({0: -(2**-22)}), q4_bytes("0000", 0x80)),
    "f16 subnormal scale, nearest": (block({0: -3 * 2**-23}), q4_bytes("0100", 0x80)),
    # d = 65520, halfway between the largest f16 65504 and the next step 65536, ties to even: inf (7c00). With
    # d = 65519 it rounds down to 65504 (7bff). Weight 1, +max: 16.5 -> 16, clamped to 15.
    "scale overflows f16": (block({0: -8 * 65520.0, 1: 8 * 65520.0}), q4_bytes("007c", 0x80, 0x8F)),
    "largest f16 scale": (block({0: -8 * 65519.0}), q4_bytes("ff7b", 0x80)),
}


@pytest.mark.parametrize("case", Q4_0_CASES)
def test_q4_0_blocks_at_rounding_ties(case: str) -> None:
    weights, expected = Q4_0_CASES[case]
    assert quantize_q4_0(weights).tobytes() == expected


def test_q8_0_rounds_halves_away_from_zero() -> None:
    # amax = 127: d = 1 (3c00), id = 1. 0.5 -> 1, -0.5 -> -1, 1.5 -> 2, 2.5 -> 3 (np.round: 2), -2.5 -> -3, and
    # 0.5 - 2^-25 (0.49999997f) -> 0, where adding 0.5 before truncating would round up to 1.
    halves = block({0: 127, 1: 0.5, 2: -0.5, 3: 1.5, 4: 2.5, 5: -2.5, 6: 0.5 - 2**-25})
    assert quantize_q8_0(halves).tobytes() == bytes.fromhex("003c 7f 01 ff 02 03 fd 00") + bytes(25)
    # amax = 0: d = +0.0 (0000) and quants 0, for -0.0 weights too.
    assert quantize_q8_0(block({3: -0.0})).tobytes() == bytes(34)


def test_block_quantizers_keep_leading_axes_and_slabs(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = np.stack([np.stack([FMA_TIE, block({})]).reshape(64)] * 3)
    assert quantize_q4_0(rows).shape == (3, 36) and quantize_q8_0(rows).shape == (3, 68)
    assert quantize_q4_0(rows)[2].tobytes() == FMA_TIE_Q4_0 + q4_bytes("0080")
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_q4_0(np.zeros((2, 48), dtype=np.float32))
    # 21 blocks (ties, zeros, f16 input) in slabs of 5, the last one short, give the bytes of a single slab.
    weights = np.random.default_rng(2).standard_normal((7, 96)).astype(np.float16)
    weights[1, :32], weights[4, 32:64] = Q4_0_CASES["magnitude tie, positive first"][0], 0
    whole = quantize_q4_0(weights), quantize_q8_0(weights)
    monkeypatch.setattr("qinfer.prep.convert.quant_blocks.SLAB_BLOCKS", 5)
    assert np.array_equal(quantize_q4_0(weights), whole[0]) and np.array_equal(quantize_q8_0(weights), whole[1])


def test_quantize_writes_the_engines_blocks(tmp_path: Path) -> None:
    src = write_tiny(tmp_path / "in.gguf", {"blk.0.ffn_up.weight": FMA_TIE.reshape(1, 32)}, powerinfer=False)
    out = quantize_gguf(src, tmp_path / "q4.gguf", "Q4_0").outfile
    kind, data = raw(out, "blk.0.ffn_up.weight")
    assert (kind, data[:18]) == (Q4_0, FMA_TIE_Q4_0)


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
    with pytest.raises(UserError, match="it is the input file .*, which this command reads"):
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


def test_a_refused_quantize_prints_its_error_line_alone(tiny_file: Path, tmp_path: Path) -> None:
    # Refused before the progress bar starts: rich would print an empty line for a bar stopped unstarted.
    for args in ([str(tiny_file), str(tmp_path / "x.gguf"), "Q5_K"], [str(tiny_file), str(tiny_file)]):
        result = run_in_process("prep", "quantize", *args)
        assert result.returncode == 2 and result.stderr.startswith("error: "), result.stderr
        assert result.stderr.count("\n") == 1, result.stderr


def test_quantize_reports_its_output_on_one_line_as_named(tiny_file: Path, tmp_path: Path) -> None:
    # A long path, and brackets that rich would have read as markup and dropped.
    out = tmp_path / ("models[old]" + "-x" * 40) / "tiny.q4.gguf"
    out.parent.mkdir()
    result = run_in_process("prep", "quantize", str(tiny_file), str(out))
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"wrote {out} (Q4_0, ")
