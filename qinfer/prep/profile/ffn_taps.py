"""Forward hooks on the FFN of every layer: count firing neurons, capture the predictor's input, or mask neurons.

Which modules are hooked comes from the family's `HfModules` (qinfer.core.architectures).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from qinfer.core.architectures import Architecture, FfnForm


def submodule(root: nn.Module, path: str) -> nn.Module:
    module = root
    for part in path.split("."):
        module = getattr(module, part)
    return module


@contextlib.contextmanager
def hooked(handles: list[RemovableHandle]) -> Iterator[None]:
    """Keeps already registered hooks for the `with` block and removes them after it, whatever happens."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def forward_hooks(
    layers: list[nn.Module], path: str, make: Callable[[int], Callable[..., object]]
) -> list[RemovableHandle]:
    """`make(i)` as a forward hook on module `path` of each layer i."""
    return [submodule(layer, path).register_forward_hook(make(i)) for i, layer in enumerate(layers)]


def counted_module(arch: Architecture) -> str:
    """The projection whose positive outputs are the firing neurons: the gate where there is one, else up."""
    return arch.hf.gate or arch.hf.up


@contextlib.contextmanager
def firing_counts(
    layers: list[nn.Module], arch: Architecture, form: FfnForm, counts: torch.Tensor
) -> Iterator[None]:
    """While active, every forward pass adds, per layer i and neuron j, the number of tokens on which neuron j
    fired to counts[i, j] (int64, [L, F]). Only counts, never per-token activations, are kept."""
    gates: dict[int, torch.Tensor] = {}
    # relu(gate) * relu(up) fires only where both do: the gate's mask waits for up's output, computed next.
    both = arch.hf.gate is not None and form.relu_up

    def on_counted(i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if both:
                gates[i] = out > 0
            else:
                counts[i] += (out > 0).flatten(0, -2).sum(0).to(counts.device)

        return hook

    def on_up(i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            counts[i] += (gates.pop(i) & (out != 0)).flatten(0, -2).sum(0).to(counts.device)

        return hook

    handles = forward_hooks(layers, counted_module(arch), on_counted)
    if both:
        handles += forward_hooks(layers, arch.hf.up, on_up)
    with hooked(handles):
        yield


@contextlib.contextmanager
def ffn_inputs(layers: list[nn.Module], captured: dict[int, torch.Tensor], arch: Architecture) -> Iterator[None]:
    """While active, captured[i] holds layer i's predictor input from the latest forward pass: the input of the norm
    in front of the FFN (the residual stream after attention; for falcon, whose blocks run attention and FFN side by
    side, the layer's input)."""

    def on_input(i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            captured[i] = args[0].detach()

        return hook

    norms = [submodule(layer, arch.hf.ffn_norm) for layer in layers]
    with hooked([module.register_forward_pre_hook(on_input(i)) for i, module in enumerate(norms)]):
        yield
