"""Forward hooks on the FFN of every layer: count firing neurons, or capture the predictor's input."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn


@contextlib.contextmanager
def firing_counts(layers: list[nn.Module], arch: str, counts: torch.Tensor) -> Iterator[None]:
    """While active, every forward pass adds, per layer i and neuron j, the number of tokens on which neuron j
    fired to counts[i, j] (int64, [L, F]). Only counts, never per-token activations, are kept."""
    gates: dict[int, torch.Tensor] = {}
    handles = []

    def on_gate(i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if arch == "bamboo":
                gates[i] = out > 0  # combined with up_proj's output, which the MLP computes next
            else:
                counts[i] += (out > 0).flatten(0, -2).sum(0).to(counts.device)

        return hook

    def on_up(i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            counts[i] += (gates.pop(i) & (out != 0)).flatten(0, -2).sum(0).to(counts.device)

        return hook

    for i, layer in enumerate(layers):
        if arch == "falcon":
            # relu(up(x)) is the whole FFN: a neuron fires where up is positive.
            handles.append(layer.mlp.dense_h_to_4h.register_forward_hook(on_gate(i)))
            continue
        handles.append(layer.mlp.gate_proj.register_forward_hook(on_gate(i)))
        if arch == "bamboo":
            handles.append(layer.mlp.up_proj.register_forward_hook(on_up(i)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def ffn_inputs(layers: list[nn.Module], captured: dict[int, torch.Tensor], arch: str = "llama") -> Iterator[None]:
    """While active, captured[i] holds layer i's predictor input from the latest forward pass: the residual stream
    before ffn_norm, or for falcon (attention and FFN read the same input) the layer's input."""

    def on_input(i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            captured[i] = args[0].detach()

        return hook

    tapped = layers if arch == "falcon" else [layer.post_attention_layernorm for layer in layers]
    handles = [module.register_forward_pre_hook(on_input(i)) for i, module in enumerate(tapped)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
