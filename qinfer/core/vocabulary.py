"""What a GGUF vocabulary's names stand for, kept here once (docs/formats.md#tokenizer-keys): the text splits that
`tokenizer.ggml.pre` names, the byte alphabet of byte-level BPE, and the merges a SentencePiece vocabulary implies.

These are facts of llama.cpp's format and of the models' own tokenizers, written out here so that the converter and
the runtime's tokenizer need no private module of any library.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

# How a byte-level vocabulary splits text before its merges apply, by llama.cpp's name for it (tokenizer.ggml.pre).
# The expressions are the ones the models' own tokenizer.json files carry; tests/runtime/model/test_swiglu_families.py
# checks them against transformers' tokenizers. The first name of each expression is the one the converter writes.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "llama-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    # Other names llama.cpp's converter gives the same expressions (fine-tunes and distillations of these models).
    "smaug-bpe": LLAMA3_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
}

# SentencePiece's word boundary: a space is written as this character in the pieces.
SPM_SPACE = "\u2581"


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, in which byte-level BPE vocabularies are written: printable Latin-1
    bytes stand for themselves, the others for the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def implied_merges(
    vocab: Mapping[str, int], scores: Mapping[str, float] | None = None, skip: Collection[str] = ()
) -> list[tuple[str, str]]:
    """The BPE merges that a vocabulary without merge rules implies: every split of a token into two tokens, best
    first. With `scores` (a SentencePiece vocabulary's), best is the highest score of the joined token; without, the
    lowest id; equal ranks are ordered by the lengths of the two pieces, the same way round. This is the order in
    which transformers rebuilds a SentencePiece vocabulary's merges, so that both tokenize alike."""
    skip = set(skip)
    ranked: list[tuple[float, int, int, str, str]] = []
    for token in scores if scores is not None else vocab:
        if token in skip:
            continue
        rank = scores[token] if scores is not None else vocab[token]
        pairs = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab and token[:i] not in skip and token[i:] not in skip
        ]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((rank, len(left), len(right), left, right) for left, right in pairs)
    # A stable sort on the key alone keeps equal keys in vocabulary order either way.
    ranked.sort(key=lambda merge: merge[:3], reverse=scores is not None)
    return [(left, right) for _, _, _, left, right in ranked]
