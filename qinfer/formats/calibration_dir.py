"""Read and write a calibration directory's thresholds: `gate_thresholds.json` beside the activation counts
(`activation_{i}.pt`, `summary.json`) that `qinfer prep calibrate` writes (docs/formats.md#calibration-directories)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from qinfer.core.errors import UserError
from qinfer.core.model_spec import ModelSpec
from qinfer.formats.atomic_file import atomic_output

THRESHOLDS_FILE = "gate_thresholds.json"


@dataclass(frozen=True)
class Calibration:
    """Per layer, the |act(gate)| below which a neuron is skipped, chosen so that `sparsity` of the (token, neuron)
    pairs of the calibration corpus fall below it."""

    activation: str
    sparsity: float
    tokens: int
    thresholds: list[float]
    # The calibrated model's architecture and shape, so that thresholds never go into another model's file; None
    # in a directory written before they were recorded.
    arch: str | None = None
    hidden: int | None = None
    ffn: int | None = None
    vocab: int | None = None  # what tells Llama-3-8B from Mistral-7B, both llama models of the same shape


def write_calibration(directory: Path, calibration: Calibration) -> Path:
    path = directory / THRESHOLDS_FILE
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(asdict(calibration), indent=2) + "\n", encoding="utf-8")
    return path


def read_calibration(directory: Path, spec: ModelSpec) -> Calibration:
    """The thresholds of `directory`, checked to be one finite, non-negative number per layer of the model `spec`
    describes, and calibrated on a model of its architecture, shape and activation."""
    path = directory / THRESHOLDS_FILE
    fix = "calibrate the model with `qinfer prep calibrate`"
    if not path.is_file():
        raise UserError(f"{path} not found; {fix}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        calibration = Calibration(
            str(raw["activation"]),
            float(raw["sparsity"]),
            int(raw["tokens"]),
            [float(t) for t in raw["thresholds"]],
            None if raw.get("arch") is None else str(raw["arch"]),
            *(None if raw.get(key) is None else int(raw[key]) for key in ("hidden", "ffn", "vocab")),
        )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path} is not a calibration file ({exc}); {fix}") from None
    # What the calibration recorded of its model (a directory written before the model was recorded has only the
    # layer count and activation) against this model.
    compared = {
        "architecture": (calibration.arch, spec.arch),
        "layers": (len(calibration.thresholds), spec.layers),
        "hidden size": (calibration.hidden, spec.hidden),
        "neurons per layer": (calibration.ffn, spec.ffn),
        "vocabulary": (calibration.vocab, spec.vocab_size),
        "activation": (calibration.activation, spec.activation or "the family's own"),
    }
    differ = [f"{name} {theirs}, this model {ours}" for name, (theirs, ours) in compared.items()
              if theirs is not None and theirs != ours]  # fmt: skip
    if differ:
        raise UserError(f"{path} is from another model ({'; '.join(differ)}); {fix}")
    if not all(math.isfinite(t) and t >= 0 for t in calibration.thresholds):
        raise UserError(f"{path} holds a negative or non-finite threshold; {fix}")
    return calibration
