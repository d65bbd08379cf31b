"""Placements to compare the ILP with: a greedy fill of the true budget, the reference engine's own planner, and for
a mixture of experts llama.cpp's `--n-cpu-moe N`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qinfer.planner.budget import VramAccount, vram_used
from qinfer.planner.model_layout import ModelLayout
from qinfer.planner.neuron_groups import NeuronGroups, group_neurons
from qinfer.planner.placement import Placement
from qinfer.planner.time_model import TimeModel

REFERENCE_GROUP = 256
REFERENCE_BYTES_FACTOR = 4.5


def greedy_placement(acct: VramAccount, firing: tuple[np.ndarray, ...], groups: NeuronGroups, budget: int) -> Placement:
    """All dense parts on the GPU, then groups by firing per byte (a layer's predictor charged with its first group)
    while they fit. Always within `budget` when the dense parts are."""
    room = budget - acct.dense
    candidates = []
    for i, p in enumerate(firing):
        heat = groups.sums(i, p)
        for g in range(groups.count(i)):
            size = len(groups.members(i, g)) * acct.neuron_bytes[i]
            candidates.append((-heat[g] / size, i, g, size))
    candidates.sort()
    chosen = [np.zeros(groups.count(i), dtype=bool) for i in range(len(firing))]
    for _, i, g, size in candidates:
        cost = size + (0 if chosen[i].any() else acct.predictors[i])
        if cost <= room:
            chosen[i][g] = True
            room -= cost
    return Placement(
        gpu_neurons=tuple(groups.mask(i, c) for i, c in enumerate(chosen)),
        attention_on_gpu=(True,) * len(firing),
        output_on_gpu=True,
    )


def reference_capacity(layout: ModelLayout, budget: int) -> int:
    """The engine's neuron cap: the budget left after the dense weights (KV cache and scratch ignored), over its
    rough per-neuron size `F * element bytes * 4.5`, times 4 (gated FFN) or 2."""
    dense_weights = sum(layer.attention_bytes for layer in layout.layers) + layout.output_bytes
    f = max(layer.ffn_neurons for layer in layout.layers)
    per = f * layout.ffn_element_bytes * REFERENCE_BYTES_FACTOR
    return max(0, math.floor((budget - dense_weights) / per)) * (4 if layout.has_gate else 2)


def reference_placement(layout: ModelLayout, firing: tuple[np.ndarray, ...], budget: int) -> Placement:
    """The engine's formulation: maximise GPU-held activation in 256-neuron groups under the neuron cap. Every group
    weighs the same, so taking the hottest groups first is optimal for it."""
    groups = group_neurons(firing, REFERENCE_GROUP)
    capacity = reference_capacity(layout, budget)
    candidates = []
    for i, p in enumerate(firing):
        heat = groups.sums(i, p)
        candidates += [(-heat[g], i, g, len(groups.members(i, g))) for g in range(groups.count(i))]
    candidates.sort()
    chosen = [np.zeros(groups.count(i), dtype=bool) for i in range(len(firing))]
    for _, i, g, size in candidates:
        if size <= capacity:
            chosen[i][g] = True
            capacity -= size
    return Placement(
        gpu_neurons=tuple(groups.mask(i, c) for i, c in enumerate(chosen)),
        attention_on_gpu=(True,) * len(firing),
        output_on_gpu=True,
    )


@dataclass(frozen=True)
class NCpuMoe:
    """llama.cpp's `--n-cpu-moe layers`: the experts of the first `layers` layers on the CPU, everything else (the
    other experts, every dense part, the output head) on the GPU."""

    layers: int
    placement: Placement
    tokens_per_second: float


def n_cpu_moe_placement(acct: VramAccount, layers: int) -> Placement:
    n = len(acct.ffn_neurons)
    return Placement(
        gpu_neurons=tuple(np.full(f, i >= layers) for i, f in enumerate(acct.ffn_neurons)),
        attention_on_gpu=(True,) * n,
        output_on_gpu=True,
    )


def smallest_n_cpu_moe(acct: VramAccount, times: TimeModel, budget: int) -> NCpuMoe | None:
    """The smallest `--n-cpu-moe` whose placement fits `budget`, and its modelled speed; None where even every
    expert on the CPU leaves the dense parts over the budget (a plan with --dense-placement auto)."""
    for layers in range(len(acct.ffn_neurons) + 1):
        placement = n_cpu_moe_placement(acct, layers)
        if sum(vram_used(acct, placement).values()) <= budget:
            return NCpuMoe(layers, placement, times.tokens_per_second(placement))
    return None
