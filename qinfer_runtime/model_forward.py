"""What every model forward shares: the token batch, the KV cache, cached attention, and the layer loop.

A forward maps a `TokenBatch` (one prompt, or one new token for each of several sequences at their own
positions) to logits, reading and extending each sequence's rows of the KV cache. Architectures subclass
`TransformerForward` and implement `block`; the FFN is a pluggable `FFNRunner` (dense, sparse or hybrid).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from qinfer_core.errors import UserError
from qinfer_runtime.model_file import ModelConfig


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


class KVCache:
    """K and V per layer and slot: [layers, slots, kv_heads, ctx, head_dim]; float32 on the CPU, float16 on a GPU
    (what the planner budgets for)."""

    def __init__(self, cfg: ModelConfig, ctx: int, slots: int = 1, device: torch.device | str = "cpu"):
        shape = (cfg.layers, slots, cfg.kv_heads, ctx, cfg.head_dim)
        dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.ctx = ctx


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: TokenBatch, cache: KVCache
) -> torch.Tensor:
    """Store k, v [T, kv_heads, d] at the batch's slots and positions, attend q [T, heads, d]; returns [T, heads*d]."""
    n = q.shape[0]
    device = cache.k.device
    if batch.single_sequence:
        slot, start = int(batch.slots[0]), int(batch.positions[0])
        end = start + n
        # A slice write: no index tensors to build or move for the one sequence's consecutive positions.
        cache.k[layer, slot, :, start:end] = k.transpose(0, 1)
        cache.v[layer, slot, :, start:end] = v.transpose(0, 1)
        # Query t (absolute position start+t) sees cached positions up to and including its own; a single
        # token sees all of them, so it needs no mask (and SDPA then takes its unmasked kernel).
        mask = None if n == 1 else torch.ones(n, end, dtype=torch.bool, device=device).tril(start)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            cache.k[layer, slot, :, :end].to(q.dtype),
            cache.v[layer, slot, :, :end].to(q.dtype),
            attn_mask=mask,
            enable_gqa=True,
        ).transpose(0, 1)
    else:
        slots, positions = batch.slots.to(device), batch.positions.to(device)
        cache.k[layer, slots, :, positions] = k.to(cache.k.dtype)
        cache.v[layer, slots, :, positions] = v.to(cache.v.dtype)
        end = int(batch.positions.max()) + 1
        mask = (torch.arange(end, device=device)[None, :] <= positions[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q[:, :, None],
            cache.k[layer, slots, :, :end].to(q.dtype),
            cache.v[layer, slots, :, :end].to(q.dtype),
            attn_mask=mask,
            enable_gqa=True,
        )[:, :, 0]
    return out.reshape(n, -1)


class FFNRunner(Protocol):
    """Computes layer `layer`'s FFN for normalised input x [T, E]; h is the predictor's input (see DESIGN.md).
    `prefill` asks for dense matmuls (sparsity pays off in decode, not for many tokens at once)."""

    def __call__(self, layer: int, x: torch.Tensor, h: torch.Tensor, prefill: bool) -> torch.Tensor: ...


class ModelForward(Protocol):
    cfg: ModelConfig
    device: torch.device

    def forward(self, batch: TokenBatch, cache: KVCache) -> torch.Tensor: ...


class TransformerForward:
    """Embedding lookup (CPU, mapped), the blocks, the output head; dense parts run on `device`."""

    cfg: ModelConfig
    device: torch.device
    embed: torch.Tensor
    ffn: FFNRunner

    def block(self, i: int, h: torch.Tensor, batch: TokenBatch, cache: KVCache, prefill: bool) -> torch.Tensor:
        raise NotImplementedError

    def head(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, batch: TokenBatch, cache: KVCache) -> torch.Tensor:
        """Logits [T, V] for the batch's tokens, appending their keys and values to `cache`."""
        if int(batch.positions.max()) >= cache.ctx:
            raise UserError(f"context of {cache.ctx} tokens exceeded")
        h = self.embed[batch.tokens].float().to(self.device)
        prefill = batch.tokens.shape[0] > 1 and batch.single_sequence
        for i in range(self.cfg.layers):
            h = self.block(i, h, batch, cache, prefill)
        return self.head(h)

    def __call__(self, tokens: torch.Tensor, start: int, cache: KVCache, slot: int = 0) -> torch.Tensor:
        return self.forward(TokenBatch.prompt(tokens, start, slot), cache)
