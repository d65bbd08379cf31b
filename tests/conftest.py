"""Shared tiny models: built once per test session from the synth builder, converted with our converter."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on a machine without a GPU; triton reads the setting when first imported,
    # which transformers does as the modules below load.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qinfer.prep.convert.convert import convert
from qinfer.prep.synth.build import SynthReport, SynthShape, build_synth
from qinfer.prep.synth.moe import MOE_FAMILIES, build_moe
from qinfer.prep.synth.swiglu import FAMILIES, build_swiglu
from qinfer.runtime.kernels import row_kernels

TINY = SynthShape(layers=2, hidden=64, ffn=256, heads=4, kv_heads=2, vocab=512, context=256, predictor_rank=32)
TINY_STEPS = 60
# The tiny model with two heads of 32 over one kv head: a q8_0 KV cache needs heads of whole 32-value blocks, and the
# tiny model's are 16.
WIDE_HEADS = SynthShape(layers=2, hidden=64, ffn=256, heads=2, kv_heads=1, vocab=512, context=256, predictor_rank=32)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SynthReport:
    return build_synth(tmp_path_factory.mktemp("synth") / "tiny", TINY, seed=0, train_steps=TINY_STEPS)


@pytest.fixture(scope="session")
def gguf_files(tiny: SynthReport, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model as PowerInfer and dense GGUF, in f32 and f16."""
    out = tmp_path_factory.mktemp("gguf")
    files = {}
    for outtype in ("f32", "f16"):
        files[f"pi-{outtype}"] = convert(
            tiny.model_dir, out / f"tiny-{outtype}.powerinfer.gguf", tiny.predictor_dir, outtype
        ).outfile
        files[f"dense-{outtype}"] = convert(tiny.model_dir, out / f"tiny-{outtype}.gguf", None, outtype).outfile
    return files


@pytest.fixture(scope="session")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """WIDE_HEADS as an f16 PowerInfer GGUF."""
    out = tmp_path_factory.mktemp("wide_heads")
    model = build_synth(out / "synth", WIDE_HEADS, seed=0, train_steps=TINY_STEPS)
    return convert(model.model_dir, out / "wide.powerinfer.gguf", model.predictor_dir, "f16").outfile


@pytest.fixture(scope="session")
def swiglu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """A tiny untrained checkpoint of each SwiGLU family (weights large enough that small errors show in the
    logits) and its dense f32 GGUF, by family."""
    out = tmp_path_factory.mktemp("swiglu")
    files = {}
    for family in FAMILIES:
        model = build_swiglu(out / family, family, init_std=0.1)
        files[family] = {"model": model, "dense-f32": convert(model, out / f"{family}.gguf", None, "f32").outfile}
    return files


@pytest.fixture(scope="session")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """A tiny untrained checkpoint of each mixture-of-experts family and its dense f32 GGUF, by family."""
    out = tmp_path_factory.mktemp("moe")
    files = {}
    for family in MOE_FAMILIES:
        model = build_moe(out / family, family)
        files[family] = {"model": model, "dense-f32": convert(model, out / f"{family}.gguf", None, "f32").outfile}
    return files


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":")[1].split()}


@pytest.fixture(params=list(row_kernels.TARGETS))
def kernel_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on each kernel build: the CPU's own (native), its own without the tile unit (AMX), the AVX2
    path and the plain C path, so that a path this CPU would not pick is still checked here. A target the CPU
    cannot run is skipped, and so is the build without AMX on a CPU without it (the native build again)."""
    target = str(request.param)
    if target != "native":
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("x86 instruction-set variants")
        if target == "avx2" and not {"avx2", "fma", "f16c"} <= _cpu_flags():
            pytest.skip("this CPU does not run AVX2 with FMA and F16C")
        if target == "no-amx" and not {"amx_tile", "amx_int8"} <= _cpu_flags():
            pytest.skip("this CPU has no AMX: its native build is the one without")
    monkeypatch.setenv("QINFER_KERNEL_TARGET", target)
    if target != "native" and row_kernels.kernel() is None:
        pytest.skip("no C compiler builds the kernel")
    return target
