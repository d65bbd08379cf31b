"""Device profiles (bandwidth, FLOP/s, PCIe) from qinfer/profiles/devices/*.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from qinfer import profiles
from qinfer.core.errors import UserError
from qinfer.core.numbers import Span, real

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


# Each number a profile file holds: its unit in SI units and the span it must lie in. The spans reach far past
# any device yet keep every time the planner divides out of them finite; only a CPU may lack a PCIe link (0).
_FIELDS: dict[str, tuple[float, Span]] = {
    "memory_gib": (GIB, Span(1e-3, 1e6)),
    "bandwidth_gb_s": (1e9, Span(1e-3, 1e6)),
    "tflops": (1e12, Span(1e-6, 1e6)),
    "pcie_gb_s": (1e9, Span(1e-3, 1e5)),
    "sync_latency_us": (1e-6, Span(0.0, 1e6)),
}
_KINDS = ("gpu", "cpu")


def _read(path: Path) -> DeviceProfile:
    """The profile in `path`, every field checked: a zero, negative or non-finite number would end in a division
    by zero or in a plan faster than any device."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"device profile {path} is malformed ({exc}); fix or delete it") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise UserError(f"device profile {path} is not an object with a name; fix or delete it")
    kind = raw.get("kind")
    if kind not in _KINDS:
        raise UserError(f"device profile {path}: kind is {kind!r}, not {' or '.join(_KINDS)}; fix or delete it")
    si = {key: _field(raw, key, path, kind) for key in _FIELDS}
    return DeviceProfile(
        name=raw["name"],
        kind=kind,
        description=str(raw.get("description", "")),
        memory_bytes=int(si["memory_gib"]),
        bandwidth=si["bandwidth_gb_s"],
        flops=si["tflops"],
        pcie_bandwidth=si["pcie_gb_s"],
        sync_latency=si["sync_latency_us"],
    )


def _field(raw: dict[str, Any], key: str, path: Path, kind: str) -> float:
    """Field `key` of a profile of `kind`, in SI units."""
    unit, span = _FIELDS[key]
    if key == "pcie_gb_s" and kind == "cpu":
        span = Span(0.0, span.high)
    return real(raw.get(key), key, f"device profile {path}", span, "fix or delete it") * unit
