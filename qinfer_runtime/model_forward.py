"""What every model forward shares: the token batch, the KV cache, cached attention, and the layer loop.

A forward maps a `TokenBatch` (one prompt, or one new token for each of several sequences at their own
positions) to logits, reading and extending each sequence's rows of the KV cache. Architectures subclass
`TransformerForward` and implement `block`; the FFN is a pluggable `FFNRunner` (dense, sparse or hybrid).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from qinfer_core.architectures import architecture
from qinfer_core.errors import UserError
from qinfer_core.kv_policy import KVPolicy
from qinfer_core.model_spec import ModelSpec
from qinfer_core.names import BIAS, Tensor, tensor_name
from qinfer_runtime.ffn_runners import DenseRunner
from qinfer_runtime.model_file import ModelFile
from qinfer_runtime.sparse_ffn import FFNWeights
from qinfer_runtime.window_kv import WindowKVCache


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

    def __init__(self, cfg: ModelSpec, ctx: int, slots: int = 1, device: torch.device | str = "cpu"):
        shape = (cfg.layers, slots, cfg.kv_heads, ctx, cfg.head_dim)
        dtype = torch.float32 if torch.device(device).type == "cpu" else torch.float16
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.ctx = ctx

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        """Store k, v [T, kv_heads, d] at the batch's slots and positions, attend q [T, heads, d]; returns
        [T, heads*d]."""
        n, batch = q.shape[0], step.batch
        if batch.single_sequence:
            slot, start = int(batch.slots[0]), int(batch.positions[0])
            end = start + n
            # A slice write: no index tensors to build or move for the one sequence's consecutive positions.
            self.k[layer, slot, :, start:end] = k.transpose(0, 1)
            self.v[layer, slot, :, start:end] = v.transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                self.k[layer, slot, :, :end].to(q.dtype),
                self.v[layer, slot, :, :end].to(q.dtype),
                attn_mask=step.mask,
                enable_gqa=True,
            ).transpose(0, 1)
        else:
            slots = batch.slots.to(self.k.device)
            self.k[layer, slots, :, step.positions] = k.to(self.k.dtype)
            self.v[layer, slots, :, step.positions] = v.to(self.v.dtype)
            end = int(batch.positions.max()) + 1
            out = F.scaled_dot_product_attention(
                q[:, :, None],
                self.k[layer, slots, :, :end].to(q.dtype),
                self.v[layer, slots, :, :end].to(q.dtype),
                attn_mask=step.mask,
                enable_gqa=True,
            )[:, :, 0]
        return out.reshape(n, -1)


Cache = KVCache | WindowKVCache


def make_kv_cache(
    cfg: ModelSpec, ctx: int, slots: int = 1, device: torch.device | str = "cpu", policy: KVPolicy | None = None
) -> Cache:
    """The cache that `policy` (qinfer_core.kv_policy; default full) describes, for `slots` sequences of `ctx`."""
    if policy is not None and policy.windowed:
        return WindowKVCache(cfg, ctx, slots, device, policy)
    return KVCache(cfg, ctx, slots, device)


@dataclass(frozen=True)
class Step:
    """What every layer of one forward call shares, made once per call rather than once per layer: the batch, its
    positions on the compute device, rope's cos/sin tables (None without rope) and the attention mask (None where
    every query may see every cached position, as a single decode token does)."""

    batch: TokenBatch
    positions: torch.Tensor
    mask: torch.Tensor | None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


def attention_mask(batch: TokenBatch, device: torch.device) -> torch.Tensor | None:
    """Query t sees cached positions up to and including its own."""
    n = batch.tokens.shape[0]
    if batch.single_sequence:
        start = int(batch.positions[0])
        # A single token sees all of them, so it needs no mask (and SDPA then takes its unmasked kernel).
        return None if n == 1 else torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)
    positions = batch.positions.to(device)
    end = int(batch.positions.max()) + 1
    return (torch.arange(end, device=device)[None, :] <= positions[:, None])[:, None, None, :]


@functools.cache
def _inv_freq(theta: float, dim: int, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def rope_tables(cfg: ModelSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The frequencies depend on the model only: computed once, not per layer and step.
    angles = positions.float()[:, None] * _inv_freq(cfg.rope_base, cfg.rope_dim, positions.device)[None, :]
    return angles.cos(), angles.sin()


def ffn_weights(model: ModelFile, i: int) -> FFNWeights:
    """Layer i's FFN rows (neuron i = row i) and predictor, as mapped views, in the form of the model's family."""
    form = architecture(model.config.arch).ffn
    t = model.tensor
    # A dense GGUF stores down as [E, F]; its transpose is a free view with the PowerInfer row layout.
    down_t = t(tensor_name(Tensor.FFN_DOWN_T, i)) if model.powerinfer else t(tensor_name(Tensor.FFN_DOWN, i)).T
    return FFNWeights(
        form=form,
        up=t(tensor_name(Tensor.FFN_UP, i)),
        down_t=down_t,
        gate=t(tensor_name(Tensor.FFN_GATE, i)) if form.gated else None,
        fc1=model.tensors.get(tensor_name(Tensor.FC1, i)),
        fc2=model.tensors.get(tensor_name(Tensor.FC2, i)),
        up_bias=t(tensor_name(Tensor.FFN_UP, i, BIAS)) if form.biased else None,
    )


def down_bias(model: ModelFile, i: int) -> torch.Tensor:
    """down's bias of a biased FFN, under its name in this kind of file."""
    return model.tensor(tensor_name(Tensor.FFN_DOWN_T if model.powerinfer else Tensor.FFN_DOWN, i, BIAS))


def to_device(weights: Any, device: torch.device) -> Any:
    """A block's weight dataclass with every tensor (or tuple of them) moved to `device`."""
    moved = {}
    for f in fields(weights):
        value = getattr(weights, f.name)
        moved[f.name] = tuple(t.to(device) for t in value) if isinstance(value, tuple) else value.to(device)
    return replace(weights, **moved)


class FFNRunner(Protocol):
    """Computes layer `layer`'s FFN for normalised input x [T, E]; h is the predictor's input
    (docs/formats.md#predictor-directories).
    `prefill` asks for dense matmuls (sparsity pays off in decode, not for many tokens at once)."""

    def __call__(self, layer: int, x: torch.Tensor, h: torch.Tensor, prefill: bool) -> torch.Tensor: ...


class ModelForward(Protocol):
    cfg: ModelSpec
    device: torch.device

    def forward(self, batch: TokenBatch, cache: Cache) -> torch.Tensor: ...


class TransformerForward:
    """Embedding lookup (CPU, mapped), the blocks, the output head; dense parts run on `device`.

    A family implements `load_block` (its per-layer weights, other than the FFN), `load_head`, `block` and `head`.
    """

    cfg: ModelSpec
    device: torch.device
    embed: torch.Tensor
    ffn: FFNRunner

    def __init__(self, model: ModelFile, ffn: FFNRunner | None = None, device: torch.device | str = "cpu"):
        self.cfg = model.config
        self.device = torch.device(device)
        self.attn = [to_device(self.load_block(model, i), self.device) for i in range(self.cfg.layers)]
        self.embed = model.tensor(tensor_name(Tensor.TOKEN_EMBD))
        self.load_head(model)
        self.ffn = ffn or DenseRunner([ffn_weights(model, i) for i in range(self.cfg.layers)])

    def load_block(self, model: ModelFile, i: int) -> Any:
        raise NotImplementedError

    def load_head(self, model: ModelFile) -> None:
        """The output norm and head, onto `device`; runs after `embed` is set, which a tied head reuses."""
        raise NotImplementedError

    def block(self, i: int, h: torch.Tensor, step: Step, cache: Cache, prefill: bool) -> torch.Tensor:
        raise NotImplementedError

    def head(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed_tokens(self, batch: TokenBatch) -> torch.Tensor:
        return self.embed[batch.tokens].float().to(self.device)

    def step(self, batch: TokenBatch) -> Step:
        positions = batch.positions.to(self.device)
        cos, sin = rope_tables(self.cfg, positions) if self.cfg.rope_dim else (None, None)
        return Step(batch, positions, attention_mask(batch, self.device), cos, sin)

    def forward(self, batch: TokenBatch, cache: Cache) -> torch.Tensor:
        """Logits [T, V] for the batch's tokens, appending their keys and values to `cache`."""
        if int(batch.positions.max()) >= cache.ctx:
            raise UserError(f"context of {cache.ctx} tokens exceeded")
        h = self.embed_tokens(batch)
        step = self.step(batch)
        prefill = batch.tokens.shape[0] > 1 and batch.single_sequence
        for i in range(self.cfg.layers):
            h = self.block(i, h, step, cache, prefill)
        return self.head(h)

    def __call__(self, tokens: torch.Tensor, start: int, cache: Cache, slot: int = 0) -> torch.Tensor:
        return self.forward(TokenBatch.prompt(tokens, start, slot), cache)
