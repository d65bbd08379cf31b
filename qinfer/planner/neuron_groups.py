"""Neurons of a layer sorted hottest first and cut into equal groups: the planner's unit of placement."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qinfer.core.errors import UserError


@dataclass(frozen=True)
class NeuronGroups:
    """`order[l]`: neuron ids, hottest first; group g of layer l is `order[l][starts[l][g] : starts[l][g+1]]`."""

    order: tuple[np.ndarray, ...]
    starts: tuple[np.ndarray, ...]

    def count(self, layer: int) -> int:
        return len(self.starts[layer]) - 1

    def members(self, layer: int, group: int) -> np.ndarray:
        return self.order[layer][self.starts[layer][group] : self.starts[layer][group + 1]]

    def sums(self, layer: int, per_neuron: np.ndarray) -> np.ndarray:
        """Per-group sums of a per-neuron quantity."""
        return np.add.reduceat(per_neuron[self.order[layer]], self.starts[layer][:-1])

    def mask(self, layer: int, chosen: np.ndarray) -> np.ndarray:
        """Neuron mask (True = GPU) of the chosen groups (boolean per group)."""
        mask = np.zeros(len(self.order[layer]), dtype=bool)
        for group in np.flatnonzero(chosen):
            mask[self.members(layer, int(group))] = True
        return mask


def group_neurons(firing: tuple[np.ndarray, ...], group_size: int) -> NeuronGroups:
    if group_size < 1:
        raise UserError("--group-size must be at least 1")
    # A stable sort keeps equally hot neurons in id order, so a plan is reproducible.
    order = tuple(np.argsort(-p, kind="stable") for p in firing)
    starts = tuple(np.append(np.arange(0, len(p), group_size), len(p)) for p in firing)
    return NeuronGroups(order=order, starts=starts)
