"""Modelled decode time of one step (one token for each of `batch` sequences) for a placement.

Each part costs max(bytes read / bandwidth, FLOPs / FLOP/s) on the device it lives on. A neuron is read when it
fires for any sequence of the batch and computed once per sequence it fires for; so is an expert of a mixture when
a sequence's token chooses it (its firing probability being the chance a token does), its router and any shared
expert running with attention. Per layer: attention, then the
GPU and CPU halves of the FFN concurrently (the slower one counts), plus a synchronisation cost (a latency and the
hidden state across PCIe both ways) whenever the layer's work spans both devices. Attention reads every KV row the
policy keeps for a full context (all `ctx_size` of them under `full`), the worst step of a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qinfer.planner.budget import BudgetOptions, kv_cache_bytes
from qinfer.planner.device_profiles import DeviceProfile
from qinfer.planner.model_layout import ModelLayout
from qinfer.planner.placement import Placement


@dataclass(frozen=True)
class LayerTimes:
    gpu_neuron: np.ndarray
    cpu_neuron: np.ndarray
    predictor_gpu: float
    predictor_cpu: float
    attention_gpu: float
    attention_cpu: float
    sync: float

    def scaled(self, factor: float) -> LayerTimes:
        return LayerTimes(
            gpu_neuron=self.gpu_neuron * factor,
            cpu_neuron=self.cpu_neuron * factor,
            predictor_gpu=self.predictor_gpu * factor,
            predictor_cpu=self.predictor_cpu * factor,
            attention_gpu=self.attention_gpu * factor,
            attention_cpu=self.attention_cpu * factor,
            sync=self.sync * factor,
        )


@dataclass(frozen=True)
class TimeModel:
    layers: tuple[LayerTimes, ...]
    output_gpu: float
    output_cpu: float
    batch: int

    def ffn_seconds(self, placement: Placement, index: int) -> float:
        """The slower of the layer's GPU and CPU FFN halves, each with the predictor if it runs there."""
        layer = self.layers[index]
        mask = placement.gpu_neurons[index]
        on_gpu = bool(mask.any())
        gpu = float(layer.gpu_neuron[mask].sum()) + (layer.predictor_gpu if on_gpu else 0.0)
        cpu = float(layer.cpu_neuron[~mask].sum()) + (0.0 if on_gpu else layer.predictor_cpu)
        return max(gpu, cpu)

    @staticmethod
    def spans_both(placement: Placement, index: int) -> bool:
        mask = placement.gpu_neurons[index]
        if placement.attention_on_gpu[index]:
            return not bool(mask.all())
        return bool(mask.any())

    def layer_seconds(self, placement: Placement, index: int) -> float:
        layer = self.layers[index]
        attention = layer.attention_gpu if placement.attention_on_gpu[index] else layer.attention_cpu
        sync = layer.sync if self.spans_both(placement, index) else 0.0
        return attention + self.ffn_seconds(placement, index) + sync

    def step_seconds(self, placement: Placement) -> float:
        total = sum(self.layer_seconds(placement, i) for i in range(len(self.layers)))
        return total + (self.output_gpu if placement.output_on_gpu else self.output_cpu)

    def tokens_per_second(self, placement: Placement) -> float:
        return self.batch / self.step_seconds(placement)


def seconds(n_bytes: float | np.ndarray, flops: float | np.ndarray, device: DeviceProfile) -> float | np.ndarray:
    """The cost model, the planner's and the runtime's split alike (runtime/ffn/split_cost.py): reading a part's
    bytes and computing its FLOPs overlap, so the slower of the two counts."""
    read, compute = n_bytes / device.bandwidth, flops / device.flops
    if isinstance(read, np.ndarray) or isinstance(compute, np.ndarray):
        return np.maximum(read, compute)
    # The runtime's split asks for one neuron per layer and step: plain floats keep numpy's per-call cost off it.
    return max(read, compute)


def build_time_model(
    layout: ModelLayout,
    firing: tuple[np.ndarray, ...],
    gpu: DeviceProfile,
    cpu: DeviceProfile,
    options: BudgetOptions,
) -> TimeModel:
    batch = options.batch
    kv_read = kv_cache_bytes(layout, options)
    attention_flops_extra = 4 * options.kv_policy.attended_rows(options.ctx_size) * layout.spec.hidden * batch
    hidden_transfer = 2 * batch * layout.spec.hidden * 4
    sync = gpu.sync_latency + hidden_transfer / gpu.pcie_bandwidth
    layers = []
    for layer, p in zip(layout.layers, firing, strict=True):
        read = (1.0 - (1.0 - p) ** batch) * layer.neuron_bytes
        compute = batch * p * 2 * layer.neuron_weights
        attention_bytes = layer.attention_bytes + kv_read
        attention_flops = 2 * layer.attention_weights * batch + attention_flops_extra
        predictor_flops = 2 * layer.predictor_weights * batch
        layers.append(
            LayerTimes(
                gpu_neuron=seconds(read, compute, gpu),
                cpu_neuron=seconds(read, compute, cpu),
                predictor_gpu=float(seconds(layer.predictor_bytes, predictor_flops, gpu)),
                predictor_cpu=float(seconds(layer.predictor_bytes, predictor_flops, cpu)),
                attention_gpu=float(seconds(attention_bytes, attention_flops, gpu)),
                attention_cpu=float(seconds(attention_bytes, attention_flops, cpu)),
                sync=sync,
            )
        )
    output_flops = 2 * layout.output_weights * batch
    return TimeModel(
        layers=tuple(layers),
        output_gpu=float(seconds(layout.output_bytes, output_flops, gpu)),
        output_cpu=float(seconds(layout.output_bytes, output_flops, cpu)),
        batch=batch,
    )
