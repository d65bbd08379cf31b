"""A GGUF written again with some metadata replaced: for files that are well-formed but hostile in content."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType, GGUFWriter

from qinfer.core.names import Key


def rewrite_gguf(
    source: Path,
    target: Path,
    replace: dict[str, tuple[Any, GGUFValueType | None]] | None = None,
    drop_keys: frozenset[str] | set[str] = frozenset(),
    drop_tensors: frozenset[str] | set[str] = frozenset(),
    add: dict[str, tuple[Any, GGUFValueType]] | None = None,
) -> Path:
    """`source` (a dense GGUF) as `target`, each key of `replace` holding its new (value, array item type) instead,
    the keys of `drop_keys` and tensors of `drop_tensors` left out, and the keys of `add` after the others with
    their (value, type), every other key and tensor as it was."""
    replace = replace or {}
    reader = GGUFReader(source)
    writer = GGUFWriter(target, str(reader.get_field(Key.ARCHITECTURE).contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == Key.ARCHITECTURE or key in drop_keys:
            continue
        kind = GGUFValueType(field.types[0])
        if key in replace:
            value, item = replace[key]
        else:
            value = field.contents()
            item = GGUFValueType(field.types[-1]) if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=item)
    for key, (value, kind) in (add or {}).items():
        writer.add_key_value(key, value, kind)
    for tensor in (t for t in reader.tensors if t.name not in drop_tensors):
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
