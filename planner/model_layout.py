"""What the planner needs to know about a model: bytes and weights of each part, from a GGUF or from a shape."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qinfer_core.errors import UserError
from qinfer_core.gguf_reader import field_value, open_gguf

FFN_TENSORS = ("ffn_gate", "ffn_up", "ffn_down_t", "ffn_down")
PREDICTOR_TENSORS = ("fc1", "fc2")
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)\.")


@dataclass(frozen=True)
class LayerLayout:
    """One transformer block; a neuron is one row of each FFN matrix."""

    ffn_neurons: int
    neuron_bytes: float
    neuron_weights: int
    predictor_bytes: int
    predictor_weights: int
    attention_bytes: int
    attention_weights: int


@dataclass(frozen=True)
class ModelLayout:
    arch: str
    embedding: int
    heads: int
    kv_heads: int
    layers: tuple[LayerLayout, ...]
    output_bytes: int
    output_weights: int
    embedding_bytes: int
    ffn_type: str
    ffn_element_bytes: float
    has_gate: bool
    # Tokens of context the model was trained for; 0 when unknown (a layout made from a bare shape).
    context_length: int = 0

    @property
    def head_dim(self) -> int:
        return self.embedding // self.heads

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def read_model_layout(path: Path) -> ModelLayout:
    """Sizes of a PowerInfer GGUF's tensors, grouped into FFN neurons, predictors, attention, output, embeddings."""
    reader = open_gguf(path)
    if not reader.is_powerinfer:
        raise UserError(f"{path} is a dense GGUF; plan a PowerInfer one (`qinfer prep convert` with a predictor dir)")
    arch = str(field_value(reader, "general.architecture"))
    embedding = int(field_value(reader, f"{arch}.embedding_length"))
    heads = int(field_value(reader, f"{arch}.attention.head_count"))
    kv_heads = int(field_value(reader, f"{arch}.attention.head_count_kv") or heads)
    context_length = int(field_value(reader, f"{arch}.context_length") or 0)
    per_layer: dict[int, dict[str, list[tuple[int, int, int]]]] = defaultdict(lambda: defaultdict(list))
    output_bytes = output_weights = embedding_bytes = 0
    ffn_type = ""
    ffn_element_bytes = 0.0
    has_gate = False
    for tensor in reader.tensors:
        n_bytes, n_weights = int(tensor.n_bytes), int(tensor.n_elements)
        match = _BLOCK.match(tensor.name)
        if match is None:
            if tensor.name.startswith("token_embd."):
                embedding_bytes += n_bytes
            else:
                output_bytes += n_bytes
                output_weights += n_weights
            continue
        layer, part = int(match.group(1)), match.group(2)
        kind = "ffn" if part in FFN_TENSORS else "predictor" if part in PREDICTOR_TENSORS else "attention"
        neurons = int(tensor.shape[-1]) if part in ("ffn_gate", "ffn_up", "ffn_down_t") else int(tensor.shape[0])
        per_layer[layer][kind].append((n_bytes, n_weights, neurons))
        if part == "ffn_up":
            ffn_type = GGMLQuantizationType(tensor.tensor_type).name
            ffn_element_bytes = n_bytes / n_weights
        has_gate = has_gate or part == "ffn_gate"
    if not per_layer or sorted(per_layer) != list(range(len(per_layer))):
        raise UserError(f"{path} has no complete run of blk.N tensors; re-convert it with `qinfer prep convert`")
    layers = []
    for index in range(len(per_layer)):
        parts = per_layer[index]
        if not parts["ffn"] or not parts["predictor"]:
            raise UserError(f"{path}: layer {index} lacks FFN or predictor tensors; re-convert it with a predictor dir")
        neurons = {n for _, _, n in parts["ffn"]}
        if len(neurons) != 1:
            raise UserError(f"{path}: layer {index} FFN tensors disagree on the neuron count {sorted(neurons)}")
        f = neurons.pop()
        layers.append(
            LayerLayout(
                ffn_neurons=f,
                neuron_bytes=sum(b for b, _, _ in parts["ffn"]) / f,
                neuron_weights=sum(w for _, w, _ in parts["ffn"]) // f,
                predictor_bytes=sum(b for b, _, _ in parts["predictor"]),
                predictor_weights=sum(w for _, w, _ in parts["predictor"]),
                attention_bytes=sum(b for b, _, _ in parts["attention"]),
                attention_weights=sum(w for _, w, _ in parts["attention"]),
            )
        )
    return ModelLayout(
        arch=arch,
        embedding=embedding,
        heads=heads,
        kv_heads=kv_heads,
        layers=tuple(layers),
        output_bytes=output_bytes,
        output_weights=output_weights,
        embedding_bytes=embedding_bytes,
        ffn_type=ffn_type,
        ffn_element_bytes=ffn_element_bytes,
        has_gate=has_gate,
        context_length=context_length,
    )


def weight_bytes(n_weights: int, type_name: str) -> float:
    """Bytes of `n_weights` weights stored as ggml type `type_name` (Q4_0: 18 bytes per 32)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return n_weights * size / block


def layout_for_shape(
    *,
    arch: str,
    layers: int,
    embedding: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    predictor_rank: int,
    weight_type: str = "F16",
) -> ModelLayout:
    """The layout a converted model of this shape would have: 2-D tensors of `weight_type`, norms F32."""
    kv = embedding // heads * kv_heads
    gated = arch != "falcon"
    matrices = (3 if gated else 2) * embedding
    attention_weights = embedding * embedding * 2 + 2 * embedding * kv
    norms = 2 * embedding * 4
    predictor_weights = embedding * predictor_rank + predictor_rank * ffn
    layer = LayerLayout(
        ffn_neurons=ffn,
        neuron_bytes=weight_bytes(matrices, weight_type),
        neuron_weights=matrices,
        predictor_bytes=round(weight_bytes(predictor_weights, weight_type)),
        predictor_weights=predictor_weights,
        attention_bytes=round(weight_bytes(attention_weights, weight_type)) + norms,
        attention_weights=attention_weights + 2 * embedding,
    )
    return ModelLayout(
        arch=arch,
        embedding=embedding,
        heads=heads,
        kv_heads=kv_heads,
        layers=(layer,) * layers,
        output_bytes=round(weight_bytes(embedding * vocab, weight_type)) + embedding * 4,
        output_weights=embedding * vocab + embedding,
        embedding_bytes=round(weight_bytes(embedding * vocab, weight_type)),
        ffn_type=weight_type,
        ffn_element_bytes=weight_bytes(1 << 10, weight_type) / (1 << 10),
        has_gate=gated,
    )
