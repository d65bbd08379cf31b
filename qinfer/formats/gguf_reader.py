"""Read GGUF and PowerInfer GGUF files through the gguf package's memory-mapped reader."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from gguf import GGUF_MAGIC, GGUFReader

from qinfer.core.errors import UserError
from qinfer.formats.gguf_layout import ENGINE_INTEGER_TYPES, POWERINFER_MAGIC, Layout, scan_layout

# The PWRI magic read as a little-endian u32, as the gguf package reads the first four bytes.
PWRI_MAGIC = int.from_bytes(POWERINFER_MAGIC, "little")


class PowerInferReader(GGUFReader):
    """A `GGUFReader` that also reads PowerInfer GGUFs; `is_powerinfer` tells which magic the file has.

    A PowerInfer GGUF differs in its magic and in the codes of integer tensors (the engine's, which today's gguf
    takes for i-quants: gguf_layout.ENGINE_INTEGER_TYPES). The reader answers GGUF's magic at offset 0 and today's
    code at each such tensor's type field (`layout`, the checked scan, says where those are), and leaves every
    other byte to the gguf package.
    """

    is_powerinfer: bool = False

    def __init__(self, path: Path, mode: Literal["r", "c"], layout: Layout):
        integer_types = set(ENGINE_INTEGER_TYPES.values())
        self._codes = {t.type_at: t.qtype.value for t in layout.tensors if t.qtype in integer_types}
        super().__init__(path, mode)

    def _get(
        self, offset: int, dtype: npt.DTypeLike, count: int = 1, override_order: None | Literal["I", "S", "<"] = None
    ) -> npt.NDArray[Any]:
        value = super()._get(offset, dtype, count, override_order)
        if count != 1 or np.dtype(dtype) != np.uint32:
            return value
        if offset == 0 and int(value[0]) == PWRI_MAGIC:
            self.is_powerinfer = True
            return np.array([GGUF_MAGIC], dtype=np.uint32)
        return np.array([self._codes[offset]], dtype=np.uint32) if offset in self._codes else value


MODEL_FIX = "re-download it or re-create it with `qinfer prep convert`"


def check_layout(path: Path, fix: str = MODEL_FIX) -> Layout:
    """The file's layout, every byte of its header checked (qinfer.formats.gguf_layout) before any reader trusts it."""
    if path.exists() and not path.is_file():
        # Opening a named pipe would wait for a writer that may never come.
        raise UserError(f"{path} is not a regular file; give the path of a GGUF file")
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return scan_layout(view)
            finally:
                view.release()
    except ValueError as exc:  # LayoutError, and mmap's refusal of an empty file
        raise UserError(f"{path} is not a valid GGUF file: {exc}; {fix}") from None
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror or exc})") from None


def open_gguf(path: Path, mode: Literal["r", "c"] = "r", fix: str = MODEL_FIX) -> PowerInferReader:
    """Memory-map a GGUF or PowerInfer GGUF whose layout has been checked; one clear error for a missing, truncated,
    corrupt or foreign file."""
    if not path.exists():
        raise UserError(f"model file not found: {path}")
    layout = check_layout(path, fix)
    try:
        return PowerInferReader(path, mode, layout)
    except (ValueError, KeyError, IndexError, OverflowError) as exc:
        raise UserError(f"{path} is not a readable GGUF file ({exc}); {fix}") from exc


def field_value(reader: GGUFReader, key: str) -> Any:
    """A metadata value as plain Python (str, int, float, bool or list of those); None when absent."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """All metadata keys in file order, without the reader's own GGUF.* header fields."""
    return {key: field_value(reader, key) for key in reader.fields if not key.startswith("GGUF.")}
