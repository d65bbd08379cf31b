"""Model profiles (hub repos, file names, shapes) from qinfer/profiles/models/*.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qinfer import profiles
from qinfer.core.architectures import Architecture, architecture
from qinfer.core.errors import UserError
from qinfer.core.model_spec import ModelSpec
from qinfer.core.numbers import whole

PROFILE_DIR = Path(profiles.__file__).resolve().parent / "models"
_SHAPE = ("vocab", "context", "hidden", "layers", "ffn", "heads", "kv_heads")


@dataclass(frozen=True)
class ModelProfile:
    """One supported model. A file name is None where the hub publishes no such file."""

    name: str
    description: str
    spec: ModelSpec
    gguf_repo: str
    gguf_f16: str | None
    gguf_q4: str | None
    original_repo: str
    predictor_repo: str
    verified: tuple[str, ...]

    def gguf_file(self, variant: str) -> str | None:
        return {"f16": self.gguf_f16, "q4": self.gguf_q4}[variant]

    @property
    def activation_files(self) -> list[str]:
        return [f"activation/activation_{i}.pt" for i in range(self.spec.layers)]


def known_models() -> list[ModelProfile]:
    return sorted((_read(p) for p in PROFILE_DIR.glob("*.json")), key=lambda m: m.name.lower())


def load_model_profile(name: str) -> ModelProfile:
    """The model called `name` (case-insensitive); an unknown name is a user error that lists the known ones."""
    models = known_models()
    for model in models:
        if model.name.lower() == name.lower():
            return model
    raise UserError(f"unknown model {name!r}; known models: {', '.join(m.name for m in models)}")


def _spec(name: str, arch: Architecture, shape: dict[str, object], path: Path) -> ModelSpec:
    """The published model's shape, each size a positive whole number; the norms' epsilon, which a plan does not
    need, is the family's default."""
    size = {key: whole(shape[key], f"shape.{key}", f"model profile {path}", "fix or delete it") for key in _SHAPE}
    return ModelSpec(
        arch=arch.name,
        name=name,
        vocab_size=size["vocab"],
        context_length=size["context"],
        hidden=size["hidden"],
        layers=size["layers"],
        ffn=size["ffn"],
        heads=size["heads"],
        kv_heads=size["kv_heads"],
        norm_eps=arch.default_norm_eps,
        rope_dim=arch.default_rope_dim(size["hidden"], size["heads"]),
    )


def _read(path: Path) -> ModelProfile:
    try:
        raw = json.loads(path.read_text())
        return ModelProfile(
            name=str(raw["name"]),
            description=str(raw.get("description", "")),
            spec=_spec(str(raw["name"]), architecture(raw["architecture"], path), raw["shape"], path),
            gguf_repo=str(raw["gguf"]["repo"]),
            gguf_f16=raw["gguf"].get("f16"),
            gguf_q4=raw["gguf"].get("q4"),
            original_repo=str(raw["original"]["repo"]),
            predictor_repo=str(raw["original"]["predictor"]),
            verified=tuple(raw.get("verified", ())),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"model profile {path} is malformed ({exc}); fix or delete it") from exc
