"""The LLaMA/Bamboo forward pass over GGUF tensors, with a KV cache.

Weights stay in the file's dtype (mapped, not copied); each matmul runs in that dtype and the
residual stream is kept in float32. q/k rows are in ggml's rotary layout (see qinfer_prep.convert),
so rope rotates adjacent pairs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from qinfer_runtime.ffn_runners import DenseRunner
from qinfer_runtime.model_file import ModelConfig, ModelFile
from qinfer_runtime.model_forward import FFNRunner, KVCache, TokenBatch, TransformerForward, cached_attention
from qinfer_runtime.sparse_ffn import VARIANTS, FFNWeights
from qinfer_runtime.weight_rows import linear


@dataclass
class AttentionWeights:
    attn_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    ffn_norm: torch.Tensor

    def to(self, device: torch.device) -> AttentionWeights:
        return AttentionWeights(*(t.to(device) for t in vars(self).values()))


def _attention(model: ModelFile, i: int) -> AttentionWeights:
    t, b = model.tensor, f"blk.{i}"
    return AttentionWeights(
        attn_norm=t(f"{b}.attn_norm.weight"),
        q=t(f"{b}.attn_q.weight"),
        k=t(f"{b}.attn_k.weight"),
        v=t(f"{b}.attn_v.weight"),
        o=t(f"{b}.attn_output.weight"),
        ffn_norm=t(f"{b}.ffn_norm.weight"),
    )


def ffn_weights(model: ModelFile, i: int) -> FFNWeights:
    """Layer i's FFN rows (neuron i = row i) and predictor, as mapped views; gate is absent for falcon."""
    t, b = model.tensor, f"blk.{i}"
    # A dense GGUF stores down as [E, F]; its transpose is a free view with the PowerInfer row layout.
    down_t = t(f"{b}.ffn_down_t.weight") if model.powerinfer else t(f"{b}.ffn_down.weight").T
    variant = VARIANTS[model.config.arch]
    return FFNWeights(
        variant=variant,
        up=t(f"{b}.ffn_up.weight"),
        down_t=down_t,
        gate=None if variant == "falcon" else t(f"{b}.ffn_gate.weight"),
        fc1=model.tensors.get(f"{b}.fc1.weight"),
        fc2=model.tensors.get(f"{b}.fc2.weight"),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


@functools.cache
def _inv_freq(theta: float, dim: int, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def rope_tables(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The frequencies depend on the model only: computed once, not per layer and step.
    angles = positions.float()[:, None] * _inv_freq(cfg.rope_theta, cfg.rope_dim, positions.device)[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of each head; x is [T, heads, head_dim]."""
    pairs = x.unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


class LlamaForward(TransformerForward):
    """Attention, norms and output head on `device`; the FFN through `ffn` (default: dense, on the CPU)."""

    def __init__(self, model: ModelFile, ffn: FFNRunner | None = None, device: torch.device | str = "cpu"):
        self.cfg = model.config
        self.device = torch.device(device)
        self.attn = [_attention(model, i).to(self.device) for i in range(self.cfg.layers)]
        self.embed = model.tensor("token_embd.weight")
        self.norm = model.tensor("output_norm.weight").to(self.device)
        self.output = model.tensor("output.weight").to(self.device)
        self.ffn = ffn or DenseRunner([ffn_weights(model, i) for i in range(self.cfg.layers)])

    def attention(self, i: int, x: torch.Tensor, batch: TokenBatch, cache: KVCache) -> torch.Tensor:
        cfg, n, w = self.cfg, x.shape[0], self.attn[i]
        q = linear(x, w.q).view(n, cfg.heads, cfg.head_dim)
        k = linear(x, w.k).view(n, cfg.kv_heads, cfg.head_dim)
        v = linear(x, w.v).view(n, cfg.kv_heads, cfg.head_dim)
        cos, sin = rope_tables(cfg, batch.positions.to(self.device))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return linear(cached_attention(q, k, v, i, batch, cache), w.o)

    def block(self, i: int, h: torch.Tensor, batch: TokenBatch, cache: KVCache, prefill: bool) -> torch.Tensor:
        w, eps = self.attn[i], self.cfg.rms_eps
        h = h + self.attention(i, rms_norm(h, w.attn_norm, eps), batch, cache)
        return h + self.ffn(i, rms_norm(h, w.ffn_norm, eps), h, prefill)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(h, self.norm, self.cfg.rms_eps), self.output)
