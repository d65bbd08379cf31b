"""The forward block of the LLaMA-shaped families (llama, bamboo, qwen2, qwen2moe, qwen3moe) over GGUF tensors.

Weights stay in the file's dtype (mapped, not copied); each matmul runs in that dtype and the residual stream is
kept in float32. LLaMA's q/k rows are in ggml's rotary layout
(docs/formats.md#qk-permutation-and-falcons-qkv-regrouping), so its rope rotates adjacent pairs; Qwen2 keeps
Hugging Face's rows, rotates halves, and adds biases to q, k and v; Qwen3-MoE normalises each head of q and k
before rope.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from qinfer.core.architectures import architecture
from qinfer.core.names import BIAS, Tensor, tensor_name
from qinfer.runtime.ffn.hybrid import HybridRunner
from qinfer.runtime.kernels.decode_layer import HeadRows, LayerRows
from qinfer.runtime.kernels.weight_rows import linear
from qinfer.runtime.kv.batch import Step
from qinfer.runtime.kv.cache import Cache
from qinfer.runtime.model.forward import FFNRunner, TransformerForward, kept_rows
from qinfer.runtime.model.graph_step import GRAPHS_VARIABLE, GraphSteps
from qinfer.runtime.model.model_file import ModelFile
from qinfer.runtime.model.norms import rms_norm
from qinfer.runtime.model.rope import ROTATIONS


@dataclass
class AttentionWeights:
    attn_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    ffn_norm: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # RMSNorm weights over each head (Qwen3)
    k_norm: torch.Tensor | None = None


def _biased(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.float()


class LlamaForward(TransformerForward):
    """Attention, norms and output head on `device`; the FFN through `ffn` (default: dense, on the CPU). `block` is
    the whole layer; the native layer step (kernels/decode_layer.py) computes the same, as one call, for the decode
    steps it takes (forward.py's loop asks it)."""

    def __init__(self, model: ModelFile, ffn: FFNRunner | None = None, device: torch.device | str = "cpu"):
        super().__init__(model, ffn, device)
        self.rotate = ROTATIONS[architecture(self.cfg.arch).rope]
        split_on_gpu = isinstance(self.ffn, HybridRunner) and self.ffn.device == self.device
        if self.device.type == "cuda" and split_on_gpu and os.environ.get(GRAPHS_VARIABLE, "1") != "0":
            self.graphs = GraphSteps(self, self.ffn)

    def native_rows(self) -> list[LayerRows]:
        return [
            LayerRows(a.attn_norm, a.q, a.k, a.v, a.o, a.ffn_norm, q_bias=a.q_bias, k_bias=a.k_bias, v_bias=a.v_bias,
                      q_norm=a.q_norm, k_norm=a.k_norm)
            for a in self.attn
        ]  # fmt: skip

    def native_head(self) -> HeadRows:
        return HeadRows(self.norm, self.output)

    def load_block(self, model: ModelFile, i: int) -> AttentionWeights:
        t, arch = model.tensor, architecture(model.config.arch)
        extra = {}
        if arch.qkv_bias:
            extra = {
                f"{name}_bias": t(tensor_name(part, i, BIAS))
                for name, part in (("q", Tensor.ATTN_Q), ("k", Tensor.ATTN_K), ("v", Tensor.ATTN_V))
            }
        if arch.qk_norm:
            extra |= {"q_norm": t(tensor_name(Tensor.ATTN_Q_NORM, i)), "k_norm": t(tensor_name(Tensor.ATTN_K_NORM, i))}
        return AttentionWeights(
            attn_norm=t(tensor_name(Tensor.ATTN_NORM, i)),
            q=t(tensor_name(Tensor.ATTN_Q, i)),
            k=t(tensor_name(Tensor.ATTN_K, i)),
            v=t(tensor_name(Tensor.ATTN_V, i)),
            o=t(tensor_name(Tensor.ATTN_OUT, i)),
            ffn_norm=t(tensor_name(Tensor.FFN_NORM, i)),
            **extra,
        )

    def load_head(self, model: ModelFile) -> None:
        self.norm = model.tensor(tensor_name(Tensor.OUTPUT_NORM)).to(self.device)
        # A file of a tied model may have no output tensor (llama.cpp leaves it out): the head is the embedding.
        output = model.tensors.get(tensor_name(Tensor.OUTPUT))
        self.output = (self.embed if output is None else output).to(self.device)

    def attention(
        self, i: int, x: torch.Tensor, step: Step, cache: Cache, queries: list[int] | None = None
    ) -> torch.Tensor:
        """Attention's output for the tokens of x [T, E]; with `queries` (Cache.query_rows), for those rows alone:
        only their queries are projected and attended, over every token's keys and values."""
        cfg, n, w = self.cfg, x.shape[0], self.attn[i]
        assert step.cos is not None and step.sin is not None
        xq, cos, sin = x, step.cos, step.sin
        if queries is not None:
            xq, cos, sin = x[queries], cos[queries], sin[queries]
        q = _biased(linear(xq, w.q), w.q_bias).view(xq.shape[0], cfg.heads, cfg.head_dim)
        k = _biased(linear(x, w.k), w.k_bias).view(n, cfg.kv_heads, cfg.head_dim)
        v = _biased(linear(x, w.v), w.v_bias).view(n, cfg.kv_heads, cfg.head_dim)
        if w.q_norm is not None and w.k_norm is not None:
            q, k = rms_norm(q, w.q_norm, cfg.norm_eps), rms_norm(k, w.k_norm, cfg.norm_eps)
        q, k = self.rotate(q, cos, sin), self.rotate(k, step.cos, step.sin)
        return linear(cache.attend(q, k, v, i, step, queries), w.o)

    def attention_block(
        self, i: int, h: torch.Tensor, step: Step, cache: Cache, keep: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i up to its FFN: the residual stream h with attention (on h's RMSNorm) added, and the FFN's input;
        with `keep` (increasing indices of h's rows), both for those tokens alone."""
        w, eps = self.attn[i], self.cfg.norm_eps
        queries = cache.query_rows(step, keep)
        out = self.attention(i, rms_norm(h, w.attn_norm, eps), step, cache, queries)
        h, out = kept_rows(h, out, keep, queries)
        h = h + out
        return h, rms_norm(h, w.ffn_norm, eps)

    def block(
        self, i: int, h: torch.Tensor, step: Step, cache: Cache, prefill: bool, keep: list[int] | None
    ) -> torch.Tensor:
        """Layer i on the residual stream h: attention and then the FFN, each on the RMSNorm of its input and added
        back; the FFN's predictor reads h itself."""
        h, x = self.attention_block(i, h, step, cache, keep)
        return h + self.feed_forward(i, x, h, step, prefill, keep)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(h, self.norm, self.cfg.norm_eps), self.output)
