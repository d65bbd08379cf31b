"""What one forward call addresses in the KV cache: its tokens, their positions and slots (`TokenBatch`), and what
every layer of the call shares (`Step`: positions on the device, rope's tables, the attention mask)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenBatch:
    """tokens, positions and KV-cache slots, one entry per token; either all of one slot (a prompt at
    consecutive positions) or one token per distinct slot (a decode step)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor

    @classmethod
    def prompt(cls, tokens: torch.Tensor, start: int, slot: int = 0) -> TokenBatch:
        n = tokens.shape[0]
        return cls(tokens, torch.arange(start, start + n), torch.full((n,), slot, dtype=torch.long))

    @classmethod
    def decode(cls, tokens: list[int], positions: list[int], slots: list[int]) -> TokenBatch:
        return cls(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots))

    @property
    def single_sequence(self) -> bool:
        return bool((self.slots == self.slots[0]).all())


@dataclass(frozen=True)
class Step:
    """What every layer of one forward call shares, made once per call rather than once per layer: the batch, its
    positions on the compute device, rope's cos/sin tables (None without rope) and the attention mask (None where
    every query may see every cached position, as a single decode token does).

    A `fixed` step is one whose shapes and work do not depend on the values in it, as a step replayed from a CUDA
    graph must be: its batch lives on the device, and attention reads every row of the cache under `mask`."""

    batch: TokenBatch
    positions: torch.Tensor
    mask: torch.Tensor | None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    fixed: bool = False


def attention_mask(batch: TokenBatch, device: torch.device, window: int | None = None) -> torch.Tensor | None:
    """Query t sees cached positions up to and including its own; with a sliding `window`, only the last `window`
    of them (Mistral's attention)."""
    n = batch.tokens.shape[0]
    end = int(batch.positions.max()) + 1
    if batch.single_sequence:
        start = int(batch.positions[0])
        # A single token sees all of them, so it needs no mask (and SDPA then takes its unmasked kernel).
        if n == 1 and (window is None or end <= window):
            return None
        mask = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)
        return mask if window is None else mask.triu(start - window + 1)
    return rows_mask(batch.positions.to(device), end, window)


def rows_mask(positions: torch.Tensor, rows: int, window: int | None = None) -> torch.Tensor:
    """[T, 1, 1, rows]: which of the first `rows` cached positions each token at `positions` sees (one token per
    sequence), as a bool mask made on the positions' device from their values there."""
    seen = torch.arange(rows, device=positions.device)[None, :]
    mask = seen <= positions[:, None]
    if window is not None:
        mask &= seen > positions[:, None] - window
    return mask[:, None, None, :]
