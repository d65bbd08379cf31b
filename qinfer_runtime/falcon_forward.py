"""The ReLU Falcon forward pass (Falcon-40B's layout) over GGUF tensors, as llama.cpp's falcon graph runs it.

Each block reads its input h through two LayerNorms: attn_norm_2 feeds attention, attn_norm the FFN
(relu(up)), and both outputs are added to h at once (parallel attention). The fused QKV rows are in the
"jploski" order (all q heads, then k, then v; see qinfer_prep.convert), and rope rotates the two halves of
each head (ggml's NeoX mode), so q/k are not permuted as LLaMA's are. The predictor reads the layer input h.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qinfer_runtime.ffn_runners import DenseRunner
from qinfer_runtime.llama_forward import ffn_weights, rope_tables
from qinfer_runtime.model_file import ModelFile
from qinfer_runtime.model_forward import FFNRunner, KVCache, TokenBatch, TransformerForward, cached_attention
from qinfer_runtime.weight_rows import linear


@dataclass
class FalconAttention:
    attn_norm: tuple[torch.Tensor, torch.Tensor]
    ffn_norm: tuple[torch.Tensor, torch.Tensor]
    qkv: torch.Tensor
    o: torch.Tensor

    def to(self, device: torch.device) -> FalconAttention:
        return FalconAttention(
            (self.attn_norm[0].to(device), self.attn_norm[1].to(device)),
            (self.ffn_norm[0].to(device), self.ffn_norm[1].to(device)),
            self.qkv.to(device),
            self.o.to(device),
        )


def _attention(model: ModelFile, i: int) -> FalconAttention:
    t, b = model.tensor, f"blk.{i}"
    return FalconAttention(
        attn_norm=(t(f"{b}.attn_norm_2.weight"), t(f"{b}.attn_norm_2.bias")),
        ffn_norm=(t(f"{b}.attn_norm.weight"), t(f"{b}.attn_norm.bias")),
        qkv=t(f"{b}.attn_qkv.weight"),
        o=t(f"{b}.attn_output.weight"),
    )


def layer_norm(x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor], eps: float) -> torch.Tensor:
    weight, bias = norm
    return F.layer_norm(x, (x.shape[-1],), weight.float(), bias.float(), eps)


def apply_neox_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x[i] against x[i + d/2] in each head; x is [T, heads, head_dim]."""
    first, second = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((first * c - second * s, second * c + first * s), dim=-1)


class FalconForward(TransformerForward):
    """Attention, norms and output head on `device`; the FFN through `ffn` (default: dense, on the CPU)."""

    def __init__(self, model: ModelFile, ffn: FFNRunner | None = None, device: torch.device | str = "cpu"):
        self.cfg = model.config
        self.device = torch.device(device)
        self.attn = [_attention(model, i).to(self.device) for i in range(self.cfg.layers)]
        self.embed = model.tensor("token_embd.weight")
        t = model.tensor
        self.norm = (t("output_norm.weight").to(self.device), t("output_norm.bias").to(self.device))
        self.output = t("output.weight").to(self.device)
        self.ffn = ffn or DenseRunner([ffn_weights(model, i) for i in range(self.cfg.layers)])

    def attention(self, i: int, x: torch.Tensor, batch: TokenBatch, cache: KVCache) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        q_rows, kv_rows = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        q, k, v = linear(x, self.attn[i].qkv).split((q_rows, kv_rows, kv_rows), dim=-1)
        cos, sin = rope_tables(cfg, batch.positions.to(self.device))
        q = apply_neox_rope(q.reshape(n, cfg.heads, cfg.head_dim), cos, sin)
        k = apply_neox_rope(k.reshape(n, cfg.kv_heads, cfg.head_dim), cos, sin)
        v = v.reshape(n, cfg.kv_heads, cfg.head_dim)
        return linear(cached_attention(q, k, v, i, batch, cache), self.attn[i].o)

    def block(self, i: int, h: torch.Tensor, batch: TokenBatch, cache: KVCache, prefill: bool) -> torch.Tensor:
        w, eps = self.attn[i], self.cfg.rms_eps
        attention = self.attention(i, layer_norm(h, w.attn_norm, eps), batch, cache)
        return h + attention + self.ffn(i, layer_norm(h, w.ffn_norm, eps), h, prefill)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return linear(layer_norm(h, self.norm, self.cfg.rms_eps), self.output)
