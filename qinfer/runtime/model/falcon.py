"""The ReLU Falcon forward block (Falcon-40B's layout) over GGUF tensors, as llama.cpp's falcon graph runs it.

Each block reads its input h through two LayerNorms: attn_norm_2 feeds attention, attn_norm the FFN
(relu(up)), and both outputs are added to h at once (parallel attention). The fused QKV rows are in the
"jploski" order (all q heads, then k, then v; docs/formats.md#qk-permutation-and-falcons-qkv-regrouping), and rope
rotates the two halves of each head (ggml's NeoX mode), so q/k are not permuted as LLaMA's are. The predictor
reads the layer input h.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qinfer.core.names import Tensor, tensor_name
from qinfer.runtime.kernels.decode_layer import HeadRows, LayerRows
from qinfer.runtime.kernels.weight_rows import linear, row_slice
from qinfer.runtime.kv.batch import Step
from qinfer.runtime.kv.cache import Cache
from qinfer.runtime.model.forward import TransformerForward, kept_rows
from qinfer.runtime.model.model_file import ModelFile
from qinfer.runtime.model.norms import Norm, layer_norm, norm_weights
from qinfer.runtime.model.rope import rotate_half


@dataclass
class FalconAttention:
    attn_norm: Norm
    ffn_norm: Norm
    qkv: torch.Tensor
    o: torch.Tensor


class FalconForward(TransformerForward):
    """Attention, norms and output head on `device`; the FFN through `ffn` (default: dense, on the CPU). The native
    layer step (kernels/decode_layer.py) computes `block`'s decode steps, one call a step, with the fused QKV
    rows read as q's, k's and v's."""

    parallel = True

    def native_rows(self) -> list[LayerRows]:
        q_rows, kv_rows = self.cfg.heads * self.cfg.head_dim, self.cfg.kv_heads * self.cfg.head_dim
        rows = []
        for a in self.attn:
            q, k, v = (row_slice(a.qkv, start, n) for start, n in ((0, q_rows), (q_rows, kv_rows),
                                                                   (q_rows + kv_rows, kv_rows)))  # fmt: skip
            rows.append(LayerRows(a.attn_norm[0], q, k, v, a.o, a.ffn_norm[0], a.attn_norm[1], a.ffn_norm[1]))
        return rows

    def native_head(self) -> HeadRows:
        return HeadRows(self.norm[0], self.output, self.norm[1])

    def load_block(self, model: ModelFile, i: int) -> FalconAttention:
        return FalconAttention(
            attn_norm=norm_weights(model, Tensor.ATTN_NORM_2, i),
            ffn_norm=norm_weights(model, Tensor.ATTN_NORM, i),
            qkv=model.tensor(tensor_name(Tensor.ATTN_QKV, i)),
            o=model.tensor(tensor_name(Tensor.ATTN_OUT, i)),
        )

    def load_head(self, model: ModelFile) -> None:
        self.norm = norm_weights(model, Tensor.OUTPUT_NORM, device=self.device)
        self.output = model.tensor(tensor_name(Tensor.OUTPUT)).to(self.device)

    def attention(
        self, i: int, x: torch.Tensor, step: Step, cache: Cache, queries: list[int] | None = None
    ) -> torch.Tensor:
        """Attention's output for the tokens of x [T, E]; with `queries` (Cache.query_rows), for those rows alone:
        only their queries are projected (by the fused matrix's q rows) and attended, over every token's keys and
        values."""
        cfg, n, qkv = self.cfg, x.shape[0], self.attn[i].qkv
        assert step.cos is not None and step.sin is not None
        q_rows, kv_rows = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        if queries is None:
            q, k, v = linear(x, qkv).split((q_rows, kv_rows, kv_rows), dim=-1)
            cos, sin = step.cos, step.sin
        else:
            q = linear(x[queries], row_slice(qkv, 0, q_rows))
            k, v = linear(x, row_slice(qkv, q_rows, 2 * kv_rows)).split((kv_rows, kv_rows), dim=-1)
            cos, sin = step.cos[queries], step.sin[queries]
        q = rotate_half(q.reshape(q.shape[0], cfg.heads, cfg.head_dim), cos, sin)
        k = rotate_half(k.reshape(n, cfg.kv_heads, cfg.head_dim), step.cos, step.sin)
        v = v.reshape(n, cfg.kv_heads, cfg.head_dim)
        return linear(cache.attend(q, k, v, i, step, queries), self.attn[i].o)

    def block(
        self, i: int, h: torch.Tensor, step: Step, cache: Cache, prefill: bool, keep: list[int] | None
    ) -> torch.Tensor:
        w, eps = self.attn[i], self.cfg.norm_eps
        queries = cache.query_rows(step, keep)
        attention = self.attention(i, layer_norm(h, w.attn_norm, eps), step, cache, queries)
        h, attention = kept_rows(h, attention, keep, queries)
        return h + attention + self.feed_forward(i, layer_norm(h, w.ffn_norm, eps), h, step, prefill, keep)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return linear(layer_norm(h, self.norm, self.cfg.norm_eps), self.output)
