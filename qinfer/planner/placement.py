"""Where each part of the model lives: the planner's output, and what the time and VRAM models evaluate."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Placement:
    """Per layer a boolean mask over FFN neurons, or over a mixture's experts (True = GPU), whether its attention
    (and KV cache) is on the GPU, and whether the output head is. A layer's predictor is on the GPU exactly when any
    of its neurons is."""

    gpu_neurons: tuple[np.ndarray, ...]
    attention_on_gpu: tuple[bool, ...]
    output_on_gpu: bool

    def predictor_on_gpu(self, layer: int) -> bool:
        return bool(self.gpu_neurons[layer].any())

    def gpu_neuron_count(self) -> int:
        return int(sum(int(mask.sum()) for mask in self.gpu_neurons))
