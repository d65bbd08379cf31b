"""Rebuild the model's tokenizer from GGUF metadata with transformers' own GGUF tokenizer converter."""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

from qinfer.core.errors import UserError
from qinfer.core.names import Key

SUPPORTED = ("llama", "gpt2")
_PLACEHOLDER = re.compile(r"\[PAD(\d+)\]")
# Control tokens that end a chat turn, by text, as llama.cpp recognises them where a file names no eot id: a chat
# template ends the assistant's turn with one of these rather than with EOS.
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
CONTROL = 3  # tokenizer.ggml.token_type of a control token


def _drop_foreign_added_tokens(backend: Tokenizer, n_vocab: int) -> Tokenizer:
    """The backend without added tokens the model's own tokenizer does not match in text.

    transformers' GPT2Tokenizer always registers `<|endoftext|>` as its default unk/bos/eos, so a vocabulary
    without it (OPT's) gets it appended at id n_vocab, past the embedding. And the converter adds the `[PAD{i}]`
    fillers as user-defined tokens, which Hugging Face's tokenizer never has, so text naming one would encode to
    an id the model never saw. Added tokens cannot be removed in place, hence the JSON round trip.
    """
    state = json.loads(backend.to_str())

    def foreign(token: dict[str, Any]) -> bool:
        placeholder = _PLACEHOLDER.fullmatch(token["content"])
        return token["id"] >= n_vocab or (placeholder is not None and int(placeholder[1]) == token["id"])

    kept = [token for token in state["added_tokens"] if not foreign(token)]
    if len(kept) == len(state["added_tokens"]):
        return backend
    state["added_tokens"] = kept
    return Tokenizer.from_str(json.dumps(state))


def require_utf8(text: str) -> str:
    """`text`, refused where it holds a lone surrogate: what Python makes of bytes that are not UTF-8 (in argv,
    say) or of a JSON "\\ud800". No tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(
            f"the text is not valid UTF-8 (character {exc.start} is a lone surrogate or an undecodable byte); "
            "pass UTF-8 text"
        ) from None
    return text


class GGUFTokenizer:
    def __init__(self, meta: dict[str, Any]):
        renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
        # transformers names the keys without their "tokenizer." prefix.
        keys = {name: Key.TOKENIZER_PREFIX + key for key, name in renames.items()}
        spec = {name: meta[key] for name, key in keys.items() if key in meta}
        kind = spec.get("tokenizer_type")
        if kind not in SUPPORTED:
            raise UserError(f"tokenizer type {kind!r} is not supported; expected one of {', '.join(SUPPORTED)}")
        if kind == "gpt2" and not spec.get("merges"):
            raise UserError(f"the GGUF's gpt2 vocabulary has no {Key.MERGES}; re-create it with qinfer prep")
        backend = convert_gguf_tokenizer(meta[Key.ARCHITECTURE], spec)[0]
        # Only transformers' GPT-2 builder adds tokens of its own; a SentencePiece backend is used as it is built.
        self.backend: Tokenizer = (
            _drop_foreign_added_tokens(backend, len(spec["tokens"])) if kind == "gpt2" else backend
        )
        self.bos_id: int | None = meta.get(Key.BOS_ID)
        self.eos_id: int | None = meta.get(Key.EOS_ID)
        # Generation ends at EOS or at the end of a chat turn.
        types = spec.get("token_type") or [0] * len(spec["tokens"])
        pairs = enumerate(zip(spec["tokens"], types, strict=True))
        turn_ends = {i for i, (text, kind) in pairs if kind == CONTROL and text in END_OF_TURN}
        self.end_ids: frozenset[int] = frozenset(
            {i for i in (self.eos_id, meta.get(Key.EOT_ID)) if i is not None} | turn_ends
        )
        tokens = spec["tokens"]
        self.vocab_size = len(tokens)
        # The special tokens' texts, by the names a chat template knows them by; and the template itself.
        names = {"bos_token": Key.BOS_ID, "eos_token": Key.EOS_ID, "unk_token": Key.UNK_ID, "pad_token": Key.PAD_ID}
        ids = {name: meta.get(key) for name, key in names.items()}
        self.special_tokens: dict[str, str] = {
            name: tokens[i] for name, i in ids.items() if isinstance(i, int) and 0 <= i < len(tokens)
        }
        template = meta.get(Key.CHAT_TEMPLATE)
        self.chat_template: str | None = template if isinstance(template, str) else None
        # llama.cpp's rule for a file that does not say: SentencePiece vocabularies add BOS, BPE ones do not.
        self.add_bos: bool = bool(meta.get(Key.ADD_BOS, kind == "llama"))

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Ids of `text`, with BOS first where the file asks for it (or `add_bos` says); special tokens written in
        the text (a chat template's) are read as those tokens."""
        require_utf8(text)
        # encode_batch releases the GIL while it works (encode does not), so a server's event loop keeps answering
        # while a long prompt is tokenized in a worker thread.
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        bos = self.add_bos if add_bos is None else add_bos
        return [self.bos_id, *ids] if bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)
