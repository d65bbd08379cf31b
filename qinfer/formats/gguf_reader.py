"""Read GGUF and PowerInfer GGUF files: the checked header scan's keys and tensors (qinfer.formats.gguf_layout),
each tensor a numpy view of the memory-mapped file. The scan reads every header byte already, so the reader keeps
what it read rather than parse it again with gguf's reader, which is slow on large vocabularies
(docs/formats.md#gguf-and-powerinfer-gguf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from qinfer.core.architectures import ARCHITECTURES, unsupported_architecture
from qinfer.core.errors import UserError
from qinfer.core.model_check import Entries
from qinfer.formats.gguf_layout import POWERINFER_MAGIC, Layout, LayoutError, Value, scan_layout

# Tensor types whose data reads as numpy numbers; any other (the quantized ones, BF16) as rows of raw bytes.
_ELEMENT_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType  # today's numbering, whichever the file uses
    shape: tuple[int, ...]  # ggml order, innermost first
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # the elements, outermost dimension first; a quantized type's rows as raw blocks (uint8)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    is_powerinfer: bool
    keys: dict[str, Value]  # every metadata key in file order
    alignment: int
    data_offset: int  # where the tensors' data starts
    tensors: tuple[GGUFTensor, ...]


MODEL_FIX = "re-download it or re-create it with `qinfer prep convert`"


def _invalid(path: Path, reason: ValueError, fix: str) -> UserError:
    return UserError(f"{path} is not a valid GGUF file: {reason}; {fix}")


def _map(path: Path, mode: Literal["r", "c"], fix: str) -> np.memmap:
    if path.exists() and not path.is_file():
        # Opening a named pipe would wait for a writer that may never come.
        raise UserError(f"{path} is not a regular file; give the path of a GGUF file")
    try:
        return np.memmap(path, mode=mode)
    except ValueError as exc:  # an empty file
        raise _invalid(path, exc, fix) from None
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or exc})") from None


def _scan(path: Path, mapped: np.memmap, fix: str, model: bool = False) -> Layout:
    """The file's layout; for a `model` whose keys name an architecture we do not run, a scan that fails after them
    says that (a newer format's tensor types, another model's keys) rather than calling the file damaged."""
    view = memoryview(mapped).cast("B")
    try:
        return scan_layout(view)
    except ValueError as exc:  # a LayoutError, or any other the bytes provoke: one line either way
        named = exc.architecture if isinstance(exc, LayoutError) else None
        if model and named is not None and named not in ARCHITECTURES:
            raise unsupported_architecture(named, path) from None
        raise _invalid(path, exc, fix) from None
    finally:
        view.release()


def check_layout(path: Path, fix: str = MODEL_FIX) -> Layout:
    """The file's layout, every byte of its header checked (qinfer.formats.gguf_layout) before any reader trusts it."""
    return _scan(path, _map(path, "r", fix), fix)


def open_gguf(path: Path, mode: Literal["r", "c"] = "r", fix: str = MODEL_FIX) -> GGUFFile:
    """Memory-map a GGUF or PowerInfer GGUF whose layout has been checked; one clear error for a missing, truncated,
    corrupt or foreign file. Mode "c" maps the file copy-on-write, so that its tensors' views are writable."""
    if not path.exists():
        raise UserError(f"model file not found: {path}")
    mapped = _map(path, mode, fix)
    layout = _scan(path, mapped, fix, model=True)
    tensors = []
    for entry in layout.tensors:
        start = layout.data_start + entry.offset
        raw = mapped[start : start + entry.nbytes]
        dims = tuple(reversed(entry.ne))
        element = _ELEMENT_TYPES.get(entry.qtype)
        if element is None:
            data = raw.reshape(quant_shape_to_byte_shape(dims, entry.qtype))
        else:
            data = raw.view(element).reshape(dims)
        tensors.append(GGUFTensor(entry.name, entry.qtype, entry.ne, entry.nbytes, start, data))
    powerinfer = layout.magic == POWERINFER_MAGIC
    return GGUFFile(path, powerinfer, layout.keys, layout.alignment, layout.data_start, tuple(tensors))


def plain(value: Value) -> Any:
    """A key's value as plain Python: str, int, float, bool or a list of those."""
    return value.value.tolist() if isinstance(value.value, np.ndarray) else value.value


def metadata(reader: GGUFFile) -> dict[str, Any]:
    """All metadata keys in file order, as plain Python."""
    return {key: plain(value) for key, value in reader.keys.items()}


def tensor_entries(reader: GGUFFile) -> Entries:
    return {t.name: (t.shape, t.tensor_type) for t in reader.tensors}
