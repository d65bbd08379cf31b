"""A stand-in for a grammar constraint (`Request.constraint`): the one place the engine shows a sequence's logits
before sampling from them, so a test can read them there or change them."""

from __future__ import annotations

from collections.abc import Callable

import torch


class LogitsHook:
    """Records each logits row its sequence samples from, passed through `change` when given."""

    complete = False

    def __init__(self, change: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.seen: list[torch.Tensor] = []
        self.change = change

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        self.seen.append(logits.clone())
        return logits if self.change is None else self.change(logits)

    def advance(self, token: int) -> None:
        pass
