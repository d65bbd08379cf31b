"""Per-step GPU/CPU split: a cost model of one layer's sparse FFN on each side, and the balance point.

Both sides read each active neuron's rows once (bytes) and do 2 * rows * E FLOPs per token. A CPU neuron
can be shipped to the GPU for one step (the CPU gathers its rows, PCIe carries them); a GPU neuron can be
computed on the CPU from the mapped file instead. The split that finishes both sides together minimises
the step's time, and it moves with the active counts and the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.device_profiles import DeviceProfile

# How quickly measured CPU times replace the profile's estimate, and how far they may move it: a measured time
# also holds per-call overheads that moving neurons does not remove, which would otherwise inflate the estimate.
CALIBRATION_WEIGHT = 0.2
CALIBRATION_RANGE = (0.125, 8.0)


@dataclass
class SplitCosts:
    """Seconds per neuron: reading its rows and, per token, its FLOPs, on each side; `ship` for PCIe."""

    cpu_read: float
    cpu_flop: float
    gpu_read: float
    gpu_flop: float
    ship: float
    ship_latency: float = 0.0  # fixed cost of a step that ships anything (a host-to-device copy and its sync)
    cpu_scale: float = 1.0  # measured / modelled CPU time, from `calibrate`

    @classmethod
    def from_profiles(
        cls, neuron_bytes: float, neuron_flops: float, gpu: DeviceProfile, cpu: DeviceProfile
    ) -> SplitCosts:
        pcie = gpu.pcie_bandwidth or gpu.bandwidth
        return cls(
            cpu_read=neuron_bytes / cpu.bandwidth,
            cpu_flop=neuron_flops / cpu.flops,
            gpu_read=neuron_bytes / gpu.bandwidth,
            gpu_flop=neuron_flops / gpu.flops,
            ship=neuron_bytes / pcie,
            ship_latency=gpu.sync_latency,
        )

    def cpu_per_neuron(self, batch: int) -> float:
        return self.cpu_scale * (self.cpu_read + batch * self.cpu_flop)

    def gpu_per_neuron(self, batch: int) -> float:
        return self.gpu_read + batch * self.gpu_flop

    def calibrate(self, neurons: int, batch: int, seconds: float) -> None:
        """Fold a measured CPU-side time into the CPU estimate."""
        if neurons <= 0 or seconds <= 0:
            return
        modelled = neurons * (self.cpu_read + batch * self.cpu_flop)
        scale = self.cpu_scale + CALIBRATION_WEIGHT * (seconds / modelled - self.cpu_scale)
        self.cpu_scale = min(max(scale, CALIBRATION_RANGE[0]), CALIBRATION_RANGE[1])


def step_times(costs: SplitCosts, n_gpu: int, n_cpu: int, batch: int, move: int) -> tuple[float, float]:
    """(GPU seconds, CPU seconds) for one layer after moving `move` neurons (see `balance`)."""
    c, g = costs.cpu_per_neuron(batch), costs.gpu_per_neuron(batch)
    if move >= 0:
        gather = costs.cpu_scale * costs.cpu_read
        latency = costs.ship_latency if move else 0.0
        return n_gpu * g + move * (costs.ship + g) + latency, (n_cpu - move) * c + move * gather
    return (n_gpu + move) * g, (n_cpu - move) * c


def balance(costs: SplitCosts, n_gpu: int, n_cpu: int, batch: int) -> int:
    """Signed number of active neurons to move this step: > 0 ships that many CPU neurons to the GPU, < 0 computes
    that many GPU neurons on the CPU; the integer that minimises the slower side's time."""
    c, g = costs.cpu_per_neuron(batch), costs.gpu_per_neuron(batch)
    gather = costs.cpu_scale * costs.cpu_read
    gpu_t, cpu_t = n_gpu * g, n_cpu * c
    if cpu_t > gpu_t:
        # Ship m: n_gpu*g + m*(ship+g) + latency = (n_cpu-m)*c + m*gather.
        denom = costs.ship + g + c - gather
        ideal = (cpu_t - gpu_t - costs.ship_latency) / denom if denom > 0 else 0.0
        candidates = {max(1, min(n_cpu, int(ideal) + d)) for d in (0, 1)} if n_cpu else set()
    else:
        # Give m GPU neurons to the CPU: (n_gpu-m)*g = (n_cpu+m)*c.
        ideal = (gpu_t - cpu_t) / (g + c) if g + c > 0 else 0.0
        candidates = {-max(0, min(n_gpu, int(ideal) + d)) for d in (0, 1)}
    candidates.add(0)
    return min(sorted(candidates), key=lambda m: (max(step_times(costs, n_gpu, n_cpu, batch, m)), abs(m)))
