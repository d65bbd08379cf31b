"""The text of the tokens generated after a prompt, handed out piece by piece as the tokens arrive."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# Prompt tokens decoded before the first new one: a SentencePiece decode drops the leading space of what it decodes,
# so the new tokens need text before them. The window reaches further back where the prompt's last tokens decode to
# nothing (special tokens) or begin inside a character (SentencePiece decodes a run of byte tokens all or nothing:
# one cut mid-character turns every byte of the run into U+FFFD, the new ones too).
CONTEXT_TOKENS = 6


def _starts_whole(text: str) -> bool:
    return bool(text) and not text.startswith("\ufffd")


@dataclass
class TokenText:
    """Each piece is decoded from a window of tokens rather than from the prompt on: the last piece's tokens and
    the new ones, less the text of the last piece's alone. Decoding everything from the prompt on cost each token
    time in proportion to the context (0.9 ms a token at 4,000 tokens, on the thread that steps every sequence)."""

    decode: Callable[[list[int]], str]
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    _prompt: str | None = None
    _window: list[int] = field(init=False)  # the last piece's tokens (at first the prompt's last ones), then new ones
    _shown: int = field(init=False)  # how many of the window's tokens came before the new ones

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        start = max(n - CONTEXT_TOKENS, 0)
        while start > 0 and not _starts_whole(self.decode(self.prompt_ids[start:])):
            start = max(2 * start - n, 0)  # twice the window: at most twice the prompt decoded, once
        self._window = self.prompt_ids[start:]
        self._shown = len(self._window)

    def text(self) -> str:
        """All the new tokens' text, decoded from the prompt on (once, at the end)."""
        if self._prompt is None:
            self._prompt = self.decode(self.prompt_ids)
        full = self.decode(self.prompt_ids + self.tokens)
        return full[len(self._prompt) :] if full.startswith(self._prompt) else self.decode(self.tokens)

    def add(self, token: int | None, finished: bool = False) -> str:
        """Take the next token (None when a step brought none) and return the text new since the last piece."""
        if token is not None:
            self.tokens.append(token)
            self._window.append(token)
        before = self.decode(self._window[: self._shown])
        text = self.decode(self._window)
        # A multi-byte character can span tokens, and a token can add no text yet: hold them back until the text
        # grows by whole characters.
        if not finished and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        piece = text[len(before) :]
        self._window = self._window[self._shown :]
        self._shown = len(self._window)
        return piece
