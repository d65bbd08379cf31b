"""Quantize a GGUF or PowerInfer GGUF to Q4_0 or Q8_0, one tensor at a time, keeping the input's magic.

Type rules (as PowerInfer's quantize applies them): every 2-D `*.weight` (fc1, fc2 and ffn_down_t included)
gets the chosen type; `output.weight` always gets Q8_0, which the engine itself picks when E % 256 != 0 or for
falcon, and which we use for every model rather than the engine's Q6_K, that gguf cannot write; 1-D tensors
stay F32. A mixture of experts' stacks [N, rows, E] get the chosen type as llama.cpp's llama-quantize writes them,
each row of each expert in blocks along its last axis; its routers stay F32 (llama-quantize leaves
`ffn_gate_inp` unquantized; we keep the shared expert's gate so too, a [1, E] row too small to matter).
A row whose length is not a multiple of 32 cannot be split into blocks, so that tensor stays F16 (for example a
predictor of width P not a multiple of 32) and the result lists it. The blocks are those the engine's own quantize
writes (quant_blocks), not gguf-py's, which differ in rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quant_shape_to_byte_shape

from qinfer.core.errors import UserError
from qinfer.core.model_check import check_model
from qinfer.core.names import ROUTERS, WEIGHT, Key, Tensor, split_tensor_name, tensor_name
from qinfer.core.spec_readers import spec_from_metadata
from qinfer.formats.atomic_file import check_apart
from qinfer.formats.gguf_reader import GGUFFile, metadata, open_gguf, tensor_entries
from qinfer.formats.gguf_writer import TensorPlan, copy_metadata, write_gguf
from qinfer.prep.convert.quant_blocks import quantize_q4_0, quantize_q8_0

QType = GGMLQuantizationType
# Target name -> (type of the 2-D weights, general.file_type as llama.cpp numbers it).
TARGETS = {"Q4_0": (QType.Q4_0, 2), "Q8_0": (QType.Q8_0, 7)}
OUTPUT_TYPE = QType.Q8_0
QUANTIZATION_VERSION = 2
_FLOAT_TYPES = {QType.F32: np.dtype(np.float32), QType.F16: np.dtype(np.float16)}
_QUANTIZERS: dict[QType, Callable[[np.ndarray], np.ndarray]] = {QType.Q4_0: quantize_q4_0, QType.Q8_0: quantize_q8_0}
# Keys this tool sets itself; everything else is copied as it is.
_OWN_KEYS = (Key.FILE_TYPE, Key.QUANTIZATION_VERSION)


@dataclass(frozen=True)
class QuantizeResult:
    outfile: Path
    target: str
    tensor_count: int
    in_bytes: int
    out_bytes: int
    kept_f16: list[str]  # 2-D weights whose rows do not split into blocks of 32


def tensor_type(name: str, shape: tuple[int, ...], target: QType) -> QType:
    """The output type of a tensor of numpy shape `shape` (rows last) under the rules above."""
    named = split_tensor_name(name)
    if len(shape) == 1 or (named is not None and named[1] in ROUTERS):
        return QType.F32
    if not name.endswith(f".{WEIGHT}"):
        return QType.F16
    block_size = GGML_QUANT_SIZES[target][0]
    if shape[-1] % block_size:
        return QType.F16
    return OUTPUT_TYPE if name == tensor_name(Tensor.OUTPUT) else target


ROWS_PER_READ = 1024  # rows read and quantized at a time: a few MiB for 7B rows, whatever the tensor's size


def _read(path: Path, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    # A plain read, not the reader's memory map: mapped pages once touched stay resident for the whole run,
    # and a 7B model would end up in memory; a read buffer is freed with the tensor.
    count = int(np.prod(shape, dtype=np.int64))
    return np.fromfile(path, dtype=dtype, count=count, offset=offset).reshape(shape)


def _convert(path: Path, offset: int, src: np.dtype, shape: tuple[int, ...], out: QType) -> np.ndarray:
    if out in _FLOAT_TYPES:
        return _read(path, offset, src, shape).astype(_FLOAT_TYPES[out], copy=False)
    # Blocks never span rows, so quantizing a slice of rows at a time gives the same bytes, and only the
    # (4 to 7 times smaller) output is held whole.
    rows, width = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    result = np.empty((rows, quant_shape_to_byte_shape((width,), out)[0]), dtype=np.uint8)
    for start in range(0, rows, ROWS_PER_READ):
        n = min(ROWS_PER_READ, rows - start)
        chunk = _read(path, offset + start * width * src.itemsize, src, (n, width))
        result[start : start + n] = _QUANTIZERS[out](chunk)
    return result.reshape(quant_shape_to_byte_shape(shape, out))


def _plan(path: Path, reader: GGUFFile, target: QType) -> tuple[list[TensorPlan], list[str]]:
    plans, kept_f16 = [], []
    for t in reader.tensors:
        src = _FLOAT_TYPES.get(t.tensor_type)
        if src is None:
            raise UserError(f"{path}: tensor {t.name} is already {t.tensor_type.name}; quantize an F32 or F16 file")
        shape = tuple(reversed(t.shape))
        out = tensor_type(t.name, shape, target)
        if out == QType.F16 and len(shape) > 1 and t.name.endswith(f".{WEIGHT}"):
            kept_f16.append(t.name)
        load = partial(_convert, path, t.data_offset, src, shape, out)
        if out in _FLOAT_TYPES:
            plans.append(TensorPlan(t.name, shape, _FLOAT_TYPES[out], load))
        else:
            byte_shape = quant_shape_to_byte_shape(shape, out)
            plans.append(TensorPlan(t.name, byte_shape, np.dtype(np.uint8), load, raw_type=out))
    return plans, kept_f16


def _metadata_writer(reader: GGUFFile, file_type: int) -> Callable[[GGUFWriter], None]:
    def add(writer: GGUFWriter) -> None:
        copy_metadata(reader, writer, _OWN_KEYS)
        writer.add_file_type(file_type)
        writer.add_quantization_version(QUANTIZATION_VERSION)

    return add


def quantize_gguf(
    infile: Path,
    outfile: Path,
    target: str = "Q4_0",
    on_plan: Callable[[list[TensorPlan]], None] | None = None,
    on_tensor: Callable[[TensorPlan], None] | None = None,
) -> QuantizeResult:
    """Write `infile` quantized to `target` as `outfile` (PWRI magic kept), streaming one tensor (one layer's stack
    of experts at most) at a time."""
    if target.upper() not in TARGETS:
        raise UserError(f"unknown quantization type {target!r}; use one of {', '.join(TARGETS)}")
    target = target.upper()
    qtype, file_type = TARGETS[target]
    check_apart(outfile, {"input file": infile})
    reader = open_gguf(infile)
    # A file the runtime would refuse is refused here too, rather than passed on as a valid-looking quantized one.
    meta = metadata(reader)
    spec = spec_from_metadata(meta, infile, reader.is_powerinfer)
    check_model(spec, reader.is_powerinfer, tensor_entries(reader), meta, infile)
    plans, kept_f16 = _plan(infile, reader, qtype)
    if on_plan is not None:
        on_plan(plans)
    add_metadata = _metadata_writer(reader, file_type)
    write_gguf(outfile, spec.arch, add_metadata, plans, powerinfer=reader.is_powerinfer, on_tensor=on_tensor)
    in_bytes = sum(t.n_bytes for t in reader.tensors)
    return QuantizeResult(outfile, target, len(plans), in_bytes, sum(p.nbytes for p in plans), kept_f16)
