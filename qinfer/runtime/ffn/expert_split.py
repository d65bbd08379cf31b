"""A planned split of a mixture of experts: the router, the shared expert and each layer's resident experts on the
GPU side (CUDA, or the CPU simulating a device), every other expert on the CPU, the two halves summed per token
with the router's weights.

The routing is read back once per layer, the only wait: the device's experts are then queued, the CPU computes
its own while they run, and its [T, E] sum goes back to be added.
"""

from __future__ import annotations

import torch

from qinfer.core.expert_routing import route
from qinfer.runtime.ffn.experts import ExpertRunner, SwiGLU, mixture, shared_output
from qinfer.runtime.kernels.quant_rows import Weight
from qinfer.runtime.kernels.weight_rows import linear

HOST = torch.device("cpu")


class ExpertSplit:
    """`resident[i]`: the ids of layer i's experts kept on `device` (the plan's .gpuidx); `cpu` holds every
    layer's weights as the file maps them and computes the experts that are not resident."""

    def __init__(self, cpu: ExpertRunner, device: torch.device, resident: list[torch.Tensor]):
        self.cpu = cpu
        self.experts = cpu.experts
        self.device = device
        self.routers = [w.router.to(device) for w in cpu.layers]
        self.shared: list[tuple[SwiGLU | None, Weight | None]] = [
            (None, None)
            if w.shared is None or w.shared_gate is None
            else (w.shared.to(device), w.shared_gate.to(device))
            for w in cpu.layers
        ]
        self.resident: list[dict[int, SwiGLU]] = [
            {j: w.expert(j).to(device) for j in ids.tolist()} for w, ids in zip(cpu.layers, resident, strict=True)
        ]

    def resident_count(self, layer: int) -> int:
        return len(self.resident[layer])

    def __call__(self, layer: int, x: torch.Tensor, h: torch.Tensor, prefill: bool) -> torch.Tensor:
        on_device = self.resident[layer]
        x_dev, x_host = x.to(self.device), x.to(HOST)
        chosen, weights = route(linear(x_dev, self.routers[layer]), self.experts.used, self.experts.norm_top_k)
        chosen, weights = chosen.to(HOST), weights.to(HOST)
        out = mixture(on_device.get, x_dev, chosen, weights)
        host = self.cpu.experts_output(layer, x_host, chosen, weights, skip=on_device)
        out += host.to(self.device, non_blocking=True)
        if (shared := shared_output(*self.shared[layer], x_dev)) is not None:
            out += shared
        return out.to(x.device)
