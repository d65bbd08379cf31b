"""Put a Hugging Face model's vocabulary into GGUF metadata the way llama.cpp's converter does."""

from __future__ import annotations

import logging
from pathlib import Path

from gguf import GGUFWriter, TokenType
from gguf.vocab import LlamaHfVocab, SentencePieceVocab, SpecialVocab, Vocab

from qinfer_core.errors import UserError


def _open_vocab(model_dir: Path) -> Vocab:
    if (model_dir / "tokenizer.model").is_file():
        return SentencePieceVocab(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        return LlamaHfVocab(model_dir)
    raise UserError(f"no tokenizer.model or tokenizer.json in {model_dir}: the GGUF needs the model's tokenizer")


def add_vocab(writer: GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """Tokens, scores and types padded to the model's vocab_size, then the special token ids and flags."""
    tokens: list[bytes] = []
    scores: list[float] = []
    types: list[int] = []
    for text, score, kind in _open_vocab(model_dir).all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(int(kind))
    if len(tokens) > vocab_size:
        raise UserError(f"the tokenizer has {len(tokens)} tokens but config.json says vocab_size={vocab_size}")
    # Checkpoints often round the embedding up; llama.cpp fills the gap with unused placeholder tokens.
    for i in range(len(tokens), vocab_size):
        tokens.append(f"<dummy{i:05}>".encode())
        scores.append(-1000.0)
        types.append(int(TokenType.UNUSED))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    # gguf warns about tokenizer.json post-processor templates it does not need; keep the CLI output clean.
    vocab_log = logging.getLogger("gguf.vocab")
    level = vocab_log.level
    vocab_log.setLevel(logging.ERROR)
    try:
        special = SpecialVocab(model_dir, n_vocab=len(tokens))
    finally:
        vocab_log.setLevel(level)
    special.add_to_gguf(writer, quiet=True)
