"""Open a (PowerInfer or dense) GGUF model: hyper-parameters, and its tensors as torch views of the mapped file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf.quants import dequantize

from qinfer.core.errors import UserError
from qinfer.core.model_check import check_model
from qinfer.core.model_spec import ModelSpec
from qinfer.core.names import Key, Tensor, tensor_name
from qinfer.core.spec_readers import spec_from_metadata
from qinfer.formats.gguf_reader import GGUFFile, metadata, open_gguf, tensor_entries
from qinfer.runtime.kernels.quant_rows import QUANTIZED_TYPES, QuantizedMatrix

# Quantized matrices stay raw blocks (the native kernels read them as they are; elsewhere rows are expanded as
# they are used), except the embedding tables, which are looked up row by row and so expanded once, at load.
_EXPANDED_AT_LOAD = (tensor_name(Tensor.TOKEN_EMBD), tensor_name(Tensor.POSITION_EMBD))


@dataclass
class ModelFile:
    path: Path
    config: ModelSpec
    powerinfer: bool
    sparse_threshold: float  # powerinfer.sparse_threshold; the engine's default 0.0 when absent
    gate_thresholds: list[float] | None  # a calibrated model's, per layer (Key.GATE_THRESHOLDS); None: uncalibrated
    metadata: dict[str, Any]
    tensors: dict[str, torch.Tensor | QuantizedMatrix]

    def tensor(self, name: str) -> torch.Tensor | QuantizedMatrix:
        try:
            return self.tensors[name]
        except KeyError:
            raise UserError(f"{self.path} has no tensor {name!r}; was it converted by an older tool?") from None


def _tensors(reader: GGUFFile) -> dict[str, torch.Tensor | QuantizedMatrix]:
    tensors: dict[str, torch.Tensor | QuantizedMatrix] = {}
    for t in reader.tensors:
        if t.tensor_type in QUANTIZED_TYPES:
            tensors[t.name] = (
                torch.from_numpy(dequantize(t.data, t.tensor_type))
                if t.name in _EXPANDED_AT_LOAD
                else QuantizedMatrix(torch.from_numpy(t.data), t.tensor_type)
            )
            continue
        # F32 or F16, the only other types check_model lets through. The reader maps the file copy-on-write, so
        # these views share its pages instead of copying them.
        tensors[t.name] = torch.from_numpy(t.data)
    return tensors


def open_model(path: Path) -> ModelFile:
    reader = open_gguf(path, mode="c")
    meta = metadata(reader)
    spec = spec_from_metadata(meta, path, reader.is_powerinfer)
    if spec.vocab_size == 0:
        raise UserError(f"{path} has no {Key.TOKENS}; convert it with its tokenizer")
    thresholds = check_model(spec, reader.is_powerinfer, tensor_entries(reader), meta, path)
    threshold = float(meta.get(Key.SPARSE_THRESHOLD, 0.0))  # checked finite by check_model
    return ModelFile(path, spec, reader.is_powerinfer, threshold, thresholds, meta, _tensors(reader))
