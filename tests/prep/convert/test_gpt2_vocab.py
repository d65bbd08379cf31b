"""GPT-2 byte-level BPE vocabularies (OPT, ReluFalcon-40B): written as PowerInfer's `_set_vocab_gpt2` writes them,
and rebuilt by the runtime with the ids and text of the Hugging Face tokenizer.

The SentencePiece path keeps its bytes; tests/test_golden_bytes.py pins those.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
from transformers import AutoTokenizer

from qinfer.core.errors import UserError
from qinfer.formats.gguf_reader import metadata, open_gguf
from qinfer.prep.convert.tokenizer_vocab import add_vocab
from qinfer.prep.synth.bpe import OPT_BOS, OPT_EOS, OPT_PAD, OPT_SPECIALS, save_bpe_tokenizer
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.runtime.engine.tokenizer import GGUFTokenizer

TOKENIZER_SIZE = 512
# Past the tokenizer like OPT's embedding (50272 rows for 50265 tokens), so the `[PAD{i}]` fillers show.
VOCAB_SIZE = 520
CORPUS_CHARS = 200_000

TEXTS = [
    "Once upon a time, Lily saw a big dog in the park.",
    "  two leading spaces",
    "trailing spaces   ",
    "double  spaces  inside   and triple",
    " ",
    "line one\nline two\n\nline four\n",
    "windows\r\nline\r\n\r\nend",
    "\ttabbed\tcolumns\t\t",
    "digits 0123456789, 3.14159 and 1,000,000!",
    "Hello , world ! it 's",
    "café naïve résumé Ångström",
    "emoji 😀🎉 and 👍🏽 skin tone",
    "中文字符和日本語のテキスト",
    "",
    # A literal `</s>` is matched whole, as transformers does by default: it becomes id 2 (OPT's BOS = EOS),
    # and decoding (skip_special_tokens) drops it again. llama.cpp would only do that with parse_special.
    "the end</s>next story",
    # OPT's `<s>` and `<unk>` are not added tokens, so their text is split into bytes like any other.
    "<s> and <unk> are plain text",
    # transformers' GGUF builder appends `<|endoftext|>` at id n_vocab; it must never come out.
    "<|endoftext|>",
    # Nor the filler tokens, which the Hugging Face tokenizer does not have.
    "[PAD515][PAD519]",
]


def write_gguf(model_dir: Path, path: Path, vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    writer = gguf.GGUFWriter(path, "opt")
    add_vocab(writer, model_dir, vocab_size)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return metadata(open_gguf(path))


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer as a facebook/opt-* repo lays it out, with the ids OPT's config.json carries."""
    model_dir = tmp_path_factory.mktemp("opt") / "model"
    save_bpe_tokenizer(synth_corpus(0, CORPUS_CHARS, "train"), TOKENIZER_SIZE, model_dir)
    config = {
        "model_type": "opt",
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": OPT_BOS,
        "eos_token_id": OPT_EOS,
        "pad_token_id": OPT_PAD,
    }
    (model_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return model_dir


@pytest.fixture(scope="module", params=["slow-files", "tokenizer.json"])
def layout(request: pytest.FixtureRequest, opt_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OPT's vocab.json + merges.txt, or the tokenizer.json that transformers saves (as ReluFalcon-40B ships)."""
    if request.param == "slow-files":
        return opt_dir
    model_dir = tmp_path_factory.mktemp("fast") / "model"
    AutoTokenizer.from_pretrained(opt_dir, local_files_only=True).save_pretrained(model_dir)
    shutil.copy(opt_dir / "config.json", model_dir)
    assert not (model_dir / "merges.txt").exists()
    return model_dir


@pytest.fixture(scope="module")
def written(layout: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    return layout, write_gguf(layout, tmp_path_factory.mktemp("gguf") / "vocab.gguf")


def test_metadata_is_what_powerinfer_writes(written: tuple[Path, dict[str, Any]]) -> None:
    model_dir, meta = written
    ids = ["bos", "eos", "padding"]
    flags = ["bos"]
    if (model_dir / "tokenizer.json").exists():
        # gguf's SpecialVocab also reads the added tokens (UNK is `</s>`) and the post-processor's pair template
        # `</s> A </s> B` (a separator), as PowerInfer's converter does with the same files.
        ids = ["bos", "eos", "unknown", "seperator", "padding"]
        flags = ["bos", "sep"]
    assert list(meta) == [
        "general.architecture",
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        *(f"tokenizer.ggml.{name}_token_id" for name in ids),
        *(f"tokenizer.ggml.add_{name}_token" for name in flags),
    ]
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (OPT_BOS, OPT_EOS)
    assert meta["tokenizer.ggml.padding_token_id"] == OPT_PAD
    assert meta["tokenizer.ggml.add_bos_token"] is True

    hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    by_id = {i: text for text, i in hf.get_vocab().items()}
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == VOCAB_SIZE
    assert tokens[:TOKENIZER_SIZE] == [by_id[i] for i in range(TOKENIZER_SIZE)]
    assert tokens[: len(OPT_SPECIALS)] == list(OPT_SPECIALS)
    assert tokens[TOKENIZER_SIZE:] == [f"[PAD{i}]" for i in range(TOKENIZER_SIZE, VOCAB_SIZE)]
    control, user_defined, normal = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED), 1
    # transformers marks OPT's pad and BOS/EOS/UNK tokens special; `<s>` and `<unk>` are ordinary entries.
    assert types[: len(OPT_SPECIALS)] == [normal, control, control, normal]
    assert set(types[len(OPT_SPECIALS) : TOKENIZER_SIZE]) == {normal}
    assert set(types[TOKENIZER_SIZE:]) == {user_defined}

    merges = meta["tokenizer.ggml.merges"]
    assert len(merges) == TOKENIZER_SIZE - len(OPT_SPECIALS) - 256
    assert all(len(merge.split(" ")) == 2 for merge in merges)
    assert "".join(merges[0].split(" ")) in tokens


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(written: tuple[Path, dict[str, Any]], text: str) -> None:
    model_dir, meta = written
    hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ours = GGUFTokenizer(meta)
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    assert ids[0] == OPT_BOS
    assert max(ids) < VOCAB_SIZE
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == text.replace("</s>", "")


def test_no_token_past_the_vocabulary(written: tuple[Path, dict[str, Any]]) -> None:
    backend = GGUFTokenizer(written[1]).backend
    assert backend.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert {token.content for token in backend.get_added_tokens_decoder().values()} == {"<pad>", "</s>"}


def test_bos_follows_the_file_and_defaults_off_for_bpe(written: tuple[Path, dict[str, Any]]) -> None:
    meta = written[1]
    text = "Once upon a time"
    with_bos = GGUFTokenizer(meta).encode(text)
    absent = {k: v for k, v in meta.items() if k != "tokenizer.ggml.add_bos_token"}
    assert GGUFTokenizer(absent).encode(text) == with_bos[1:]
    assert GGUFTokenizer({**meta, "tokenizer.ggml.add_bos_token": False}).encode(text) == with_bos[1:]


def test_falcon_style_tokenizer_json_is_byte_level(opt_dir: Path, tmp_path: Path) -> None:
    """ReluFalcon-40B nests ByteLevel in a Sequence of pre-tokenizers."""
    model_dir = tmp_path / "falcon"
    AutoTokenizer.from_pretrained(opt_dir, local_files_only=True).save_pretrained(model_dir)
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [{"type": "Punctuation", "behavior": "Contiguous"}, spec["pre_tokenizer"]],
    }
    (model_dir / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    meta = write_gguf(model_dir, tmp_path / "falcon.gguf", TOKENIZER_SIZE)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert len(meta["tokenizer.ggml.tokens"]) == TOKENIZER_SIZE
    assert "tokenizer.ggml.pre" not in meta


def test_tokenizer_larger_than_vocab_size_is_a_user_error(opt_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="vocab_size=500"):
        write_gguf(opt_dir, tmp_path / "small.gguf", 500)


def test_missing_merges_is_a_user_error(written: tuple[Path, dict[str, Any]]) -> None:
    meta = {k: v for k, v in written[1].items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(UserError, match="merges"):
        GGUFTokenizer(meta)


def test_unsupported_tokenizer_type_is_a_user_error(written: tuple[Path, dict[str, Any]]) -> None:
    with pytest.raises(UserError, match="'bert' is not supported"):
        GGUFTokenizer({**written[1], "tokenizer.ggml.model": "bert"})


def test_the_synth_bpe_is_deterministic(opt_dir: Path, tmp_path: Path) -> None:
    save_bpe_tokenizer(synth_corpus(0, CORPUS_CHARS, "train"), TOKENIZER_SIZE, tmp_path)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (opt_dir / name).read_bytes()
