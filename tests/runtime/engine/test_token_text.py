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


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
@pytest.mark.parametrize("case", ["byte tokens end the prompt", "special tokens end it", "a special token is new",
                                  "the prompt is one token"])  # fmt: skip
def test_pieces_join_into_the_text_at_the_edges(tokenizers: dict[str, GGUFTokenizer], kind: str, case: str) -> None:
    """Where the prompt's last tokens decode to nothing or begin inside a character, the window reaches back to
    text; a special token among the new ones adds nothing."""
    tokenizer = tokenizers[kind]
    prompt = tokenizer.encode(PROMPT + ("a🙂🙂🙂" if case == "byte tokens end the prompt" else ""))
    new = tokenizer.encode(" a🙂🙂 then x", add_bos=False)
    if case == "byte tokens end the prompt":
        # New byte tokens straight after the prompt's: an emoji's tokens, as they follow a letter.
        letter, emoji = tokenizer.encode("a", add_bos=False), tokenizer.encode("a🙂", add_bos=False)
        assert emoji[: len(letter)] == letter
        new = emoji[len(letter) :] + new
    special = tokenizer.eos_id
    assert special is not None
    if case == "special tokens end it":
        prompt += [special] * (CONTEXT_TOKENS + 2)
    elif case == "a special token is new":
        new = new[:3] + [special] + new[3:]
    elif case == "the prompt is one token":
        prompt = prompt[:1]
    output = TokenText(tokenizer.decode, prompt)
    pieces = [output.add(token, finished=i == len(new) - 1) for i, token in enumerate(new)]
    assert "".join(pieces) == tokenizer.decode(prompt + new)[len(tokenizer.decode(prompt)) :]
    assert "\ufffd" not in "".join(pieces)


def test_a_token_that_adds_no_text_yet_is_held_back_until_it_does() -> None:
    """A decode that drops its text's leading space, as SentencePiece's does: the token that adds nothing stays in
    the window until the next adds text, whose space then comes through."""
    text = {1: " a", 2: "", 3: " b"}
    output = TokenText(lambda ids: "".join(text[i] for i in ids).removeprefix(" "), [1])
    assert [output.add(2), output.add(3), output.add(None, finished=True)] == ["", " b", ""]
