"""Index the tensors of a Hugging Face checkpoint and load them one at a time.

Each load opens its file afresh and closes it afterwards: a mapping kept open for the whole run would
keep every page read so far resident, and a 70B checkpoint would then fill memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from qinfer.core.errors import UserError
from qinfer.formats.torch_files import load_torch_file


@dataclass(frozen=True)
class TensorRef:
    file: Path
    shape: tuple[int, ...]


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    state = load_torch_file(path, "a torch checkpoint", "re-save it with save_pretrained", mmap=True)
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UserError(f"{path} is not a state_dict of tensors; re-save it with save_pretrained")
    return state


def index_checkpoint(model_dir: Path) -> dict[str, TensorRef]:
    """Name -> (file, shape) for every tensor, from file headers only (safetensors preferred over .bin)."""
    files = sorted(model_dir.glob("*.safetensors"))
    refs: dict[str, TensorRef] = {}
    if files:
        for file in files:
            try:
                with safe_open(file, framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                        refs[name] = TensorRef(file, tuple(handle.get_slice(name).get_shape()))
            except (SafetensorError, OSError) as exc:
                raise UserError(f"cannot read {file} ({exc}); the download may be incomplete") from exc
        return refs
    files = sorted(model_dir.glob("pytorch_model*.bin"))
    if not files:
        raise UserError(f"no *.safetensors or pytorch_model*.bin weights in {model_dir}")
    for file in files:
        for name, tensor in _load_bin(file).items():
            refs[name] = TensorRef(file, tuple(tensor.shape))
    return refs


def load_tensor(name: str, ref: TensorRef) -> torch.Tensor:
    """The tensor in its stored dtype (a safetensors file is closed again; a .bin stays mapped while it lives)."""
    if ref.file.suffix == ".safetensors":
        with safe_open(ref.file, framework="pt") as handle:
            return handle.get_tensor(name)
    return _load_bin(ref.file)[name]
