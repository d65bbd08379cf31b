"""Stream tensors into a GGUF or PowerInfer GGUF with the gguf package's writer, one tensor in memory at a time."""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from qinfer.core.names import Key
from qinfer.formats.atomic_file import atomic_output
from qinfer.formats.gguf_layout import ENGINE_INTEGER_TYPES, POWERINFER_MAGIC, Layout, LayoutError, scan_layout
from qinfer.formats.gguf_reader import GGUFFile, plain


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: its header entry is known up front, its data is produced only when written.

    `shape` is the numpy shape (outermost first; the file stores it reversed, as ggml's ne).
    For quantized types `shape` is the byte shape and `raw_type` the ggml type, as `GGUFWriter` expects.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    load: Callable[[], np.ndarray]
    raw_type: GGMLQuantizationType | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def copy_metadata(reader: GGUFFile, writer: GGUFWriter, skip: Collection[str] = ()) -> None:
    """Every key of `reader` as it is, but the architecture (which the writer sets itself) and `skip`; its alignment
    as the writer's own."""
    for key, value in reader.keys.items():
        if key not in (Key.ARCHITECTURE, Key.ALIGNMENT, *skip):
            writer.add_key_value(key, plain(value), value.kind, sub_type=value.item)
    if Key.ALIGNMENT in reader.keys:
        writer.add_custom_alignment(reader.alignment)


def write_gguf(
    path: Path,
    arch: str,
    add_metadata: Callable[[GGUFWriter], None],
    tensors: Sequence[TensorPlan],
    *,
    powerinfer: bool,
    on_tensor: Callable[[TensorPlan], None] | None = None,
) -> None:
    """Write `tensors` in order after the metadata that `add_metadata` adds; PWRI magic when `powerinfer`.

    The header and tensor table go first, then each tensor is loaded, checked against its plan,
    written and dropped, so peak memory is one tensor however large the model is.
    """
    with atomic_output(path) as tmp:
        writer = GGUFWriter(tmp, arch)
        try:
            add_metadata(writer)
            for plan in tensors:
                writer.add_tensor_info(plan.name, plan.shape, plan.dtype, plan.nbytes, raw_dtype=plan.raw_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for plan in tensors:
                data = np.ascontiguousarray(plan.load())
                if data.shape != plan.shape or data.dtype != plan.dtype:
                    raise ValueError(
                        f"{plan.name}: produced {data.dtype}{list(data.shape)}, planned {plan.dtype}{list(plan.shape)}"
                    )
                writer.write_tensor_data(data)
                del data
                if on_tensor is not None:
                    on_tensor(plan)
        finally:
            writer.close()
        layout = _written_layout(tmp)
        if powerinfer:
            _make_powerinfer(tmp, layout)


# Free space under which a file that came out short is taken to have met a full disk.
_NEARLY_FULL = 1 << 20


def _written_layout(path: Path) -> Layout:
    """The layout of the file just written, which must hold every byte its header promises: numpy's tofile loses a
    write the disk refuses at its last flush, and the file then ends early (a .gpuidx on a nearly full disk) where
    every call reported success. That is a full disk (an OSError the output's disk_errors words), or else a fault of
    this writer (raised as it is)."""
    view = memoryview(np.memmap(path, mode="r")).cast("B")
    try:
        return scan_layout(view)
    except LayoutError as exc:
        disk = os.statvfs(path.parent)
        if disk.f_bavail * disk.f_frsize < _NEARLY_FULL:
            raise OSError(errno.ENOSPC, f"{path.name} came out short: {exc}") from exc
        raise
    finally:
        view.release()


def _make_powerinfer(path: Path, layout: Layout) -> None:
    """Turn the GGUF at `path` into a PowerInfer GGUF in place: the PWRI magic and, for its integer tensors (a
    .gpuidx's), their type codes as the engine numbers them (qinfer.formats.gguf_layout's ENGINE_INTEGER_TYPES), the
    only ones it reads."""
    engine_codes = {qtype: code for code, qtype in ENGINE_INTEGER_TYPES.items()}
    tensors = layout.tensors
    with open(path, "r+b") as fh:
        for tensor in tensors:
            if tensor.qtype in engine_codes:
                fh.seek(tensor.type_at)
                fh.write(struct.pack("<I", engine_codes[tensor.qtype]))
        fh.seek(0)
        fh.write(POWERINFER_MAGIC)
