"""The OPT forward block over GGUF tensors, as the engine's opt graph runs it.

Pre-LayerNorm blocks with biases on every projection and norm, no rope: positions come from a learned table read
at position + 2 (docs/formats.md#opt); the output head is the token embedding. The predictor reads the residual
stream before ffn_norm, and down's bias is added here since it belongs to no neuron.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qinfer.core.architectures import architecture
from qinfer.core.names import BIAS, Tensor, tensor_name
from qinfer.runtime.kernels.decode_layer import HeadRows, LayerRows
from qinfer.runtime.kernels.weight_rows import linear
from qinfer.runtime.kv.batch import Step, TokenBatch, table_rows
from qinfer.runtime.kv.cache import Cache
from qinfer.runtime.model.forward import TransformerForward, down_bias, kept_rows
from qinfer.runtime.model.model_file import ModelFile
from qinfer.runtime.model.norms import Norm, layer_norm, norm_weights

Linear = tuple[torch.Tensor, torch.Tensor]  # weight and bias


@dataclass
class OPTBlock:
    attn_norm: Norm
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    ffn_norm: Norm
    down_bias: torch.Tensor


def _linear(model: ModelFile, part: Tensor, i: int) -> Linear:
    return model.tensor(tensor_name(part, i)), model.tensor(tensor_name(part, i, BIAS))


def affine(x: torch.Tensor, w: Linear) -> torch.Tensor:
    return linear(x, w[0]) + w[1].float()


class OPTForward(TransformerForward):
    """The native layer step (kernels/decode_layer.py) computes `block`'s decode steps, one call a step."""

    def native_rows(self) -> list[LayerRows]:
        return [
            LayerRows(
                a.attn_norm[0], a.q[0], a.k[0], a.v[0], a.o[0], a.ffn_norm[0], a.attn_norm[1], a.ffn_norm[1],
                a.q[1], a.k[1], a.v[1], a.o[1], a.down_bias,
            )
            for a in self.attn
        ]  # fmt: skip

    def native_head(self) -> HeadRows:
        return HeadRows(self.norm[0], self.output, self.norm[1])

    def load_block(self, model: ModelFile, i: int) -> OPTBlock:
        return OPTBlock(
            attn_norm=norm_weights(model, Tensor.ATTN_NORM, i),
            q=_linear(model, Tensor.ATTN_Q, i),
            k=_linear(model, Tensor.ATTN_K, i),
            v=_linear(model, Tensor.ATTN_V, i),
            o=_linear(model, Tensor.ATTN_OUT, i),
            ffn_norm=norm_weights(model, Tensor.FFN_NORM, i),
            down_bias=down_bias(model, i),
        )

    def load_head(self, model: ModelFile) -> None:
        self.norm = norm_weights(model, Tensor.OUTPUT_NORM, device=self.device)
        self.output = self.embed.to(self.device)
        self.positions = model.tensor(tensor_name(Tensor.POSITION_EMBD))
        self.offset = architecture(model.config.arch).position_offset

    def embed_tokens(self, batch: TokenBatch) -> torch.Tensor:
        positions = table_rows(self.positions, batch.positions + self.offset)
        rows = table_rows(self.embed, batch.tokens).float() + positions.float()
        return rows.to(self.device)

    def block(
        self, i: int, h: torch.Tensor, step: Step, cache: Cache, prefill: bool, keep: list[int] | None
    ) -> torch.Tensor:
        cfg, n, w, eps = self.cfg, h.shape[0], self.attn[i], self.cfg.norm_eps
        x = layer_norm(h, w.attn_norm, eps)
        queries = cache.query_rows(step, keep)
        xq = x if queries is None else x[queries]
        q = affine(xq, w.q).view(xq.shape[0], cfg.heads, cfg.head_dim)
        k = affine(x, w.k).view(n, cfg.kv_heads, cfg.head_dim)
        v = affine(x, w.v).view(n, cfg.kv_heads, cfg.head_dim)
        h, out = kept_rows(h, affine(cache.attend(q, k, v, i, step, queries), w.o), keep, queries)
        h = h + out
        ffn = self.feed_forward(i, layer_norm(h, w.ffn_norm, eps), h, step, prefill, keep)
        return h + ffn + w.down_bias.float()

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return linear(layer_norm(h, self.norm, self.cfg.norm_eps), self.output)
