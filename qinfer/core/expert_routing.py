"""How a mixture-of-experts router chooses, as transformers' Mixtral, Qwen2-MoE and Qwen3-MoE routers choose: the
one rule that the runtime's expert FFN and the profiler's routing counts share. Kept apart from the rest of the core,
which never imports torch."""

from __future__ import annotations

import torch


def route(router_logits: torch.Tensor, used: int, norm_top_k: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's chosen experts [T, k] and their weights [T, k], in float32 as transformers computes them."""
    weights, chosen = torch.topk(torch.softmax(router_logits.float(), dim=-1), used, dim=-1)
    if norm_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return chosen, weights
