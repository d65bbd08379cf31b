"""Device profiles (bandwidth, FLOP/s, PCIe) from qinfer/profiles/devices/*.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from qinfer import profiles
from qinfer.core.errors import UserError

PROFILE_DIR = Path(profiles.__file__).resolve().parent / "devices"
GIB = 1 << 30
# The CPU a plan and the runtime's cost models assume where none is named.
DEFAULT_CPU = "generic-desktop"


@dataclass(frozen=True)
class DeviceProfile:
    """One device in SI units: bytes, bytes/s, FLOP/s, seconds."""

    name: str
    kind: Literal["gpu", "cpu"]
    description: str
    memory_bytes: int
    bandwidth: float
    flops: float
    pcie_bandwidth: float
    sync_latency: float


def known_profiles(kind: str | None = None) -> list[str]:
    names = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
    return [n for n in names if kind is None or _read(PROFILE_DIR / f"{n}.json").kind == kind]


def load_profile(name: str, kind: Literal["gpu", "cpu"]) -> DeviceProfile:
    """The named profile; an unknown name or one of the wrong kind is a user error that lists the valid ones."""
    path = PROFILE_DIR / f"{name}.json"
    if not path.is_file():
        raise UserError(f"unknown {kind} profile {name!r}; known {kind} profiles: {', '.join(known_profiles(kind))}")
    profile = _read(path)
    if profile.kind != kind:
        raise UserError(f"{name!r} is a {profile.kind} profile; pick a {kind} one: {', '.join(known_profiles(kind))}")
    return profile


def _read(path: Path) -> DeviceProfile:
    try:
        raw = json.loads(path.read_text())
        return DeviceProfile(
            name=str(raw["name"]),
            kind=raw["kind"],
            description=str(raw.get("description", "")),
            memory_bytes=int(float(raw["memory_gib"]) * GIB),
            bandwidth=float(raw["bandwidth_gb_s"]) * 1e9,
            flops=float(raw["tflops"]) * 1e12,
            pcie_bandwidth=float(raw["pcie_gb_s"]) * 1e9,
            sync_latency=float(raw["sync_latency_us"]) * 1e-6,
        )
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"device profile {path} is malformed ({exc}); fix or delete it") from exc
