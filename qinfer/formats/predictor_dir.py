"""Read and write predictor directories: `model_{i}.pt` per layer and an optional `config.json`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qinfer.core.errors import UserError
from qinfer.core.json_object import read_json_object
from qinfer.core.names import Tensor, tensor_name
from qinfer.core.numbers import FLOAT32, real
from qinfer.formats.torch_files import load_torch_file

# A predictor state_dict names its two matrices as the GGUF does, without the block prefix.
FC1 = tensor_name(Tensor.FC1)
FC2 = tensor_name(Tensor.FC2)
_FIX = "fix it or train the predictors again"


@dataclass(frozen=True)
class PredictorDir:
    path: Path
    ranks: list[int]  # P per layer
    sparse_threshold: float | None

    def layer_file(self, layer: int) -> Path:
        return self.path / f"model_{layer}.pt"


def load_layer(path: Path) -> dict[str, torch.Tensor]:
    state = load_torch_file(path, "a predictor", "re-download or re-train the predictors", mmap=True)
    if not isinstance(state, dict) or not all(isinstance(state.get(k), torch.Tensor) for k in (FC1, FC2)):
        raise UserError(f"predictor {path} must be a state_dict with {FC1!r} and {FC2!r}")
    return state


def open_predictors(path: Path, layers: int, hidden: int, ffn: int) -> PredictorDir:
    """Check that every layer has a predictor of the right shape before anything is written."""
    if not path.is_dir():
        raise UserError(f"predictor directory not found: {path}")
    missing = [i for i in range(layers) if not (path / f"model_{i}.pt").is_file()]
    if missing:
        shown = ", ".join(f"model_{i}.pt" for i in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise UserError(f"{path} lacks predictors for {len(missing)} of {layers} layers ({shown})")
    ranks = []
    for i in range(layers):
        state = load_layer(path / f"model_{i}.pt")
        fc1, fc2 = tuple(state[FC1].shape), tuple(state[FC2].shape)
        if len(fc1) != 2 or fc1[1] != hidden or fc2 != (ffn, fc1[0]):
            raise UserError(
                f"{path / f'model_{i}.pt'}: fc1 {list(fc1)} / fc2 {list(fc2)} do not fit this model "
                f"(want fc1 [P, {hidden}] and fc2 [{ffn}, P]); is it the predictor of another model?"
            )
        ranks.append(fc1[0])
    return PredictorDir(path, ranks, read_threshold(path))


def read_threshold(path: Path) -> float | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    value = read_json_object(config, _FIX).get("sparse_threshold")
    # A model file keeps it as a float32 (powerinfer.sparse_threshold), which the runtime requires finite.
    return None if value is None else real(value, "sparse_threshold", config, FLOAT32, _FIX)
