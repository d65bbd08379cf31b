"""Tiny SwiGLU checkpoints of the families people run (Llama-3, Mistral, Qwen2), each with its own kind of
vocabulary, for tests and benchmarks that cannot download one.

Each is what its family's real checkpoints are, only small: Llama-3 with GQA, "llama3" rope scaling and a
byte-level BPE vocabulary split as Llama-3 splits text; Mistral with a sliding attention window and a
SentencePiece vocabulary; Qwen2 with q/k/v biases, a tied output and Qwen2's byte-level BPE. Weights are random
(seeded), and `train_steps` of plain next-token training on the synth corpus make them a language model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers import logging as hf_logging

from qinfer.core.vocabulary import LLAMA3_SPLIT, QWEN2_SPLIT
from qinfer.formats.atomic_file import atomic_directory
from qinfer.prep.synth.corpus import paragraphs, synth_corpus
from qinfer.prep.synth.tokenizer import TOKENIZER_CHARS, save_tokenizer, train_tokenizer

FAMILIES = ("llama3", "mistral", "qwen2")
# Text beyond the stories, so that the byte-level merges also cover code, digits, other scripts and emoji.
EXTRA_TEXT = (
    "def f(x):\n    return x ** 2  # square\n\tif x != 0: print(f'{x:>4}')\n",
    "3.14159 + 2718 = 123456789; 0x1F",
    "東京は日本の首都です。北京是中国的首都。",
    "Grüße, café, naïve façade — “quoted” ‘text’",
    "🙂🚀 emoji 👍🏽 and    runs   of\n\n\n spaces",
)


@dataclass(frozen=True)
class SwigluShape:
    layers: int = 2
    hidden: int = 64
    ffn: int = 192
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 640
    context: int = 256


@dataclass(frozen=True)
class Specials:
    bos: str | None
    eos: str
    others: tuple[str, ...] = ()


_SPECIALS = {
    "llama3": Specials(
        "<|begin_of_text|>", "<|end_of_text|>", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    ),
    "qwen2": Specials(None, "<|endoftext|>", ("<|im_start|>", "<|im_end|>")),
}
_SPLITS = {"llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}


def _byte_level_tokenizer(family: str, text: str, vocab: int, context: int) -> PreTrainedTokenizerFast:
    specials = _SPECIALS[family]
    names = [t for t in (specials.bos, specials.eos, *specials.others) if t is not None]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLITS[family]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(names),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([*paragraphs(text), *EXTRA_TEXT], trainer)
    tokenizer.add_special_tokens(names)
    if specials.bos is not None:
        bos_id = tokenizer.token_to_id(specials.bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{specials.bos} $A",
            pair=f"{specials.bos} $A {specials.bos} $B",
            special_tokens=[(specials.bos, bos_id)],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=specials.bos,
        eos_token=specials.eos,
        model_max_length=context,
    )


def synth_tokenizer(family: str, tmp: Path, seed: int, vocab: int, context: int) -> PreTrainedTokenizerFast:
    """A tokenizer of `family`'s kind trained on the synth corpus; Mistral's SentencePiece files are written into
    `tmp` already, since the tokenizer is read back from them."""
    text = synth_corpus(seed, TOKENIZER_CHARS, "train")
    if family != "mistral":
        return _byte_level_tokenizer(family, text, vocab, context)
    tmp.mkdir(parents=True, exist_ok=True)
    save_tokenizer(train_tokenizer(text, vocab), context, tmp)
    return PreTrainedTokenizerFast.from_pretrained(tmp)


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, family: str, tmp: Path) -> None:
    """The model and (for a family of synth_tokenizer's) its tokenizer into `tmp`, without progress bars."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if family != "mistral":  # Mistral's SentencePiece files are in place already
        tokenizer.save_pretrained(tmp)


class DecoderShape(Protocol):
    """What a tiny checkpoint's shape says of its decoder (SwigluShape, moe.MoeShape)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    context: int


def decoder_config(shape: DecoderShape, vocab: int, ids: dict[str, int | None], init_std: float) -> dict[str, object]:
    """The transformers config keys every tiny LLaMA-shaped checkpoint here shares (the SwiGLU families' and the
    mixtures'): its shape, its vocabulary's BOS and EOS, and float32 weights drawn with `init_std`."""
    return dict(
        initializer_range=init_std,
        vocab_size=vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context,
        rms_norm_eps=1e-5,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        dtype="float32",
    )


def _config(
    family: str, shape: SwigluShape, activation: str, vocab: int, ids: dict[str, int | None], init_std: float
) -> PretrainedConfig:
    common = decoder_config(shape, vocab, ids, init_std)
    common |= dict(intermediate_size=shape.ffn, hidden_act=activation)
    if family == "llama3":
        # Scaled as Llama-3.1 is (factor 8 over an original context of 8192), shrunk to this context so that the
        # scaling reaches frequencies a short test sees.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": shape.context // 4}  # fmt: skip
        return LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if family == "mistral":
        window = shape.context // 16
        return MistralConfig(**common, sliding_window=window, rope_theta=10000.0, tie_word_embeddings=False)
    return Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False)


_CLASSES: dict[str, type[PreTrainedModel]] = {
    "llama3": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}


def _train(model: PreTrainedModel, ids: torch.Tensor, steps: int, gen: torch.Generator, seq_len: int = 128) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    windows = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    model.train()
    for step in range(steps):
        batch = windows[torch.randint(len(windows), (16,), generator=gen)]
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def build_swiglu(
    out: Path,
    family: str,
    shape: SwigluShape = SwigluShape(),
    seed: int = 0,
    train_steps: int = 0,
    activation: str = "silu",
    init_std: float = 0.02,
    chat_template: str | None = None,
) -> Path:
    """Write a Hugging Face checkpoint of `family` with its tokenizer to `out` (replaced whole when complete).
    `activation` is the config's hidden_act: silu, or drelu for a dReLU model of this shape. A larger `init_std`
    than transformers' 0.02 makes an untrained model's logits large enough for a parity test to see small errors.
    `chat_template` is saved as the tokenizer's (chat_template.jinja), as an instruct model ships one."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, not {family!r}")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    with atomic_directory(out) as tmp:
        tokenizer = synth_tokenizer(family, tmp, seed, shape.vocab, shape.context)
        ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}
        # transformers' classes know relu, not dReLU: a dReLU model is saved as relu and declared after.
        hf_act = "relu" if activation == "drelu" else activation
        # The embedding may be wider than the vocabulary learned from the stories, as real ones are rounded up.
        vocab = max(shape.vocab, len(tokenizer))
        model = _CLASSES[family](_config(family, shape, hf_act, vocab, ids, init_std)).eval()
        with torch.no_grad():
            for module in model.modules():  # transformers starts biases at 0, which would hide Qwen2's
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, init_std, generator=gen)
        if train_steps:
            # Tokenised whole and cut into windows after: its length is no concern of the tokenizer's, which warns.
            text = synth_corpus(seed, train_steps * 16 * 128 * 5, "train")
            stream = torch.tensor(tokenizer(text, verbose=False)["input_ids"])
            _train(model, stream, train_steps, gen)
        if activation == "drelu":
            model.config.hidden_act = "drelu"
        save_checkpoint(model, tokenizer, family, tmp)
        if chat_template is not None:
            (tmp / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    return out
