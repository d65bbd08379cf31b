"""Our reader (the header scan's values, tensors as views of the mapped file) reads a plain GGUF as the gguf
package's own reader does: every key's type and value, every tensor's type, shape, offset and bytes."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from qinfer.core.errors import UserError
from qinfer.core.names import Key
from qinfer.formats.gguf_reader import check_layout, metadata, open_gguf
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.runtime.model.model_file import open_model


def _assert_reads_as_gguf_does(path: Path) -> None:
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    fields = {key: field for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.keys) == list(fields)
    for key, field in fields.items():
        kind, item = ours.keys[key].kind, ours.keys[key].item
        assert ([kind] if item is None else [kind, item]) == field.types, key
    assert metadata(ours) == {key: field.contents() for key, field in fields.items()}
    assert (ours.alignment, ours.data_offset) == (theirs.alignment, theirs.data_offset)
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == (
            reference.name,
            reference.tensor_type,
            reference.n_elements,
            reference.n_bytes,
            reference.data_offset,
        )
        assert mine.shape == tuple(int(n) for n in reference.shape)
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        np.testing.assert_array_equal(mine.data, reference.data)


@pytest.mark.parametrize("name", ["dense-f32", "dense-f16"])
def test_a_tiny_files_keys_and_tensors(gguf_files: dict[str, Path], name: str) -> None:
    _assert_reads_as_gguf_does(gguf_files[name])


def test_quantized_rows_and_a_byte_level_vocabulary(swiglu: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    """Llama-3's vocabulary has merges, token types and a pre-tokenizer name; Q4_0 rows are raw blocks."""
    dense = swiglu["llama3"]["dense-f32"]
    assert metadata(open_gguf(dense))[Key.MERGES]
    _assert_reads_as_gguf_does(dense)
    _assert_reads_as_gguf_does(quantize_gguf(dense, tmp_path / "q4.gguf", "Q4_0").outfile)


def test_copy_on_write_views_can_change_without_touching_the_file(gguf_files: dict[str, Path]) -> None:
    path = gguf_files["dense-f32"]
    before = path.read_bytes()
    tensor = open_gguf(path, mode="c").tensors[0]
    tensor.data[...] = 7
    assert (tensor.data == 7).all() and path.read_bytes() == before


@pytest.mark.parametrize("ne", [(0, 2**64 - 1), (0, 2**62, 2**62)], ids=["one", "two"])
def test_an_empty_dimension_does_not_let_the_others_grow(tmp_path: Path, ne: tuple[int, ...]) -> None:
    """A tensor of no elements whose other dimensions no array can have (numpy refuses them) is refused as larger
    than the file, as it would be without the empty one."""
    name = b"t"
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", len(name)) + name
    header += struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, gguf.GGMLQuantizationType.F32, 0)
    path = tmp_path / "empty.gguf"
    path.write_bytes(header + bytes(-len(header) % 32))
    with pytest.raises(UserError, match=r"claims shape \[0, .*larger than the file"):
        open_gguf(path)


def _written(writer: gguf.GGUFWriter) -> Path:
    """The file of gguf's own writer, its keys and tensors written."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(writer.path)


def test_a_quantized_tensor_may_fill_most_of_the_file(tmp_path: Path) -> None:
    """Q4_0 holds 32 elements in 18 bytes, so a tensor of more elements than the file has bytes is still in it."""
    writer = gguf.GGUFWriter(tmp_path / "one.gguf", "llama")
    writer.add_tensor("t", np.zeros((64, 18 * 64), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    path = _written(writer)
    assert path.stat().st_size < 64 * 32 * 64
    _assert_reads_as_gguf_does(path)


def _per_layer_head_counts(path: Path, arch: str) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_array(f"{arch}.attention.head_count_kv", [8, 8, 1])
    return _written(writer)


def test_an_architecture_we_do_not_run_is_refused_by_its_name(tmp_path: Path) -> None:
    """Its keys may have other types than ours (Gemma 4's head counts are per layer): the message names the
    architecture rather than calling the file damaged. Ours keep the types of our table."""
    path = _per_layer_head_counts(tmp_path / "gemma4.gguf", "gemma4")
    assert metadata(open_gguf(path))["gemma4.attention.head_count_kv"] == [8, 8, 1]
    with pytest.raises(UserError, match="architecture 'gemma4' is not supported"):
        open_model(path)
    with pytest.raises(UserError, match="llama.attention.head_count_kv is ARRAY of .*, not UINT32"):
        open_gguf(_per_layer_head_counts(tmp_path / "llama.gguf", "llama"))


def _with_unknown_tensor_type(path: Path, arch: str) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("t", np.zeros((2, 32), np.float32))
    _written(writer)
    with path.open("r+b") as f:
        f.seek(check_layout(path).tensors[0].type_at)
        f.write(struct.pack("<I", 99))
    return path


def test_a_foreign_file_the_scan_refuses_is_named_by_its_architecture(tmp_path: Path) -> None:
    """A tensor type the scan does not know (a newer ggml's) in a file of an architecture we do not run: the message
    names the architecture, where it called the file damaged. In a file of ours, the same bytes are damage."""
    with pytest.raises(UserError, match="architecture 'gemma4' is not supported"):
        open_gguf(_with_unknown_tensor_type(tmp_path / "gemma4.gguf", "gemma4"))
    with pytest.raises(UserError, match="not a valid GGUF file: t has unknown tensor type 99; re-download"):
        open_gguf(_with_unknown_tensor_type(tmp_path / "llama.gguf", "llama"))
