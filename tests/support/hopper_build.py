"""Build the hot-FFN kernels for an NVIDIA Hopper GPU (sm_90) as their launchers launch them, on a machine without
one: triton's own compiler and ptxas, no driver, no launch. Run as a process of its own, without Triton's
interpreter (which replaces the kernels with Python):

    python -m tests.support.hopper_build

Prints one JSON object per launch (kernel, constexprs, registers, stack bytes), or {"skip": why} where triton has
no NVIDIA backend to build with."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from qinfer.core.architectures import ACTIVATIONS
from qinfer.runtime.kernels.quant_rows import QuantizedMatrix

HOPPER = 90
ELEMENT_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8",
                 torch.int32: "i32", torch.int64: "i64"}  # fmt: skip
KERNELS = ("_activate_kernel", "_down_kernel", "_matvec_kernel")
TOKENS = (1, 4, 8)  # a decode step's token block (2), and the wider ones
E, ROWS = 4096, 64

Launch = tuple[str, tuple[Any, ...], dict[str, Any]]


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **constexprs)` keeps the call instead of launching it."""

    def __init__(self, name: str, calls: list[Launch]):
        self.name, self.calls = name, calls

    def __getitem__(self, grid: object) -> Any:
        return lambda *args, **constexprs: self.calls.append((self.name, args, constexprs))


def _launches() -> list[Launch]:
    from qinfer.runtime.kernels import hot_ffn

    calls: list[Launch] = []
    for name in KERNELS:
        setattr(hot_ffn, name, Recorder(name, calls))
    q4_0 = QuantizedMatrix(torch.zeros(ROWS, E // 32 * 18, dtype=torch.uint8), GGMLQuantizationType.Q4_0)
    for rows in (torch.zeros(ROWS, E, dtype=torch.float16), q4_0):
        slot_neuron = torch.zeros(ROWS, dtype=torch.int32)
        for tokens in TOKENS:
            x, scores = torch.zeros(tokens, E), torch.zeros(tokens, ROWS)
            relu, silu = ACTIVATIONS["relu"], ACTIVATIONS["silu"]
            hot_ffn.activate(relu, x, rows, rows, slot_neuron, hot_ffn.Select.PREDICTOR, 0.5, scores)
            hot_ffn.activate(silu, x, rows, rows, slot_neuron, hot_ffn.Select.GATE, 0.5)
            hot_ffn.down(torch.zeros(tokens, ROWS), rows)
            hot_ffn.matvec(x, rows)
    return calls


def _source(kernel: Any, args: tuple[Any, ...], constexprs: dict[str, Any]) -> Any:
    """What triton's launcher compiles for these arguments: their types, an int equal to 1 made a constant, and a
    pointer or int divisible by 16 marked so (tt.divisibility)."""
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature, constants, attrs = {}, dict(constexprs), {}
    for i, (name, value) in enumerate(zip(names, args, strict=False)):
        aligned = False
        if isinstance(value, torch.Tensor):
            signature[name], aligned = "*" + ELEMENT_TYPES[value.dtype], value.data_ptr() % 16 == 0
        elif isinstance(value, int) and value == 1:
            signature[name], constants[name] = "constexpr", 1
        elif isinstance(value, int):
            signature[name], aligned = ("i32" if -(1 << 31) <= value < 1 << 31 else "i64"), value % 16 == 0
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"no triton type for {name}={value!r}")
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    signature |= {name: "constexpr" for name in constexprs}
    return ASTSource(kernel, signature, {(names.index(n),): v for n, v in constants.items()}, attrs)


def _resources(cubin: bytes, cuobjdump: Path) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True, text=True, check=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    if found is None:
        raise RuntimeError(f"cuobjdump gave no register count: {usage.stdout!r}")
    return {"registers": int(found[1]), "stack": int(found[2])}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: the interpreter builds nothing")
    try:
        import triton
        import triton.backends.nvidia as nvidia
        from triton.backends.compiler import GPUTarget
    except ImportError as exc:
        print(json.dumps({"skip": f"triton cannot build for NVIDIA here ({exc})"}))
        return
    cuobjdump = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    if not cuobjdump.is_file():
        print(json.dumps({"skip": f"triton {triton.__version__} came without cuobjdump"}))
        return
    from qinfer.runtime.kernels import hot_ffn

    kernels = {name: getattr(hot_ffn, name) for name in KERNELS}
    for name, args, constexprs in _launches():
        built = triton.compile(_source(kernels[name], args, constexprs), target=GPUTarget("cuda", HOPPER, 32))
        print(json.dumps({"kernel": name, "constexprs": constexprs, **_resources(built.asm["cubin"], cuobjdump)}))


if __name__ == "__main__":
    main()
