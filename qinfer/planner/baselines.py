"""Placements to compare the ILP with: a greedy fill of the true budget, and the reference engine's own planner."""

from __future__ import annotations

import math

import numpy as np

from qinfer.planner.budget import VramAccount
from qinfer.planner.model_layout import ModelLayout
from qinfer.planner.neuron_groups import NeuronGroups, group_neurons
from qinfer.planner.placement import Placement

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
