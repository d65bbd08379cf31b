"""`.gpuidx`: exact bytes of docs/formats.md#gpu-index-gpuidx, round trips, files made by the engine, broken files."""

from __future__ import annotations

import struct
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from qinfer.core.errors import UserError
from qinfer.core.names import KEY_TYPES, PLAN_KEYS, Key
from qinfer.formats.gguf_reader import open_gguf
from qinfer.formats.gpuidx import GpuIndex, Provenance, read_gpuidx, write_gpuidx

# I32 as the engine's ggml numbers it, the code its loader reads; today's ggml numbers it 26, which we wrote before.
ENGINE_I32, TODAYS_I32 = 18, 26


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _tensor_info(name: str, length: int, offset: int, i32: int) -> bytes:
    return _s(name) + struct.pack("<IQIQ", 1, length, i32, offset)


def _pad(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 32)


def required_kv() -> bytes:
    return (
        _s("general.architecture")
        + struct.pack("<I", 8)
        + _s("generic.gpu_index")
        + _s("generic.gpu_index.block_count")
        + struct.pack("<II", 4, 2)
        + _s("split.vram_capacity")
        + struct.pack("<IQ", 10, 1234)
    )


def reference_bytes(i32: int = ENGINE_I32) -> bytes:
    """Two layers of 4 neurons: layer 0 has neurons 0 and 2 on the GPU, layer 1 none (an empty bucket)."""
    header = b"PWRI" + struct.pack("<IQQ", 3, 4, 3)
    kv = required_kv()
    infos = (
        _tensor_info("blk.0.gpu_idx", 4, 0, i32)
        + _tensor_info("blk.0.gpu_bucket", 2, 32, i32)
        + _tensor_info("blk.1.gpu_idx", 4, 64, i32)
        + _tensor_info("blk.1.gpu_bucket", 0, 96, i32)
    )
    data = _pad(struct.pack("<4i", 1, 0, 1, 0)) + _pad(struct.pack("<2i", 0, 2)) + _pad(struct.pack("<4i", 0, 0, 0, 0))
    return _pad(header + kv + infos) + data


def small_index(provenance: Provenance | None = None) -> GpuIndex:
    masks = (np.array([1, 0, 1, 0], dtype=np.int32), np.zeros(4, dtype=np.int32))
    return GpuIndex(vram_capacity=1234, gpu_idx=masks, provenance=provenance)


def test_written_bytes_match_the_design_layout(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf.generated.gpuidx"
    write_gpuidx(path, small_index())
    assert path.read_bytes() == reference_bytes()


@pytest.mark.parametrize("i32", [ENGINE_I32, TODAYS_I32], ids=["engine-code", "earlier-qinfer-code"])
def test_reads_a_file_made_by_the_reference_engine(tmp_path: Path, i32: int) -> None:
    path = tmp_path / "engine.gpuidx"
    path.write_bytes(reference_bytes(i32))
    index = read_gpuidx(path)
    assert index.provenance is None
    assert index.vram_capacity == 1234
    assert [m.tolist() for m in index.gpu_idx] == [[1, 0, 1, 0], [0, 0, 0, 0]]
    assert [b.tolist() for b in index.buckets] == [[0, 2], []]


def test_ggufs_own_reader_gets_the_engine_code_as_i32(tmp_path: Path) -> None:
    """gguf's reader (through open_gguf) would take 18 for IQ3_XXS; ours answers it today's I32 code."""
    path = tmp_path / "engine.gpuidx"
    path.write_bytes(reference_bytes())
    tensors = open_gguf(path).tensors
    assert [t.tensor_type for t in tensors] == [GGMLQuantizationType.I32] * 4
    assert [np.asarray(t.data).tolist() for t in tensors] == [[1, 0, 1, 0], [0, 2], [0, 0, 0, 0], []]


def test_a_plain_gguf_reads_18_as_todays_type(tmp_path: Path) -> None:
    """Only a PowerInfer GGUF takes 18 for the engine's I32; in a plain GGUF it is IQ3_XXS, whose blocks of 256
    values a 4-neuron vector cannot hold."""
    path = tmp_path / "plain.gpuidx"
    path.write_bytes(b"GGUF" + reference_bytes()[4:])
    with pytest.raises(UserError, match="IQ3_XXS blocks"):
        read_gpuidx(path)


def test_provenance_follows_the_required_keys_and_round_trips(tmp_path: Path) -> None:
    made = Provenance(
        model_size=10,
        model_mtime_ns=2**62 + 5,
        vram_budget=8 << 30,
        activation_sha256="ab" * 32,
        group_size=64,
        objective="time",
        ctx_size=512,
        batch=2,
        gpu="rtx4090",
        cpu="generic-desktop",
        dense="auto",
        attention_on_gpu=(True, False),
        output_on_gpu=False,
    )
    path = tmp_path / "ours.gpuidx"
    write_gpuidx(path, small_index(made))
    raw = path.read_bytes()
    engine = reference_bytes()
    # Same magic, version and tensor count; more keys; the engine's three keys come first, byte for byte.
    assert raw[:16] == engine[:16]
    assert struct.unpack_from("<Q", raw, 16)[0] == 3 + 13
    required_kv_end = 24 + len(required_kv())
    assert raw[24:required_kv_end] == engine[24:required_kv_end]
    first_extra = _s("qinfer.plan.model_size")
    assert raw[required_kv_end : required_kv_end + len(first_extra)] == first_extra
    index = read_gpuidx(path)
    assert index.provenance == made
    assert [m.tolist() for m in index.gpu_idx] == [[1, 0, 1, 0], [0, 0, 0, 0]]


def test_inconsistent_bucket_is_refused(tmp_path: Path) -> None:
    raw = bytearray(reference_bytes())
    data_start = len(raw) - 96
    struct.pack_into("<i", raw, data_start + 32 + 4, 3)  # bucket says neuron 3, gpu_idx says neuron 2
    path = tmp_path / "bad.gpuidx"
    path.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="disagree"):
        read_gpuidx(path)


def test_a_model_file_is_not_a_gpu_index(tmp_path: Path, gguf_files: dict[str, Path]) -> None:
    with pytest.raises(UserError, match="not a GPU index"):
        read_gpuidx(gguf_files["pi-f32"])


def test_the_provenance_keys_are_the_dataclass_fields_and_have_types() -> None:
    """One table (names.PLAN_KEYS) gives the keys the writer writes, the reader reads, the layout check types and a
    stale plan names; the dataclass has a field of each, in its order."""
    assert [f.name for f in fields(Provenance)] == list(PLAN_KEYS)
    assert {key for key in KEY_TYPES if key.startswith(Key.PLAN_PREFIX)} == {Key.PLAN_PREFIX + k for k in PLAN_KEYS}


def test_a_window_plan_round_trips_and_a_mistyped_kv_rows_is_refused(tmp_path: Path) -> None:
    made = Provenance(
        model_size=10, model_mtime_ns=5, vram_budget=8 << 30, activation_sha256="ab" * 32, group_size=64,
        objective="time", ctx_size=512, batch=2, gpu="rtx4090", cpu="generic-desktop", dense="auto",
        attention_on_gpu=(True, False), output_on_gpu=False, kv_policy="window", kv_rows=128,
    )  # fmt: skip
    path = tmp_path / "window.gpuidx"
    write_gpuidx(path, small_index(made))
    assert read_gpuidx(path).provenance == made
    # The same key holding a string: the layout check refuses it in one line, before anything reads it as a number.
    raw = path.read_bytes()
    key = _s("qinfer.plan.kv_rows")
    at = raw.index(key) + len(key)
    assert struct.unpack_from("<I", raw, at)[0] == 4  # UINT32
    damaged = raw[:at] + struct.pack("<I", 8) + _s("1e9") + raw[at + 8 :]
    bad = tmp_path / "bad.gpuidx"
    bad.write_bytes(damaged)
    with pytest.raises(UserError, match="kv_rows is STRING, not UINT32"):
        read_gpuidx(bad)
