"""Device profiles made up for tests of the split's cost model."""

from __future__ import annotations

from typing import Literal

from qinfer.planner.device_profiles import DeviceProfile


def device(
    kind: Literal["gpu", "cpu"], bandwidth: float, flops: float, pcie: float = 0.0, latency: float = 0.0
) -> DeviceProfile:
    """A device reading `bandwidth` bytes/s and computing `flops` FLOP/s, with `pcie` bytes/s to the host."""
    return DeviceProfile(kind, kind, "", 1 << 30, bandwidth, flops, pcie_bandwidth=pcie, sync_latency=latency)
