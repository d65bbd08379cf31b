"""The text of the tokens generated after a prompt, handed out piece by piece as the tokens arrive."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TokenText:
    """Decodes the new tokens after their prompt, so that the first one keeps its leading space (a SentencePiece
    decode of the new tokens alone would drop it)."""

    decode: Callable[[list[int]], str]
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    _prompt: str | None = None
    _shown: str = ""

    def text(self) -> str:
        if self._prompt is None:
            self._prompt = self.decode(self.prompt_ids)
        full = self.decode(self.prompt_ids + self.tokens)
        return full[len(self._prompt) :] if full.startswith(self._prompt) else self.decode(self.tokens)

    def add(self, token: int | None, finished: bool = False) -> str:
        """Take the next token (None when a step brought none) and return the text new since the last piece."""
        if token is not None:
            self.tokens.append(token)
        text = self.text()
        # A multi-byte character can span tokens; hold it back until it decodes completely.
        if not finished and text.endswith("\ufffd"):
            return ""
        piece, self._shown = text[len(self._shown) :], text
        return piece
