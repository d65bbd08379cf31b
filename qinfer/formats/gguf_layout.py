"""Check a GGUF's whole layout before anything reads it: files come from the internet, so every length, type and
offset in the header is checked against the bytes that are really there, as ggml's own reader does
(docs/formats.md#gguf-and-powerinfer-gguf).

gguf-py's reader trusts the header: a changed value type makes it loop on zero-length reads, a lowered tensor
count shifts the data section, an offset near 2**64 wraps around. This scan refuses all of those in one line.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from qinfer.core.architectures import ARCHITECTURES
from qinfer.core.names import KEY_TYPES, Key, Tensor, tensor_name

POWERINFER_MAGIC = b"PWRI"
MAGICS = (b"GGUF", POWERINFER_MAGIC)
# The PowerInfer engine's ggml predates the i-quants, so its integer types keep their first codes (I8 = 16, I16 = 17,
# I32 = 18) where today's ggml numbers them 24 to 26. A PowerInfer GGUF holds them under the engine's codes, the only
# ones it reads; a plain GGUF under today's.
ENGINE_INTEGER_TYPES = {
    16: GGMLQuantizationType.I8,
    17: GGMLQuantizationType.I16,
    18: GGMLQuantizationType.I32,
}
# The longest token accepted, in bytes: real vocabularies' longest are runs of spaces of at most 1024 bytes
# (GPT-NeoX's, MPT's and Command-R's), and the GPT-2 tokenizer's rebuild of a vocabulary is quadratic in a token's
# length. A merge rule is the two halves of a token and a space between them.
MAX_TOKEN_BYTES = 1024
# String arrays whose items are read once their number is checked (check_vocabulary_size), then checked
# against each other (check_vocabulary_items), and the longest item each may have.
_VOCABULARY_KEYS = {Key.TOKENS: MAX_TOKEN_BYTES, Key.MERGES: MAX_TOKEN_BYTES + 1}
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME, terminator included in ggml
DEFAULT_ALIGNMENT = 32
_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<B",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class LayoutError(ValueError):
    """What is wrong with the bytes; the caller names the file and the fix. `architecture` is the file's
    general.architecture where the scan had read its keys: for a file of an architecture we do not run, that is
    what to tell (another format version's tensor types or keys are no damage)."""

    architecture: str | None = None


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ne: tuple[int, ...]  # ggml order, innermost first
    qtype: GGMLQuantizationType  # today's numbering, whichever the file uses
    offset: int  # from the start of the data section
    nbytes: int
    type_at: int  # the file offset of the type's code


@dataclass(frozen=True)
class Value:
    kind: GGUFValueType
    item: GGUFValueType | None  # an array's item type
    value: Any  # a scalar or string; an array's items: a list of strings, or a numpy array of numbers


@dataclass(frozen=True)
class Layout:
    magic: bytes
    keys: dict[str, Value]
    tensors: tuple[TensorEntry, ...]
    data_start: int
    alignment: int


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > len(self.buf) - self.pos:
            raise LayoutError(
                f"{what} needs {n} bytes at offset {self.pos}, but the file has {len(self.buf) - self.pos}"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str) -> int | float:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def skip_strings(self, count: int, key: str, longest: int) -> None:
        """Step over `count` strings of at most `longest` bytes each, checking their lengths, not their text."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        for i in range(count):
            if end - pos < 8:
                raise LayoutError(f"item {i} of {key} needs 8 bytes at offset {pos}, but the file has {end - pos}")
            (length,) = struct.unpack_from("<Q", buf, pos)
            if length > longest:
                raise LayoutError(f"item {i} of {key} is {length} bytes long, over the {longest} allowed")
            pos += 8 + length
            if pos > end:
                raise LayoutError(f"item {i} of {key} runs past the end of the file")
        self.pos = pos

    def string(self, what: str) -> str:
        length = int(self.scalar("<Q", what))
        try:
            return str(self.take(length, what), "utf-8")
        except UnicodeDecodeError as exc:
            raise LayoutError(f"{what} is not valid UTF-8 ({exc.reason})") from None


def _value_type(raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise LayoutError(f"{what} has unknown value type {raw}") from None


def _value(cur: _Cursor, kind: GGUFValueType, key: str, kept: dict[str, tuple[int, int]]) -> Value:
    """The value at the cursor. A vocabulary key's strings are only stepped over, their offset and count kept in
    `kept`, and its value left None: they are read once the embedding has confirmed their number (scan_layout)."""
    if kind == GGUFValueType.STRING:
        return Value(kind, None, cur.string(f"the value of {key}"))
    if kind != GGUFValueType.ARRAY:
        value = cur.scalar(_SCALARS[kind], f"the value of {key}")
        return Value(kind, None, bool(value) if kind == GGUFValueType.BOOL else value)
    item = _value_type(int(cur.scalar("<I", f"the array type of {key}")), f"an item of {key}")
    count = int(cur.scalar("<Q", f"the array length of {key}"))
    if item == GGUFValueType.ARRAY:
        raise LayoutError(f"{key} is an array of arrays, which GGUF readers do not take")
    if item == GGUFValueType.STRING:
        # Each string is at least its 8-byte length: a count the rest of the file cannot hold is refused at once.
        if count > (len(cur.buf) - cur.pos) // 8:
            raise LayoutError(f"{key} claims {count} strings, more than the file can hold")
        if key in _VOCABULARY_KEYS:
            kept[key] = (cur.pos, count)
            cur.skip_strings(count, key, _VOCABULARY_KEYS[key])
            return Value(kind, item, None)
        return Value(kind, item, [cur.string(f"item {i} of {key}") for i in range(count)])
    fmt = _SCALARS[item]
    items = np.frombuffer(cur.take(count * struct.calcsize(fmt), f"the {count} items of {key}"), np.dtype(fmt))
    # A copy, not a view: the scan's buffer is released when it ends. Numbers stay an array, where a list would
    # take about 20 times the file's bytes.
    return Value(kind, item, items != 0 if item == GGUFValueType.BOOL else items.copy())


def _tensor(
    cur: _Cursor, index: int, engine_types: bool
) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]:
    name = cur.string(f"the name of tensor {index}")
    if not name or len(name.encode()) >= MAX_NAME:
        raise LayoutError(f"tensor {index} has a name of {len(name.encode())} bytes (1 to {MAX_NAME - 1} allowed)")
    dims = int(cur.scalar("<I", f"the dimension count of {name}"))
    if not 1 <= dims <= MAX_DIMS:
        raise LayoutError(f"{name} has {dims} dimensions (1 to {MAX_DIMS} allowed)")
    ne = tuple(int(cur.scalar("<Q", f"a dimension of {name}")) for _ in range(dims))
    type_at = cur.pos
    raw_type = int(cur.scalar("<I", f"the type of {name}"))
    if engine_types and raw_type in ENGINE_INTEGER_TYPES:
        qtype = ENGINE_INTEGER_TYPES[raw_type]
    else:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise LayoutError(f"{name} has unknown tensor type {raw_type}") from None
    if qtype not in GGML_QUANT_SIZES:
        raise LayoutError(f"{name} has tensor type {qtype.name}, which has no known size")
    return name, ne, qtype, int(cur.scalar("<Q", f"the offset of {name}")), type_at


def _nbytes(name: str, ne: tuple[int, ...], qtype: GGMLQuantizationType, limit: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    if ne[0] % block:
        raise LayoutError(f"{name} has shape {list(ne)}, which {qtype.name} blocks of {block} cannot hold")
    # Python ints do not overflow, but a shape whose bytes exceed the file cannot be in it. Empty dimensions count
    # as 1 here, so that one of them does not let the others take any size (numpy refuses those, which no view
    # needs); a block type's bytes, not its elements, are what the file holds (a Q4_0 block: 32 in 18 bytes).
    if math.prod(max(n, 1) for n in ne) // block * size > limit:
        raise LayoutError(f"{name} claims shape {list(ne)}, larger than the file")
    return math.prod(ne) // block * size


def _architecture(keys: dict[str, Value]) -> str | None:
    arch = keys.get(Key.ARCHITECTURE)
    return arch.value if arch is not None and arch.kind == GGUFValueType.STRING else None


def check_key_types(keys: dict[str, Value]) -> None:
    """Known keys must have the type the format gives them (docs/formats.md#metadata-keys), as llama.cpp's loader
    insists; a bool turned into a byte, or a count into a string, is a damaged file, not another model. An
    architecture we do not run may give its keys other types (Gemma 4's head counts are per layer): the runtime
    refuses such a file by its architecture's name."""
    name = _architecture(keys)
    for template, want in KEY_TYPES.items():
        if "{arch}" in template and name not in ARCHITECTURES:
            continue
        key = template.format(arch=name) if "{arch}" in template else template
        found = keys.get(key)
        if found is not None and (found.kind, found.item) != want:
            kind = found.kind.name if found.item is None else f"{found.kind.name} of {found.item.name}"
            expected = want[0].name if want[1] is None else f"{want[0].name} of {want[1].name}"
            raise LayoutError(f"{key} is {kind}, not {expected}")


def scan_layout(buf: memoryview) -> Layout:
    """Every header field checked against the bytes left; tensors at the running aligned offsets; data in the file."""
    cur = _Cursor(buf)
    magic = bytes(cur.take(4, "the magic"))
    if magic not in MAGICS:
        raise LayoutError(f"the magic is {magic!r}, not GGUF or PWRI")
    version = int(cur.scalar("<I", "the version"))
    if version not in VERSIONS:
        raise LayoutError(f"GGUF version {version} is not supported (2 or 3 are)")
    n_tensors = int(cur.scalar("<Q", "the tensor count"))
    n_kv = int(cur.scalar("<Q", "the key count"))
    # A key is at least 8 + 4 bytes and a tensor entry at least 8 + 4 + 8 + 4 + 8: counts beyond that are lies.
    if n_kv > len(buf) // 12 or n_tensors > len(buf) // 32:
        raise LayoutError(f"the header claims {n_tensors} tensors and {n_kv} keys, more than the file can hold")
    keys: dict[str, Value] = {}
    vocabulary: dict[str, tuple[int, int]] = {}
    for i in range(n_kv):
        key = cur.string(f"key {i}")
        if key in keys:
            raise LayoutError(f"the key {key} appears twice")
        keys[key] = _value(cur, _value_type(int(cur.scalar("<I", f"the type of {key}")), key), key, vocabulary)
    try:
        return _layout_after_keys(buf, cur, magic, n_tensors, keys, vocabulary)
    except LayoutError as exc:
        exc.architecture = _architecture(keys)
        raise


def _layout_after_keys(
    buf: memoryview,
    cur: _Cursor,
    magic: bytes,
    n_tensors: int,
    keys: dict[str, Value],
    vocabulary: dict[str, tuple[int, int]],
) -> Layout:
    check_key_types(keys)
    alignment = keys[Key.ALIGNMENT].value if Key.ALIGNMENT in keys else DEFAULT_ALIGNMENT
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise LayoutError(f"{Key.ALIGNMENT} is {alignment!r}, not a power of two")
    raw = [_tensor(cur, i, magic == POWERINFER_MAGIC) for i in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    tensors, names, running = [], set(), 0
    for name, ne, qtype, offset, type_at in raw:
        if name in names:
            raise LayoutError(f"the tensor {name} appears twice")
        names.add(name)
        nbytes = _nbytes(name, ne, qtype, len(buf))
        if offset != running:
            raise LayoutError(f"{name} is at data offset {offset}, but the tensors before it end at {running}")
        if data_start + offset + nbytes > len(buf):
            raise LayoutError(f"{name} ends at byte {data_start + offset + nbytes}, past the end of the file")
        tensors.append(TensorEntry(name, ne, qtype, offset, nbytes, type_at))
        running = -(-(offset + nbytes) // alignment) * alignment
    # Writers end the file with the last tensor (and at most its padding): more bytes after it mean a header that
    # no longer describes the data, such as a last tensor given a smaller type.
    end = data_start + (tensors[-1].offset + tensors[-1].nbytes if tensors else 0)
    if len(buf) - end >= alignment:
        raise LayoutError(f"{len(buf) - end} bytes follow the last tensor's data, which the header does not describe")
    check_vocabulary_size(keys, vocabulary, tensors)
    for key, (start, count) in vocabulary.items():
        keys[key] = Value(keys[key].kind, keys[key].item, _strings(buf, start, count, key))
    check_vocabulary_items(keys)
    return Layout(magic, keys, tuple(tensors), data_start, alignment)


def check_vocabulary_size(
    keys: dict[str, Value], vocabulary: dict[str, tuple[int, int]], tensors: list[TensorEntry]
) -> None:
    """The vocabulary's size agrees with the embedding's, as llama.cpp's loader requires, before any token is read:
    one row of token_embd per token, and a score and a type per token where they are given. Each item's length
    is checked as the scan steps over it (_VOCABULARY_KEYS)."""
    if Key.TOKENS not in vocabulary:
        return
    n = vocabulary[Key.TOKENS][1]
    embedding_name = tensor_name(Tensor.TOKEN_EMBD)
    embedding = next((t for t in tensors if t.name == embedding_name), None)
    if embedding is not None and len(embedding.ne) == 2 and embedding.ne[1] != n:
        raise LayoutError(f"the vocabulary has {n} tokens but {embedding_name} has {embedding.ne[1]} rows")
    for key in (Key.SCORES, Key.TOKEN_TYPE):
        if key in keys and len(keys[key].value) != n:
            raise LayoutError(f"{key} has {len(keys[key].value)} entries for {n} tokens")


def check_vocabulary_items(keys: dict[str, Value]) -> None:
    """The vocabulary read, before any tokenizer is built from it: no token twice, and merge rules that join two
    tokens into a third."""
    if Key.TOKENS not in keys:
        return
    ids: dict[str, int] = {}
    for i, token in enumerate(keys[Key.TOKENS].value):
        if ids.setdefault(token, i) != i:
            raise LayoutError(f"the vocabulary holds {token!r} twice (ids {ids[token]} and {i})")
    for i, rule in enumerate(keys[Key.MERGES].value if Key.MERGES in keys else ()):
        left, space, right = rule.partition(" ")
        if not space or " " in right or left not in ids or right not in ids or left + right not in ids:
            raise LayoutError(f"merge {i} ({rule!r}) does not join two tokens of the vocabulary into a third")


def _strings(buf: memoryview, start: int, count: int, key: str) -> list[str]:
    """The `count` strings from `start`, whose lengths the scan has checked (a vocabulary's hundreds of thousands
    of items, so no cursor and no message made for each)."""
    items, pos = [], start
    for i in range(count):
        (length,) = struct.unpack_from("<Q", buf, pos)
        pos += 8
        try:
            items.append(str(buf[pos : pos + length], "utf-8"))
        except UnicodeDecodeError as exc:
            raise LayoutError(f"item {i} of {key} is not valid UTF-8 ({exc.reason})") from None
        pos += length
    return items


def starts_as_gguf(path: Path) -> bool:
    """Whether the file at `path` begins with a GGUF or PowerInfer magic (an earlier output a writer may replace)."""
    try:
        with path.open("rb") as f:
            return f.read(4) in MAGICS
    except OSError:
        return False
