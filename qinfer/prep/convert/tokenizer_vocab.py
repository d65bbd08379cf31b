"""Put a Hugging Face model's vocabulary into GGUF metadata the way llama.cpp's converter does.

Two kinds: a SentencePiece vocabulary ("llama": LLaMA, Mistral, Bamboo, the synth models) and a GPT-2 byte-level
BPE ("gpt2": OPT, ReluFalcon-40B, Llama-3, Qwen2), written as PowerInfer's `_set_vocab_gpt2` writes it so PowerInfer
reads our files. A BPE vocabulary whose text splitting is Llama-3's or Qwen2's is named by llama.cpp's name for it
(tokenizer.ggml.pre), which llama.cpp and transformers both need to split text as the model's merges expect.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from gguf import GGUFWriter, TokenType
from gguf.vocab import LlamaHfVocab, SentencePieceVocab, SpecialVocab, Vocab

from qinfer.core.errors import UserError
from qinfer.core.vocabulary import PRE_TOKENIZER_SPLITS


def _open_vocab(model_dir: Path) -> Vocab:
    if (model_dir / "tokenizer.model").is_file():
        return SentencePieceVocab(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        return LlamaHfVocab(model_dir)
    raise UserError(f"no tokenizer.model or tokenizer.json in {model_dir}: the GGUF needs the model's tokenizer")


def _has_byte_level(pre_tokenizer: Any) -> bool:
    # Falcon nests ByteLevel in a Sequence after Punctuation and Digits splits; GPT-2 and OPT use it alone.
    if not isinstance(pre_tokenizer, dict):
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers") or ())


def _split_regex(pre_tokenizer: Any) -> str | None:
    """The regular expression of the first Split in a tokenizer.json pre-tokenizer (Llama-3 and Qwen2 have one)."""
    if not isinstance(pre_tokenizer, dict):
        return None
    pattern = pre_tokenizer.get("pattern")
    if pre_tokenizer.get("type") == "Split" and isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
        return pattern["Regex"]
    return next(filter(None, (_split_regex(p) for p in pre_tokenizer.get("pretokenizers") or ())), None)


def pre_tokenizer_name(model_dir: Path) -> str | None:
    """llama.cpp's name for how this byte-level vocabulary splits text, where it is one we know; None otherwise
    (GPT-2's own split, which a file states by saying nothing)."""
    tokenizer_json = model_dir / "tokenizer.json"
    if not tokenizer_json.is_file():
        return None
    try:
        spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{tokenizer_json} is not readable JSON ({exc})") from exc
    regex = _split_regex(spec.get("pre_tokenizer")) if isinstance(spec, dict) else None
    # The first name of an expression is llama.cpp's name for the original model's split.
    return next((name for name, split in PRE_TOKENIZER_SPLITS.items() if split == regex), None)


def _is_byte_level_bpe(model_dir: Path) -> bool:
    # A tokenizer.model means SentencePiece even when a tokenizer.json sits beside it, as it always has here.
    if (model_dir / "tokenizer.model").is_file():
        return False
    tokenizer_json = model_dir / "tokenizer.json"
    if tokenizer_json.is_file():
        try:
            spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{tokenizer_json} is not readable JSON ({exc})") from exc
        model = spec.get("model") if isinstance(spec, dict) else None
        return isinstance(model, dict) and model.get("type") == "BPE" and _has_byte_level(spec.get("pre_tokenizer"))
    # OPT repos ship only the slow GPT-2 files.
    return (model_dir / "vocab.json").is_file() and (model_dir / "merges.txt").is_file()


def _special_vocab(model_dir: Path, n_vocab: int, load_merges: bool) -> SpecialVocab:
    # gguf warns about tokenizer.json post-processor templates it does not need; keep the CLI output clean.
    vocab_log = logging.getLogger("gguf.vocab")
    level = vocab_log.level
    vocab_log.setLevel(logging.ERROR)
    try:
        return SpecialVocab(model_dir, load_merges=load_merges, n_vocab=n_vocab)
    finally:
        vocab_log.setLevel(level)


def _add_sentencepiece_vocab(writer: GGUFWriter, model_dir: Path, vocab_size: int) -> None:
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
    _special_vocab(model_dir, len(tokens), load_merges=False).add_to_gguf(writer, quiet=True)


def _add_gpt2_vocab(writer: GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    # Imported here: transformers takes seconds to import and the SentencePiece path does not need it.
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"transformers cannot load the tokenizer in {model_dir} ({exc})") from exc
    vocab: dict[str, int] = tokenizer.get_vocab()
    if vocab and max(vocab.values()) >= vocab_size:
        raise UserError(
            f"the tokenizer has token ids up to {max(vocab.values())} but config.json says vocab_size={vocab_size}"
        )
    by_id = {i: text for text, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            # OPT rounds its embedding up past the tokenizer (50272 rows, 50265 tokens); PowerInfer names the gap so.
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.USER_DEFINED))
            continue
        tokens.append(by_id[i])
        if i in added:
            types.append(int(TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED))
        else:
            types.append(int(TokenType.NORMAL))
    special = _special_vocab(model_dir, vocab_size, load_merges=True)
    # Without merges a byte-level vocabulary tokenizes every text into single bytes.
    if not special.merges:
        raise UserError(f"no BPE merges in {model_dir} (merges.txt or tokenizer.json): the GGUF needs them")
    writer.add_tokenizer_model("gpt2")
    pre = pre_tokenizer_name(model_dir)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special.add_to_gguf(writer, quiet=True)


def add_vocab(writer: GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """Tokens and types (and SentencePiece scores) padded to the model's vocab_size, then merges, special ids, flags."""
    if _is_byte_level_bpe(model_dir):
        _add_gpt2_vocab(writer, model_dir, vocab_size)
    else:
        _add_sentencepiece_vocab(writer, model_dir, vocab_size)
