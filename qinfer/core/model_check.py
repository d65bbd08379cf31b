"""Check a model file's tensors against its family's table before they are used: a file whose header says one
shape and whose metadata says another would otherwise reach torch reshapes, or the native kernels, with sizes
that do not fit (docs/formats.md#tensors)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from qinfer.core.architectures import architecture
from qinfer.core.errors import UserError
from qinfer.core.model_spec import ModelSpec
from qinfer.core.names import Key, Tensor, tensor_name

# Types a model tensor may have; 1-D tensors (norms, biases) only F32, as the engine reads them.
MATRIX_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q8_0,
)

Entries = Mapping[str, tuple[tuple[int, ...], GGMLQuantizationType]]  # name -> (ggml ne, type)


def predictor_ranks(spec: ModelSpec, entries: Entries, path: Path) -> list[int]:
    """P per layer, read from the fc1 tensors (ne [E, P])."""
    ranks = []
    for i in range(spec.layers):
        fc1 = entries.get(tensor_name(Tensor.FC1, i))
        if fc1 is None or len(fc1[0]) != 2:
            raise UserError(f"{path} has no 2-D {tensor_name(Tensor.FC1, i)}; convert it with its predictor directory")
        ranks.append(fc1[0][1])
    return ranks


def gate_thresholds(spec: ModelSpec, meta: Mapping[str, Any], path: Path) -> list[float] | None:
    """A calibrated model's per-layer thresholds on |act(gate)| (Key.GATE_THRESHOLDS), checked; None where the file
    has none."""
    values = meta.get(Key.GATE_THRESHOLDS)
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != spec.layers:
        raise UserError(
            f"{path}: {Key.GATE_THRESHOLDS} must hold one threshold per layer ({spec.layers}); re-convert it"
        )
    if not all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in values):
        raise UserError(f"{path}: {Key.GATE_THRESHOLDS} holds a negative or non-finite value; re-convert it")
    return [float(v) for v in values]


def check_model(
    spec: ModelSpec, powerinfer: bool, entries: Entries, meta: Mapping[str, Any], path: Path
) -> list[float] | None:
    """Exactly the tensors the family's table names for this spec, each with that shape and a type we compute with,
    and special token ids inside the vocabulary. An extra tensor is refused as llama.cpp's loader refuses one: a
    block count lowered by one would otherwise run a model with a layer silently missing. Returns the file's gate
    thresholds (gate_thresholds), which decide its layout."""
    thresholds = gate_thresholds(spec, meta, path)
    # A calibrated model's file has the PowerInfer layout, and predictors only where some were trained for it.
    predicted = powerinfer and (thresholds is None or tensor_name(Tensor.FC1, 0) in entries)
    ranks = predictor_ranks(spec, entries, path) if predicted else None
    expected = architecture(spec.arch).tensors(spec, ranks, row_layout=powerinfer)
    output = tensor_name(Tensor.OUTPUT)
    if architecture(spec.arch).output_optional and output not in entries:
        del expected[output]
    rope_freqs = tensor_name(Tensor.ROPE_FREQS)
    if rope_freqs in entries and spec.rope_dim:
        expected[rope_freqs] = (spec.rope_dim // 2,)  # a scaled rope's divisors, which only the file knows of
    missing = [name for name in expected if name not in entries]
    if missing:
        raise UserError(f"{path} lacks {len(missing)} tensors of a {spec.arch} model ({missing[0]} ...); re-convert it")
    # The engine's OPT converter also writes a checkpoint's tied lm_head as output.weight, which nothing reads.
    unread = {tensor_name(Tensor.OUTPUT)} if architecture(spec.arch).output_is_embedding else set()
    extra = [name for name in entries if name not in expected and name not in unread]
    if extra:
        raise UserError(f"{path} has {len(extra)} tensors a {spec.arch} model of its shape lacks ({extra[0]} ...)")
    threshold = meta.get(Key.SPARSE_THRESHOLD, 0.0)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold):
        raise UserError(f"{path}: {Key.SPARSE_THRESHOLD} is {threshold!r}, not a finite number; re-convert it")
    # BOS and EOS are the ids the runtime uses; llama.cpp, too, only warns about the other special ids and ignores
    # one outside the vocabulary, so such a file from another converter stays readable.
    for key in (Key.BOS_ID, Key.EOS_ID):
        value = meta.get(key)
        if value is not None and spec.vocab_size and not 0 <= value < spec.vocab_size:
            raise UserError(f"{path}: {key} is {value}, outside the vocabulary of {spec.vocab_size}; re-convert it")
    for name, shape in expected.items():
        ne, qtype = entries[name]
        if ne != tuple(reversed(shape)):
            raise UserError(
                f"{path}: {name} has shape {list(ne)} but the metadata implies {list(reversed(shape))}; "
                "the file is corrupt, re-convert it"
            )
        allowed = MATRIX_TYPES if len(shape) > 1 else (GGMLQuantizationType.F32,)
        if qtype not in allowed:
            raise UserError(f"{path}: {name} is {qtype.name}, which a {len(shape)}-D tensor may not be; re-convert it")
    return thresholds
