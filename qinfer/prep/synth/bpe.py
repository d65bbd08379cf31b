"""A tiny GPT-2 byte-level BPE tokenizer laid out like a facebook/opt-* repository, for testing the "gpt2" vocabulary.

OPT repos carry the slow GPT-2 files only (vocab.json, merges.txt, tokenizer_config.json), start the vocabulary
with `<s> <pad> </s> <unk>`, and use `</s>` as BOS, EOS and UNK alike, so the tokenizer prepends id 2.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qinfer.prep.synth.corpus import paragraphs

OPT_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
OPT_BOS = OPT_EOS = 2
OPT_PAD = 1


def train_bpe_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """Byte-level BPE over the paragraphs of `text`; the same text and size always give the same merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(OPT_SPECIALS),
        # All 256 byte symbols, so any text (emoji, CJK) encodes without an unknown token, as GPT-2's does.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(paragraphs(text), trainer)
    return tokenizer


def save_bpe_tokenizer(text: str, vocab_size: int, out_dir: Path) -> None:
    """Write vocab.json, merges.txt and an OPT-style tokenizer_config.json into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    train_bpe_tokenizer(text, vocab_size).model.save(str(out_dir))
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "errors": "replace",
        "bos_token": "</s>",
        "eos_token": "</s>",
        "unk_token": "</s>",
        "pad_token": "<pad>",
        "add_prefix_space": False,
        "add_bos_token": True,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
