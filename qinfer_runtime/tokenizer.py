"""Rebuild the model's tokenizer from GGUF metadata with transformers' own GGUF tokenizer converter."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

from qinfer_core.errors import UserError


class GGUFTokenizer:
    def __init__(self, meta: dict[str, Any]):
        renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
        spec = {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        if spec.get("tokenizer_type") != "llama":
            raise UserError(f"tokenizer type {spec.get('tokenizer_type')!r} is not supported; expected 'llama'")
        self.backend: Tokenizer = convert_gguf_tokenizer(meta["general.architecture"], spec)[0]
        self.bos_id: int | None = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_id: int | None = meta.get("tokenizer.ggml.eos_token_id")
        # SentencePiece vocabularies add BOS unless the file says otherwise (llama.cpp's rule).
        self.add_bos: bool = bool(meta.get("tokenizer.ggml.add_bos_token", True))

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)
