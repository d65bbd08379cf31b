"""Read GGUF and PowerInfer GGUF files through the gguf package's memory-mapped reader."""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from gguf import GGUF_MAGIC, GGUFReader

from qinfer.core.errors import UserError
from qinfer.formats.gguf_layout import Layout, scan_layout

# "PWRI" read as a little-endian u32: the first four bytes of a PowerInfer GGUF.
PWRI_MAGIC = 0x49525750


class PowerInferReader(GGUFReader):
    """A `GGUFReader` that also accepts the PWRI magic; `is_powerinfer` tells which one the file has.

    The only difference between the two formats is the magic, so the reader swaps it for GGUF's
    when it reads offset 0 and leaves every other byte to the gguf package.
    """

    is_powerinfer: bool = False

    def _get(
        self, offset: int, dtype: npt.DTypeLike, count: int = 1, override_order: None | Literal["I", "S", "<"] = None
    ) -> npt.NDArray[Any]:
        value = super()._get(offset, dtype, count, override_order)
        if offset == 0 and count == 1 and np.dtype(dtype) == np.uint32 and int(value[0]) == PWRI_MAGIC:
            self.is_powerinfer = True
            return np.array([GGUF_MAGIC], dtype=np.uint32)
        return value


MODEL_FIX = "re-download it or re-create it with `qinfer prep convert`"


def check_layout(path: Path, fix: str = MODEL_FIX) -> Layout:
    """The file's layout, every byte of its header checked (qinfer.formats.gguf_layout) before any reader trusts it."""
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
    if not path.is_file():
        raise UserError(f"model file not found: {path}")
    check_layout(path, fix)
    try:
        return PowerInferReader(path, mode)
    except (ValueError, KeyError, IndexError, OverflowError) as exc:
        raise UserError(f"{path} is not a readable GGUF file ({exc}); {fix}") from exc


def field_value(reader: GGUFReader, key: str) -> Any:
    """A metadata value as plain Python (str, int, float, bool or list of those); None when absent."""
    field = reader.get_field(key)
    return None if field is None else field.contents()


def metadata(reader: GGUFReader) -> dict[str, Any]:
    """All metadata keys in file order, without the reader's own GGUF.* header fields."""
    return {key: field_value(reader, key) for key in reader.fields if not key.startswith("GGUF.")}
