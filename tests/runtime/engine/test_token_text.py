"""Generated text piece by piece: the pieces join into the text decoded from the prompt on, on a SentencePiece and a
byte-level vocabulary, while each piece decodes a few tokens whatever the prompt's length."""

from __future__ import annotations

from pathlib import Path

import pytest

from qinfer.runtime.engine.token_text import CONTEXT_TOKENS, TokenText
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.model.model_file import open_model

PROMPT = "Once upon a time there was a little fox. " * 30
TEXTS = [" and it ran home.", "\nzürich — 東京 🙂 naïve", "  two spaces, tabs\tand\r\nnewlines 🙂🙂", "🙂"]


@pytest.fixture(scope="module")
def tokenizers(gguf_files: dict[str, Path], swiglu: dict[str, dict[str, Path]]) -> dict[str, GGUFTokenizer]:
    return {
        "sentencepiece": GGUFTokenizer(open_model(gguf_files["dense-f32"]).metadata),
        "byte-level": GGUFTokenizer(open_model(swiglu["qwen2"]["dense-f32"]).metadata),
    }


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_into_the_text_and_each_decodes_a_window(
    tokenizers: dict[str, GGUFTokenizer], kind: str, text: str
) -> None:
    tokenizer = tokenizers[kind]
    decoded: list[int] = []

    def decode(ids: list[int]) -> str:
        decoded.append(len(ids))
        return tokenizer.decode(ids)

    prompt = tokenizer.encode(PROMPT)
    new = tokenizer.encode(text, add_bos=False)
    assert len(prompt) > 100 and new
    output = TokenText(decode, prompt)
    pieces = [output.add(token, finished=i == len(new) - 1) for i, token in enumerate(new)]
    expected = tokenizer.decode(prompt + new)[len(tokenizer.decode(prompt)) :]
    assert "".join(pieces) == expected == output.text()
    assert not any(piece.endswith("\ufffd") for piece in pieces)
    # A window holds the last piece's tokens and the new ones: a character's bytes (four at most) where one was held
    # back, the prompt's last tokens at first.
    assert max(decoded[: 2 * len(new)]) <= CONTEXT_TOKENS + 4


def test_a_token_that_adds_no_text_yet_is_held_back_until_it_does() -> None:
    text = {1: "a", 2: "b", 3: "", 4: "c"}
    output = TokenText(lambda ids: "".join(text[i] for i in ids), [1])
    assert [output.add(2), output.add(3), output.add(4), output.add(None, finished=True)] == ["b", "", "c", ""]
