"""The synth models' text: a LLaMA-style SentencePiece tokenizer trained on the synth corpus, saved for SentencePiece,
GGUF converters and transformers alike, and the corpus cut into token batches."""

from __future__ import annotations

import io
from pathlib import Path

import sentencepiece as spm
import torch
from transformers import LlamaTokenizer

from qinfer.core.vocabulary import implied_merges
from qinfer.prep.synth.corpus import paragraphs, synth_corpus

SEQ_LEN = 128
SPECIAL_PIECES = ("<unk>", "<s>", "</s>")
BOS, EOS = 1, 2
TOKENIZER_CHARS = 400_000


def train_tokenizer(text: str, vocab_size: int) -> bytes:
    """A LLaMA-style SentencePiece BPE model (byte fallback, split digits, no normalisation), serialised."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(paragraphs(text)),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        # The stories hold under 2000 distinct pieces; a larger vocab_size (32000 for a 7B-shaped build) only
        # sizes the embedding, and its unused rows are ordinary padding to converters.
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=BOS,
        eos_id=EOS,
        pad_id=-1,
        max_sentence_length=1 << 16,
        num_threads=1,  # more threads may break ties between equally frequent pairs differently
        minloglevel=2,
    )
    return model.getvalue()


def save_tokenizer(tokenizer_model: bytes, context: int, model_dir: Path) -> None:
    """tokenizer.model for SentencePiece and GGUF converters, tokenizer.json and its config for transformers.

    The fast tokenizer is built from the pieces directly because transformers' own conversion of a
    tokenizer.model needs protobuf; the BPE merges follow from the piece order, as transformers derives them.
    """
    (model_dir / "tokenizer.model").write_bytes(tokenizer_model)
    sp = spm.SentencePieceProcessor(model_proto=tokenizer_model)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = implied_merges(vocab, skip=SPECIAL_PIECES)
    unk, bos, eos = SPECIAL_PIECES
    tokenizer = LlamaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=unk,
        bos_token=bos,
        eos_token=eos,
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=context,
    )
    tokenizer.save_pretrained(model_dir)


def token_stream(sp: spm.SentencePieceProcessor, text: str) -> torch.Tensor:
    """Every story as <s> story </s>, concatenated."""
    ids: list[int] = []
    for story in sp.encode(paragraphs(text)):
        ids += [BOS, *story, EOS]
    return torch.tensor(ids, dtype=torch.long)


def text_batch(sp: spm.SentencePieceProcessor, seed: int, split: str, rows: int) -> torch.Tensor:
    """[rows, SEQ_LEN] consecutive tokens of one corpus split."""
    chars = rows * SEQ_LEN * 6
    stream = token_stream(sp, synth_corpus(seed, chars, split))
    while len(stream) < rows * SEQ_LEN:  # a vocabulary with longer pieces than usual
        chars *= 2
        stream = token_stream(sp, synth_corpus(seed, chars, split))
    return stream[: rows * SEQ_LEN].view(rows, SEQ_LEN)
