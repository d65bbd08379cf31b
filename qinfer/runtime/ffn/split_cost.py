"""Per-step GPU/CPU split: a cost model of one layer's sparse FFN on each side, and the balance point.

Both sides read each active neuron's rows once (bytes) and do 2 * rows * E FLOPs per token, costed by the
planner's model (qinfer.planner.time_model.seconds), so the split the runtime balances is the one the plan assumed.
A CPU neuron can be shipped to the GPU for one step (the CPU gathers its rows, PCIe carries them); a GPU neuron can
be computed on the CPU from the mapped file instead. The split that finishes both sides together minimises the
step's time, and it moves with the active counts and the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

from qinfer.planner.device_profiles import DeviceProfile
from qinfer.planner.time_model import seconds

# How quickly measured CPU times replace the profile's estimate, and how far they may move it: a measured time
# also holds per-call overheads that moving neurons does not remove, which would otherwise inflate the estimate.
CALIBRATION_WEIGHT = 0.2
CALIBRATION_RANGE = (0.125, 8.0)


@dataclass
class SplitCosts:
    """One neuron's bytes and FLOPs per token, the two devices, and the measured correction of the CPU's time."""

    neuron_bytes: float
    neuron_flops: float
    gpu: DeviceProfile
    cpu: DeviceProfile
    cpu_scale: float = 1.0  # measured / modelled CPU time, from `calibrate`

    def _cpu_model(self, batch: int) -> float:
        return float(seconds(self.neuron_bytes, batch * self.neuron_flops, self.cpu))

    def cpu_per_neuron(self, batch: int) -> float:
        return self.cpu_scale * self._cpu_model(batch)

    def gpu_per_neuron(self, batch: int) -> float:
        return float(seconds(self.neuron_bytes, batch * self.neuron_flops, self.gpu))

    @property
    def gather(self) -> float:
        """The CPU's time to read one neuron's rows for shipping."""
        return self.cpu_scale * float(seconds(self.neuron_bytes, 0.0, self.cpu))

    @property
    def ship(self) -> float:
        """PCIe's time for one neuron's rows."""
        return self.neuron_bytes / (self.gpu.pcie_bandwidth or self.gpu.bandwidth)

    @property
    def ship_latency(self) -> float:
        """The fixed cost of a step that ships anything (a host-to-device copy and its sync)."""
        return self.gpu.sync_latency

    def calibrate(self, neurons: int, batch: int, measured: float) -> None:
        """Fold a measured CPU-side time into the CPU estimate."""
        if neurons <= 0 or measured <= 0:
            return
        scale = self.cpu_scale + CALIBRATION_WEIGHT * (measured / (neurons * self._cpu_model(batch)) - self.cpu_scale)
        self.cpu_scale = min(max(scale, CALIBRATION_RANGE[0]), CALIBRATION_RANGE[1])


@dataclass(frozen=True)
class _PerNeuron:
    """One step's costs of one neuron, worked out once per step rather than once per candidate move."""

    cpu: float
    gpu: float
    gather: float
    ship: float
    ship_latency: float

    @classmethod
    def of(cls, costs: SplitCosts, batch: int) -> _PerNeuron:
        return cls(costs.cpu_per_neuron(batch), costs.gpu_per_neuron(batch), costs.gather, costs.ship,
                   costs.ship_latency)  # fmt: skip

    def times(self, n_gpu: int, n_cpu: int, move: int) -> tuple[float, float]:
        c, g = self.cpu, self.gpu
        if move >= 0:
            latency = self.ship_latency if move else 0.0
            return n_gpu * g + move * (self.ship + g) + latency, (n_cpu - move) * c + move * self.gather
        return (n_gpu + move) * g, (n_cpu - move) * c


def step_times(costs: SplitCosts, n_gpu: int, n_cpu: int, batch: int, move: int) -> tuple[float, float]:
    """(GPU seconds, CPU seconds) for one layer after moving `move` neurons (see `balance`)."""
    return _PerNeuron.of(costs, batch).times(n_gpu, n_cpu, move)


def balance(costs: SplitCosts, n_gpu: int, n_cpu: int, batch: int) -> int:
    """Signed number of active neurons to move this step: > 0 ships that many CPU neurons to the GPU, < 0 computes
    that many GPU neurons on the CPU; the integer that minimises the slower side's time."""
    one = _PerNeuron.of(costs, batch)
    c, g = one.cpu, one.gpu
    gpu_t, cpu_t = n_gpu * g, n_cpu * c
    if cpu_t > gpu_t:
        # Ship m: n_gpu*g + m*(ship+g) + latency = (n_cpu-m)*c + m*gather.
        denom = one.ship + g + c - one.gather
        ideal = (cpu_t - gpu_t - one.ship_latency) / denom if denom > 0 else 0.0
        candidates = {max(1, min(n_cpu, int(ideal) + d)) for d in (0, 1)} if n_cpu else set()
    else:
        # Give m GPU neurons to the CPU: (n_gpu-m)*g = (n_cpu+m)*c.
        ideal = (gpu_t - cpu_t) / (g + c) if g + c > 0 else 0.0
        candidates = {-max(0, min(n_gpu, int(ideal) + d)) for d in (0, 1)}
    candidates.add(0)
    return min(sorted(candidates), key=lambda m: (max(one.times(n_gpu, n_cpu, m)), abs(m)))
