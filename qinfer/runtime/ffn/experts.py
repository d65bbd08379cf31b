"""A mixture-of-experts FFN in torch, routed as transformers' Mixtral, Qwen2-MoE and Qwen3-MoE blocks route it: a
softmax over the router's logits, each token's top-k experts (their weights rescaled to sum to 1 where the model
says so), each expert a SwiGLU, and Qwen2-MoE's shared expert added under a sigmoid gate."""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qinfer.core.expert_routing import route
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

    def to(self, device: torch.device) -> SwiGLU:
        return SwiGLU(self.gate.to(device), self.up.to(device), self.down.to(device))


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


def shared_output(shared: SwiGLU | None, gate: Weight | None, x: torch.Tensor) -> torch.Tensor | None:
    """Qwen2-MoE's shared expert under its sigmoid gate; None for a model without one."""
    if shared is None or gate is None:
        return None
    return torch.sigmoid(linear(x, gate)) * shared(x)


def mixture(
    expert: Callable[[int], SwiGLU | None], x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The sum over each token's chosen experts of its weight times the expert's output, float32 [T, E] on x's
    device; each expert runs once, on the tokens that chose it. `chosen` and `weights` may be host copies of a
    device's routing; the experts `expert` answers None for are left out (another device computes them)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in chosen.unique().tolist():
        if (run := expert(j)) is None:
            continue
        tokens, rank = torch.where(chosen == j)
        scale = weights[tokens, rank, None].to(x.device)
        tokens = tokens.to(x.device)
        out.index_add_(0, tokens, run(x[tokens]) * scale)
    return out


class ExpertRunner:
    """Every layer's experts on the CPU; each expert runs once per call, on the tokens that chose it, so the
    tokens of a batch (a prompt, or one of each of several sequences) are routed each on its own."""

    def __init__(self, layers: list[ExpertWeights], experts: Experts):
        self.layers = layers
        self.experts = experts

    def __call__(self, layer: int, x: torch.Tensor, h: torch.Tensor, prefill: bool) -> torch.Tensor:
        w = self.layers[layer]
        chosen, weights = route(linear(x, w.router), self.experts.used, self.experts.norm_top_k)
        out = self.experts_output(layer, x, chosen, weights)
        shared = shared_output(w.shared, w.shared_gate, x)
        return out if shared is None else out + shared

    def native_experts(self) -> list[ExpertWeights]:
        """For the native layer step (kernels/decode_layer.py): every layer's experts, all on the CPU."""
        return self.layers

    def experts_output(
        self, layer: int, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, skip: Container[int] = ()
    ) -> torch.Tensor:
        """The weighted sum of layer `layer`'s chosen experts on CPU tokens x, leaving out those in `skip` (the ones
        a device computes)."""
        w = self.layers[layer]
        if x.shape[0] == 1:
            # One token's experts in one native call: a call per matrix and expert costs more than a small expert's
            # products. Several tokens share experts, which `mixture` reads once for all of them.
            keep = [i for i, j in enumerate(chosen[0].tolist()) if j not in skip]
            if not keep:
                return torch.zeros(x.shape, dtype=torch.float32)
            out = row_kernels.moe_ffn(x, w.gate, w.up, w.down, chosen[:, keep], weights[:, keep])
            if out is not None:
                return out
        return mixture(lambda j: None if j in skip else w.expert(j), x, chosen, weights)
