"""Forward pre-hooks on the router of every layer of a model with experts: count, per expert, the tokens routed to it.

The router is found through the family's `HfModules.router` (qinfer.core.architectures); its choice is recomputed
from its input and weight by the project's own routing rule, so the counts do not depend on what a transformers
version makes the router return.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from qinfer.core.architectures import Architecture
from qinfer.core.expert_routing import route
from qinfer.core.model_spec import Experts
from qinfer.prep.profile.ffn_taps import hooked, submodule


@contextlib.contextmanager
def routing_counts(
    layers: list[nn.Module], arch: Architecture, experts: Experts, counts: torch.Tensor
) -> Iterator[None]:
    """While active, every forward pass adds, per layer i and expert j, the number of tokens whose top-k chose
    expert j to counts[i, j] (int64, [L, N]); each token adds `experts.used` in all."""

    def on_input(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0]
            # The router's own product (same input, weight and dtype), so near-ties fall as they fall in the model.
            logits = F.linear(x.reshape(-1, x.shape[-1]), module.weight)
            chosen, _ = route(logits, experts.used, experts.norm_top_k)
            counts[i] += torch.bincount(chosen.flatten(), minlength=experts.count).to(counts.device)

        return hook

    if arch.hf.router is None:
        raise ValueError(f"the {arch.name} family has experts but its table entry names no router")
    modules = [submodule(layer, arch.hf.router) for layer in layers]
    with hooked([module.register_forward_pre_hook(on_input(i)) for i, module in enumerate(modules)]):
        yield
