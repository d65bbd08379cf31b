"""What a benchmark ran on, for its header: the CPU's name and the instruction sets our kernels use on it (a
virtual machine often names its CPU no better than "Intel(R) Xeon(R) Processor")."""

from __future__ import annotations

import platform
from pathlib import Path

from qinfer.runtime.kernels import row_kernels

# /proc/cpuinfo's flags for the instruction sets the kernels have paths for, widest first.
VECTOR_SETS = (("avx512_vnni", "AVX-512 VNNI"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cpu_name() -> str:
    names = [line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")]
    return names[0] if names else platform.machine()


def cpu() -> str:
    """The CPU's name, its widest vector set the kernels have a path for, AVX512-FP16 and AMX where it has them, and
    the kernel build in use: e.g. "Intel(R) Xeon(R) Processor (AVX-512 VNNI, AVX512-FP16, AMX; kernels: native,
    AMX in use)"."""
    flags = {flag for line in _cpuinfo() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    sets = [next((name for flag, name in VECTOR_SETS if flag in flags), "no AVX2")]
    sets += [name for flag, name in (("avx512_fp16", "AVX512-FP16"), ("amx_int8", "AMX")) if flag in flags]
    lib = row_kernels.kernel() if row_kernels.enabled() else None
    if lib is None:
        kernels = "no native kernels"
    else:
        tile_unit = getattr(lib, "qinfer_tile_unit", lambda: 0)()
        kernels = f"kernels: {row_kernels.target()}" + {0: "", 1: ", AMX refused", 2: ", AMX in use"}[tile_unit]
    return f"{cpu_name()} ({', '.join(sets)}; {kernels})"
