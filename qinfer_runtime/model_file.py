"""Open a (PowerInfer or dense) GGUF model: hyper-parameters, and its tensors as torch views of the mapped file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from qinfer_core.errors import UserError
from qinfer_core.gguf_reader import PowerInferReader, metadata, open_gguf
from qinfer_runtime.quant_rows import QUANTIZED_TYPES, QuantizedMatrix

SUPPORTED_ARCHS = ("llama", "bamboo", "falcon")
SPARSE_THRESHOLD_KEY = "powerinfer.sparse_threshold"
_TORCH_TYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16}
# Quantized matrices stay raw blocks (the native kernels read them as they are; elsewhere rows are expanded as
# they are used), except the token embedding, which is looked up row by row and so expanded once, at load.
_EXPANDED_AT_LOAD = "token_embd.weight"


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    context_length: int
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    rope_dim: int
    rms_eps: float
    rope_theta: float
    sparse_threshold: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class ModelFile:
    path: Path
    config: ModelConfig
    powerinfer: bool
    metadata: dict[str, Any]
    tensors: dict[str, torch.Tensor | QuantizedMatrix]

    def tensor(self, name: str) -> torch.Tensor | QuantizedMatrix:
        try:
            return self.tensors[name]
        except KeyError:
            raise UserError(f"{self.path} has no tensor {name!r}; was it converted by an older tool?") from None


def _config(meta: dict[str, Any], path: Path) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UserError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UserError(f"{path} lacks the metadata key {arch}.{name}; re-convert it")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens")
    return ModelConfig(
        arch=arch,
        vocab_size=len(tokens) if tokens is not None else 0,
        context_length=int(key("context_length")),
        hidden=hidden,
        layers=int(key("block_count")),
        ffn=int(key("feed_forward_length")),
        heads=heads,
        kv_heads=int(key("attention.head_count_kv", heads)),
        rope_dim=int(key("rope.dimension_count", hidden // heads)),
        # Falcon's norms are LayerNorms; the field holds whichever epsilon the architecture's norms use.
        rms_eps=float(key("attention.layer_norm_epsilon" if arch == "falcon" else "attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        sparse_threshold=float(meta.get(SPARSE_THRESHOLD_KEY, 0.0)),
    )


def _tensors(reader: PowerInferReader, path: Path) -> dict[str, torch.Tensor | QuantizedMatrix]:
    tensors: dict[str, torch.Tensor | QuantizedMatrix] = {}
    for t in reader.tensors:
        if t.tensor_type in QUANTIZED_TYPES:
            tensors[t.name] = (
                torch.from_numpy(dequantize(t.data, t.tensor_type))
                if t.name == _EXPANDED_AT_LOAD
                else QuantizedMatrix(torch.from_numpy(t.data), t.tensor_type)
            )
            continue
        dtype = _TORCH_TYPES.get(t.tensor_type)
        if dtype is None:
            raise UserError(
                f"{path}: tensor {t.name} is {t.tensor_type.name}; this runtime reads F32, F16, Q4_0 and Q8_0 files"
            )
        # The reader maps the file copy-on-write, so these views share its pages instead of copying them.
        tensors[t.name] = torch.from_numpy(t.data)
    return tensors


def open_model(path: Path) -> ModelFile:
    reader = open_gguf(path, mode="c")
    meta = metadata(reader)
    model = ModelFile(path, _config(meta, path), reader.is_powerinfer, meta, _tensors(reader, path))
    if model.config.vocab_size == 0:
        raise UserError(f"{path} has no tokenizer.ggml.tokens; convert it with its tokenizer")
    return model
