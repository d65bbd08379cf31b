"""A mixture-of-experts FFN in torch, routed as transformers' Mixtral, Qwen2-MoE and Qwen3-MoE blocks route it: a
softmax over the router's logits, each token's top-k experts (their weights rescaled to sum to 1 where the model
says so), each expert a SwiGLU, and Qwen2-MoE's shared expert added under a sigmoid gate."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qinfer.core.model_spec import Experts
from qinfer.runtime.kernels import row_kernels
from qinfer.runtime.kernels.quant_rows import Weight
from qinfer.runtime.kernels.weight_rows import linear


@dataclass(frozen=True)
class SwiGLU:
    """One expert: gate and up [F, E], down [E, F] (as HF and llama.cpp store them)."""

    gate: Weight
    up: Weight
    down: Weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(F.silu(linear(x, self.gate)) * linear(x, self.up), self.down)


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's router [N, E] and experts, stacked (float tensors, or quantized stacks whose index is an expert):
    gate and up [N, F, E], down [N, E, F]; the shared expert and its gate [1, E] where the model has one."""

    router: Weight
    gate: Weight
    up: Weight
    down: Weight
    shared: SwiGLU | None = None
    shared_gate: Weight | None = None

    def expert(self, j: int) -> SwiGLU:
        return SwiGLU(self.gate[j], self.up[j], self.down[j])


def route(router_logits: torch.Tensor, used: int, norm_top_k: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's chosen experts [T, k] and their weights [T, k], in float32 as transformers computes them."""
    weights, chosen = torch.topk(torch.softmax(router_logits.float(), dim=-1), used, dim=-1)
    if norm_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return chosen, weights


class ExpertRunner:
    """Every layer's experts on the CPU; each expert runs once per call, on the tokens that chose it, so the
    tokens of a batch (a prompt, or one of each of several sequences) are routed each on its own."""

    def __init__(self, layers: list[ExpertWeights], experts: Experts):
        self.layers = layers
        self.experts = experts

    def __call__(self, layer: int, x: torch.Tensor, h: torch.Tensor, prefill: bool) -> torch.Tensor:
        w = self.layers[layer]
        chosen, weights = route(linear(x, w.router), self.experts.used, self.experts.norm_top_k)
        # One token's experts in one native call: a call per matrix and expert costs more than a small expert's
        # products. Several tokens share experts, which the loop below reads once for all of them.
        out = row_kernels.moe_ffn(x, w.gate, w.up, w.down, chosen, weights) if x.shape[0] == 1 else None
        if out is None:
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for j in chosen.unique().tolist():
                tokens, rank = torch.where(chosen == j)
                out.index_add_(0, tokens, w.expert(j)(x[tokens]) * weights[tokens, rank, None])
        if w.shared is not None and w.shared_gate is not None:
            out += torch.sigmoid(linear(x, w.shared_gate)) * w.shared(x)
        return out
