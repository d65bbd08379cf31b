"""What the planner needs to know about a model: bytes and weights of each part, from a GGUF or from a shape."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from qinfer.core.architectures import architecture
from qinfer.core.errors import UserError
from qinfer.core.model_check import check_model
from qinfer.core.model_spec import ModelSpec
from qinfer.core.names import (
    EXPERT_STACKS,
    FFN_ROWS,
    PREDICTOR,
    WEIGHT,
    Key,
    Tensor,
    split_tensor_name,
    tensor_name,
)
from qinfer.core.spec_readers import spec_from_metadata
from qinfer.formats.activation_files import Unit
from qinfer.formats.gguf_reader import metadata, open_gguf, tensor_entries


@dataclass(frozen=True)
class LayerLayout:
    """One transformer block as the planner places it: `ffn_neurons` units, each a neuron (one row of each FFN
    matrix) or, in a mixture, one expert (its slices of the stacked expert matrices). "Attention" is the layer's
    dense part, which runs for every token: attention and norms, and a mixture's router and shared expert."""

    ffn_neurons: int
    neuron_bytes: float
    neuron_weights: int
    predictor_bytes: int
    predictor_weights: int
    attention_bytes: int
    attention_weights: int


@dataclass(frozen=True)
class ModelLayout:
    spec: ModelSpec
    layers: tuple[LayerLayout, ...]
    output_bytes: int
    output_weights: int
    embedding_bytes: int
    ffn_type: str
    ffn_element_bytes: float

    @property
    def has_gate(self) -> bool:
        return architecture(self.spec.arch).ffn.gated

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def unit(self) -> Unit:
        """What the planner places: FFN neurons, or a mixture's experts whole."""
        return "neuron" if self.spec.experts is None else "expert"

    @property
    def ffn_width(self) -> int:
        """FFN activations one token holds at once: F, or those of the experts it chooses and the shared one."""
        experts = self.spec.experts
        if experts is None:
            return max(layer.ffn_neurons for layer in self.layers)
        return experts.used * experts.ffn + experts.shared_ffn


def _classify(name: str) -> tuple[int, str] | None:
    """(layer, "ffn" | "predictor" | "attention") of a block tensor; None for the embedding, output and norms
    outside the blocks. Only per-unit FFN tensors count as "ffn": down's bias (a vector of E) is dense, and so are a
    mixture's router and shared expert, which every token runs."""
    parts = split_tensor_name(name)
    if parts is None or parts[0] is None:
        return None
    layer, part, kind = parts
    if part in PREDICTOR:
        return layer, "predictor"
    if part in EXPERT_STACKS or (part in FFN_ROWS and (kind == WEIGHT or part == Tensor.FFN_UP)):
        return layer, "ffn"
    return layer, "attention"


def _layer_layout(
    path: Path, index: int, parts: dict[str, list[tuple[int, int]]], units: int, needs_predictor: bool
) -> LayerLayout:
    if not parts["ffn"] or (needs_predictor and not parts["predictor"]):
        raise UserError(f"{path}: layer {index} lacks FFN or predictor tensors; re-convert it with a predictor dir")
    if any(w % units for _, w in parts["ffn"]):
        raise UserError(f"{path}: layer {index} has FFN tensors that are not {units} units; re-convert it")
    return LayerLayout(
        ffn_neurons=units,
        neuron_bytes=sum(b for b, _ in parts["ffn"]) / units,
        neuron_weights=sum(w for _, w in parts["ffn"]) // units,
        predictor_bytes=sum(b for b, _ in parts["predictor"]),
        predictor_weights=sum(w for _, w in parts["predictor"]),
        attention_bytes=sum(b for b, _ in parts["attention"]),
        attention_weights=sum(w for _, w in parts["attention"]),
    )


def read_model_layout(path: Path) -> ModelLayout:
    """Sizes of a PowerInfer GGUF's tensors, grouped into FFN neurons, predictors, attention, output, embeddings; or
    of a dense GGUF with experts, whose unit is one expert and which has no predictors."""
    reader = open_gguf(path)
    meta = metadata(reader)
    spec = spec_from_metadata(meta, path, reader.is_powerinfer)
    if not reader.is_powerinfer and spec.experts is None:
        raise UserError(
            f"{path} is a dense GGUF; plan a PowerInfer one "
            "(`qinfer prep convert` with a PREDICTOR_DIR or --calibration DIR) or one with experts"
        )
    check_model(spec, reader.is_powerinfer, tensor_entries(reader), meta, path)
    per_layer: dict[int, dict[str, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    output_bytes = output_weights = embedding_bytes = 0
    names = {tensor.name for tensor in reader.tensors}
    ffn_type = ""
    ffn_element_bytes = 0.0
    up = Tensor.FFN_UP if spec.experts is None else Tensor.FFN_UP_EXPS
    for tensor in reader.tensors:
        n_bytes, n_weights = tensor.n_bytes, tensor.n_elements
        where = _classify(tensor.name)
        if where is not None:
            per_layer[where[0]][where[1]].append((n_bytes, n_weights))
            if tensor.name == tensor_name(up, where[0]):
                ffn_type = tensor.tensor_type.name
                ffn_element_bytes = n_bytes / n_weights
        elif tensor.name.startswith((Tensor.TOKEN_EMBD, Tensor.POSITION_EMBD)):
            embedding_bytes += n_bytes
            tied = architecture(spec.arch).output_is_embedding or tensor_name(Tensor.OUTPUT) not in names
            if tensor.name.startswith(Tensor.TOKEN_EMBD) and tied:
                # The head multiplies by the token embedding, so wherever the head runs it needs a copy.
                output_bytes += n_bytes
                output_weights += n_weights
        else:
            output_bytes += n_bytes
            output_weights += n_weights
    if not per_layer or sorted(per_layer) != list(range(len(per_layer))):
        raise UserError(f"{path} has no complete run of blk.N tensors; re-convert it with `qinfer prep convert`")
    # A calibrated model's gate selects its neurons, and a mixture's router its experts: neither needs a predictor.
    needs_predictor = spec.experts is None and Key.GATE_THRESHOLDS not in meta
    units = spec.ffn if spec.experts is None else spec.experts.count
    return ModelLayout(
        spec=spec,
        layers=tuple(_layer_layout(path, i, per_layer[i], units, needs_predictor) for i in range(len(per_layer))),
        output_bytes=output_bytes,
        output_weights=output_weights,
        embedding_bytes=embedding_bytes,
        ffn_type=ffn_type,
        ffn_element_bytes=ffn_element_bytes,
    )


def weight_bytes(n_weights: int, type_name: str) -> float:
    """Bytes of `n_weights` weights stored as ggml type `type_name` (Q4_0: 18 bytes per 32)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return n_weights * size / block


def layout_for_spec(spec: ModelSpec, predictor_rank: int = 0, weight_type: str = "F16") -> ModelLayout:
    """The layout a converted model of this shape would have: 2-D tensors of `weight_type`, norms F32; a mixture
    (`spec.experts`) as convert-dense writes it, its experts stacked, routers F32 and no predictor."""
    embedding, kv, vocab = spec.hidden, spec.kv_dim, spec.vocab_size
    experts = spec.experts
    if experts is not None and predictor_rank:
        raise ValueError("a mixture of experts has no predictor; pass predictor_rank 0")
    attention_weights = 2 * embedding * spec.q_dim + 2 * embedding * kv
    norms = 2 * embedding * 4
    routers = shared = 0
    if experts is None:
        units, unit_weights = spec.ffn, architecture(spec.arch).ffn.matrices * embedding
    else:
        units, unit_weights = experts.count, 3 * embedding * experts.ffn
        # The shared expert's gate is a router too: one row of E, F32 like the experts' router.
        routers = (experts.count + (1 if experts.shared_ffn else 0)) * embedding
        shared = 3 * embedding * experts.shared_ffn
    predictor_weights = embedding * predictor_rank + predictor_rank * units
    layer = LayerLayout(
        ffn_neurons=units,
        neuron_bytes=weight_bytes(unit_weights, weight_type),
        neuron_weights=unit_weights,
        predictor_bytes=round(weight_bytes(predictor_weights, weight_type)),
        predictor_weights=predictor_weights,
        attention_bytes=round(weight_bytes(attention_weights + shared, weight_type)) + norms + routers * 4,
        attention_weights=attention_weights + shared + routers + 2 * embedding,
    )
    return ModelLayout(
        spec=spec,
        layers=(layer,) * spec.layers,
        output_bytes=round(weight_bytes(embedding * vocab, weight_type)) + embedding * 4,
        output_weights=embedding * vocab + embedding,
        embedding_bytes=round(weight_bytes(embedding * vocab, weight_type)),
        ffn_type=weight_type,
        ffn_element_bytes=weight_bytes(1 << 10, weight_type) / (1 << 10),
    )
