"""A `ModelSpec` from a Hugging Face `config.json` or from GGUF metadata: the two places a model's shape is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qinfer_core.architectures import architecture, architecture_for_hf
from qinfer_core.errors import UserError
from qinfer_core.model_spec import ModelSpec
from qinfer_core.names import Key, arch_key


def spec_from_hf_dir(model_dir: Path) -> ModelSpec:
    """The spec of the checkpoint in `model_dir`, for the families of qinfer_core.architectures."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise UserError(f"no config.json in {model_dir}: pass a Hugging Face model directory")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc})") from exc
    arch = architecture_for_hf(cfg.get("architectures") or [cfg.get("model_type")], path)
    try:
        return arch.read_config(cfg, path)
    except KeyError as exc:
        raise UserError(f"{path} lacks the key {exc.args[0]!r}") from exc


def spec_from_metadata(meta: dict[str, Any], path: Path) -> ModelSpec:
    """The spec a GGUF's metadata declares; the vocabulary size is the token list's length (0 when absent)."""
    arch = architecture(meta.get(Key.ARCHITECTURE), path)

    def key(template: str, default: Any = None) -> Any:
        value = meta.get(arch_key(template, arch.name), default)
        if value is None:
            raise UserError(f"{path} lacks the metadata key {arch_key(template, arch.name)}; re-convert it")
        return value

    heads = int(key(Key.HEAD_COUNT))
    hidden = int(key(Key.EMBEDDING_LENGTH))
    tokens = meta.get(Key.TOKENS)
    theta = meta.get(arch_key(Key.ROPE_FREQ_BASE, arch.name))
    return ModelSpec(
        arch=arch.name,
        name=str(meta.get(Key.NAME, path.stem)),
        vocab_size=len(tokens) if tokens is not None else 0,
        context_length=int(key(Key.CONTEXT_LENGTH)) - arch.position_offset,
        hidden=hidden,
        layers=int(key(Key.BLOCK_COUNT)),
        ffn=int(key(Key.FEED_FORWARD_LENGTH)),
        heads=heads,
        kv_heads=int(key(Key.HEAD_COUNT_KV, heads)),
        norm_eps=arch.default_norm_eps if arch.norm_eps_key is None else float(key(arch.norm_eps_key)),
        rope_dim=0 if arch.rope == "none" else int(key(Key.ROPE_DIMENSION_COUNT, hidden // heads)),
        rope_theta=None if theta is None else float(theta),
        tie_word_embeddings=False,
    )
