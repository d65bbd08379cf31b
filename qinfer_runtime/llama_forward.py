"""The LLaMA/Bamboo forward pass over GGUF tensors, with a KV cache, on the CPU.

Weights stay in the file's dtype (mapped, not copied); each matmul runs in that dtype and the
residual stream is kept in float32. q/k rows are in ggml's rotary layout (see qinfer_prep.convert),
so rope rotates adjacent pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qinfer_runtime.model_file import ModelConfig, ModelFile


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    ffn_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down_t: torch.Tensor  # [F, E]: row i is neuron i, as in a PowerInfer GGUF


def _layer(model: ModelFile, i: int) -> LayerWeights:
    t = model.tensor
    b = f"blk.{i}"
    # A dense GGUF stores down as [E, F]; its transpose is a free view with the PowerInfer row layout.
    down_t = t(f"{b}.ffn_down_t.weight") if model.powerinfer else t(f"{b}.ffn_down.weight").T
    return LayerWeights(
        attn_norm=t(f"{b}.attn_norm.weight"),
        q=t(f"{b}.attn_q.weight"),
        k=t(f"{b}.attn_k.weight"),
        v=t(f"{b}.attn_v.weight"),
        o=t(f"{b}.attn_output.weight"),
        ffn_norm=t(f"{b}.ffn_norm.weight"),
        gate=t(f"{b}.ffn_gate.weight"),
        up=t(f"{b}.ffn_up.weight"),
        down_t=down_t,
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(weight.dtype), weight).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope_tables(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rope_dim, 2, dtype=torch.float32) / cfg.rope_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of each head; x is [T, heads, head_dim]."""
    pairs = x.unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


class KVCache:
    def __init__(self, cfg: ModelConfig, ctx: int):
        shape = (cfg.layers, cfg.kv_heads, ctx, cfg.head_dim)
        self.k = torch.zeros(shape)
        self.v = torch.zeros(shape)
        self.ctx = ctx


class LlamaForward:
    def __init__(self, model: ModelFile):
        self.cfg = model.config
        self.layers = [_layer(model, i) for i in range(self.cfg.layers)]
        self.embed = model.tensor("token_embd.weight")
        self.norm = model.tensor("output_norm.weight")
        self.output = model.tensor("output.weight")
        self.relu_up = self.cfg.arch == "bamboo"

    def ffn(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        act = F.relu(linear(x, layer.gate))
        up = linear(x, layer.up)
        if self.relu_up:
            up = F.relu(up)
        return (act * up).to(layer.down_t.dtype).matmul(layer.down_t).float()

    def attention(self, i: int, layer: LayerWeights, x: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        q = linear(x, layer.q).view(n, cfg.heads, cfg.head_dim)
        k = linear(x, layer.k).view(n, cfg.kv_heads, cfg.head_dim)
        v = linear(x, layer.v).view(n, cfg.kv_heads, cfg.head_dim)
        cos, sin = rope_tables(cfg, torch.arange(start, start + n))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        end = start + n
        cache.k[i, :, start:end] = k.transpose(0, 1)
        cache.v[i, :, start:end] = v.transpose(0, 1)
        # Query t (absolute position start+t) sees cached positions up to and including its own.
        mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), cache.k[i, :, :end], cache.v[i, :, :end], attn_mask=mask, enable_gqa=True
        )
        return linear(out.transpose(0, 1).reshape(n, cfg.hidden), layer.o)

    def __call__(self, tokens: torch.Tensor, start: int, cache: KVCache) -> torch.Tensor:
        """Logits [T, V] for `tokens` at positions start..start+T-1, appending their keys and values to `cache`."""
        if start + tokens.shape[0] > cache.ctx:
            raise ValueError(f"context of {cache.ctx} tokens exceeded")
        cfg = self.cfg
        h = self.embed[tokens].float()
        for i, layer in enumerate(self.layers):
            h = h + self.attention(i, layer, rms_norm(h, layer.attn_norm, cfg.rms_eps), start, cache)
            h = h + self.ffn(layer, rms_norm(h, layer.ffn_norm, cfg.rms_eps))
        return linear(rms_norm(h, self.norm, cfg.rms_eps), self.output)
