"""The native sparse FFN (sparse_ffn_kernel.c) for one decode token on f16 CPU rows, built on first use.

The kernel is compiled with the machine's C compiler (`$CC`, else `cc`) and OpenMP into the user cache
(`$XDG_CACHE_HOME/qinfer/kernels`, named by a hash of the source and the compiler), and loaded with ctypes.
Where it cannot be built the runtime keeps torch's gather path, so the kernel is an accelerator, never a
requirement; QINFER_NATIVE=0 turns it off (for side-by-side benchmarks and debugging).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("sparse_ffn_kernel.c")
VARIANT_CODES = {"llama": 0, "bamboo": 1, "falcon": 2}
# Tuned flags first; the portable build is for compilers that do not know -march=native.
FLAG_SETS = (["-O3", "-march=native"], ["-O3"])


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qinfer" / "kernels"


def _build(compiler: str, target: Path) -> str | None:
    """Compile SOURCE into `target` (atomically); the compiler's last error line when no flag set works."""
    target.parent.mkdir(parents=True, exist_ok=True)
    error = ""
    for flags in FLAG_SETS:
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
        os.close(fd)
        cmd = [compiler, *flags, "-fopenmp", "-shared", "-fPIC", str(SOURCE), "-o", tmp]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            Path(tmp).unlink(missing_ok=True)
            return str(exc)
        if done.returncode == 0:
            os.replace(tmp, target)
            # Builds of older sources are never loaded again.
            for stale in target.parent.glob("sparse_ffn_*.so"):
                if stale != target:
                    stale.unlink(missing_ok=True)
            return None
        Path(tmp).unlink(missing_ok=True)
        error = (done.stderr.strip().splitlines() or ["failed"])[-1]
    return error


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The loaded kernel, or None where no compiler with OpenMP builds it (one line on stderr says so)."""
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(SOURCE.read_bytes() + f"{compiler}|{platform.machine()}".encode()).hexdigest()[:16]
    target = cache_dir() / f"sparse_ffn_{key}.so"
    try:
        if not target.exists() and (error := _build(compiler, target)) is not None:
            print(
                f"qinfer: sparse FFN kernel not built ({compiler}: {error}); using torch's slower path",
                file=sys.stderr,
            )
            return None
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        print(f"qinfer: sparse FFN kernel not loaded ({exc}); using torch's slower path", file=sys.stderr)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.qinfer_sparse_ffn.argtypes = [p, i64, p, i64, p, i64, p, i64, p, i64, ctypes.c_int, p, p, ctypes.c_int]
    lib.qinfer_sparse_ffn.restype = None
    return lib


def _rows_ok(t: torch.Tensor | None) -> bool:
    return t is None or (
        isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.float16 and t.stride(1) == 1
    )


def applies(variant: str, x: torch.Tensor, gate: object, up: object, down_t: object) -> bool:
    """Whether the kernel takes this call: one CPU token over f16 row-major rows (quantized rows stay on torch)."""
    return (
        os.environ.get("QINFER_NATIVE", "1") != "0"
        and x.shape[0] == 1
        and (gate is not None or variant == "falcon")
        and x.device.type == "cpu"
        and all(_rows_ok(t) for t in (gate, up, down_t))  # type: ignore[arg-type]
        and kernel() is not None
    )


def sparse_ffn(
    variant: str, x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor, down_t: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """FFN output [1, E] float32 of neurons `ids` for the single token x [1, E]; see `applies`."""
    lib = kernel()
    assert lib is not None
    n = up.shape[1]
    xf = x.reshape(-1).float().contiguous()
    ids64 = ids.to(torch.int64).contiguous()
    act = torch.empty(ids64.numel())
    out = torch.empty(1, down_t.shape[1])
    g = up if gate is None else gate
    lib.qinfer_sparse_ffn(
        g.data_ptr(), g.stride(0), up.data_ptr(), up.stride(0), down_t.data_ptr(), down_t.stride(0),
        xf.data_ptr(), n, ids64.data_ptr(), ids64.numel(), VARIANT_CODES[variant], act.data_ptr(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out
