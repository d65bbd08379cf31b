"""Rebuild the model's tokenizer from GGUF metadata as a `tokenizers.Tokenizer`, the way the model's own tokenizer is
built: a SentencePiece vocabulary ("llama") as BPE with byte fallback, a byte-level one ("gpt2") as GPT-2's BPE with
the text split its tokenizer.ggml.pre names (qinfer.core.vocabulary)."""

from __future__ import annotations

import re
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from qinfer.core.errors import UserError
from qinfer.core.names import Key
from qinfer.core.vocabulary import PRE_TOKENIZER_SPLITS, SPM_SPACE, byte_alphabet, implied_merges

SUPPORTED = ("llama", "gpt2")
# Control tokens that end a chat turn, by text, as llama.cpp recognises them where a file names no eot id: a chat
# template ends the assistant's turn with one of these rather than with EOS.
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
# The `[PAD{i}]` fillers a converter writes where an embedding is longer than its tokenizer (OPT's): Hugging Face's
# tokenizer has no such tokens, so text naming one stays text.
_PLACEHOLDER = re.compile(r"\[PAD(\d+)\]")
# Tokens that text names whole, whatever their spelling.
MARKED = (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)


def _sentencepiece(tokens: list[str], scores: list[float] | None) -> Tokenizer:
    """BPE over the pieces, merged in the order their scores imply, with unknown characters spelled as byte tokens:
    how transformers' LlamaTokenizer builds a SentencePiece vocabulary."""
    vocab = {token: i for i, token in enumerate(tokens)}
    ranks = dict(zip(tokens, scores, strict=True)) if scores is not None else None
    backend = Tokenizer(models.BPE(vocab, implied_merges(vocab, ranks), fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM_SPACE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return backend


def _byte_level(tokens: list[str], types: list[int], merges: list[str], pre: str | None) -> Tokenizer:
    """GPT-2's byte-level BPE, splitting text with the expression `pre` names (GPT-2's own where it names none)."""
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # Another token written in plain text rather than in the byte alphabet is respelled, as transformers does, so
    # that its merges still apply. Marked tokens keep their text, which is what text matches them by
    # (`_add_marked_tokens`): DeepSeek's `<｜User｜>` has no spelling in the alphabet.
    vocab = {
        token if set(token) <= alphabet or kind in MARKED else "".join(spelling[b] for b in token.encode("utf-8")): i
        for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
    }
    pairs = [tuple(rule.split(" ", 1)) for rule in merges]
    backend = Tokenizer(models.BPE(vocab, pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    backend.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False)
        if split is None
        else pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_marked_tokens(backend: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens as special tokens and user-defined ones as plain added tokens, each matched whole
    in text at its own id, as llama.cpp matches them; a `[PAD{i}]` filler is not the model's, so it is not added."""

    def marked(kind: TokenType) -> list[tuple[int, str]]:
        return [(i, text) for i, (text, t) in enumerate(zip(tokens, types, strict=True)) if t == kind]

    special = marked(TokenType.CONTROL) + marked(TokenType.UNKNOWN)
    backend.add_special_tokens([AddedToken(text, normalized=False, special=True) for _, text in special])
    backend.add_tokens(
        [
            AddedToken(text, normalized=False, special=False)
            for i, text in marked(TokenType.USER_DEFINED)
            if not (placeholder := _PLACEHOLDER.fullmatch(text)) or int(placeholder[1]) != i
        ]
    )


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
        kind = meta.get(Key.TOKENIZER_MODEL)
        if kind not in SUPPORTED:
            raise UserError(f"tokenizer type {kind!r} is not supported; expected one of {', '.join(SUPPORTED)}")
        tokens: list[str] = meta[Key.TOKENS]
        types: list[int] = meta.get(Key.TOKEN_TYPE) or [int(TokenType.NORMAL)] * len(tokens)
        if kind == "gpt2":
            if not meta.get(Key.MERGES):
                raise UserError(f"the GGUF's gpt2 vocabulary has no {Key.MERGES}; re-create it with qinfer prep")
            backend = _byte_level(tokens, types, meta[Key.MERGES], meta.get(Key.TOKENIZER_PRE))
        else:
            backend = _sentencepiece(tokens, meta.get(Key.SCORES))
        _add_marked_tokens(backend, tokens, types)
        self.backend: Tokenizer = backend
        self.bos_id: int | None = meta.get(Key.BOS_ID)
        self.eos_id: int | None = meta.get(Key.EOS_ID)
        # Generation ends at EOS or at the end of a chat turn.
        pairs = enumerate(zip(tokens, types, strict=True))
        turn_ends = {i for i, (text, t) in pairs if t == TokenType.CONTROL and text in END_OF_TURN}
        self.end_ids: frozenset[int] = frozenset(
            {i for i in (self.eos_id, meta.get(Key.EOT_ID)) if i is not None} | turn_ends
        )
        self.vocab_size = len(tokens)
        # No token stands for more characters of text than its own text has (a byte-level token's characters are
        # bytes, a SentencePiece one's "▁" is a space), so a text of n characters is at least n / this many tokens:
        # a bound a server checks before tokenizing what may be megabytes.
        self.max_token_chars = max((len(t) for t in tokens), default=1) or 1
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

    def encode(self, text: str, add_bos: bool | None = None, keep_gil: bool = False) -> list[int]:
        """Ids of `text`, with BOS first where the file asks for it (or `add_bos` says); special tokens written in
        the text (a chat template's) are read as those tokens. `keep_gil`: tokenize without letting go of the GIL,
        for a short text on a server's event loop, which would otherwise wait to take it back from a busy engine
        thread."""
        require_utf8(text)
        # encode_batch releases the GIL while it works (encode does not), so a server's event loop keeps answering
        # while a long prompt is tokenized in a worker thread.
        if keep_gil:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        else:
            ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        bos = self.add_bos if add_bos is None else add_bos
        return [self.bos_id, *ids] if bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)
