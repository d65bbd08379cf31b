"""The GPU's hot-FFN kernels (kernels/hot_ffn.py) against a float64 reference, on every form, selection and row type:
on the GPU where there is one, else through Triton's interpreter on the CPU, so machines without a GPU check them
too. Skipped where triton is not installed (it comes with CUDA builds of torch, and with the dev extra on Linux)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from qinfer.core.architectures import ACTIVATIONS, FfnForm
from qinfer.runtime.kernels.quant_rows import QuantizedMatrix

# tests/conftest.py runs them in Triton's interpreter where there is no GPU.
pytest.importorskip("triton")
from qinfer.runtime.kernels import hot_ffn as kernels  # noqa: E402
from qinfer.runtime.kernels.hot_ffn import Select, activate, down, hot_ffn, matvec  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FORMS = {**ACTIVATIONS, "relu-up": FfnForm(gated=False, relu_up=False)}
# E not a multiple of the kernel's column loop, slots not a multiple of its row block, so the edges are exercised.
TOKENS, E, SLOTS, NEURONS = 3, 160, 45, 64


def q4_0(rows: torch.Tensor) -> QuantizedMatrix:
    blocks = quantize(rows.numpy(), GGMLQuantizationType.Q4_0)
    return QuantizedMatrix(torch.from_numpy(blocks).to(DEVICE), GGMLQuantizationType.Q4_0)


def as_float64(w: torch.Tensor | QuantizedMatrix) -> torch.Tensor:
    return (w.dense() if isinstance(w, QuantizedMatrix) else w).double().cpu()


def reference(
    form: FfnForm,
    x: torch.Tensor,
    gate: torch.Tensor | QuantizedMatrix | None,
    up: torch.Tensor | QuantizedMatrix,
    slot_neuron: torch.Tensor,
    select: Select,
    threshold: float,
    scores: torch.Tensor | None,
) -> torch.Tensor:
    x64 = x.double().cpu()
    u = x64 @ as_float64(up).T
    chosen = (slot_neuron >= 0).cpu()[None, :].expand(x.shape[0], -1).clone()
    if select == Select.PREDICTOR:
        assert scores is not None
        picked = scores.double().cpu()[:, slot_neuron.cpu().clamp(min=0)]
        chosen &= picked >= threshold
    if not form.gated:
        act = torch.relu(u)
    else:
        g = x64 @ as_float64(gate).T
        g = torch.nn.functional.silu(g) if form.act == "silu" else torch.relu(g)
        if select == Select.GATE:
            chosen &= g.abs() > threshold
        act = g * (torch.relu(u) if form.relu_up else u)
    return torch.where(chosen, act, 0.0)


@pytest.fixture(params=["f32", "f16", "q4_0"])
def weights(request: pytest.FixtureRequest) -> dict[str, torch.Tensor | QuantizedMatrix]:
    gen = torch.Generator().manual_seed(0)
    raw = {name: torch.randn(SLOTS, E, generator=gen) / E**0.5 for name in ("gate", "up", "down_t")}
    if request.param == "q4_0":
        return {name: q4_0(w) for name, w in raw.items()}
    dtype = torch.float32 if request.param == "f32" else torch.float16
    return {name: w.to(dtype).to(DEVICE) for name, w in raw.items()}


@pytest.fixture(params=["one program", "many programs"])
def tiling(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' own tiles, or tiles small enough that the test's tokens and slots span several programs (the
    tokens two, the down product's slot groups two), and the row products loop over the columns in steps of a
    single Q4_0 block, as a block of eight tokens does."""
    if request.param == "many programs":
        monkeypatch.setattr(kernels, "TOKENS_PER_PROGRAM", 2)
        monkeypatch.setattr(kernels, "ROWS_PER_GROUP", kernels.ROWS_PER_PROGRAM)
        monkeypatch.setattr(kernels, "PRODUCTS_PER_LOOP", 2 * 32)


@pytest.mark.parametrize("form_name", list(FORMS))
@pytest.mark.parametrize("select", list(Select))
def test_activate_and_down_equal_float64(
    weights: dict[str, torch.Tensor | QuantizedMatrix], form_name: str, select: Select, tiling: None
) -> None:
    form = FORMS[form_name]
    if select == Select.GATE and not form.gated:
        pytest.skip("only a gated form selects by its gate")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, E, generator=gen)
    # Some slots empty, the rest holding neurons out of order, as a neuron cache leaves them.
    slot_neuron = torch.randperm(NEURONS, generator=gen)[:SLOTS].int()
    slot_neuron[::7] = -1
    scores = torch.randn(TOKENS, NEURONS, generator=gen)
    threshold = 0.3 if select == Select.PREDICTOR else 0.05
    gate = weights["gate"] if form.gated else None
    args = (form, x.to(DEVICE), gate, weights["up"], slot_neuron.to(DEVICE), select, threshold, scores.to(DEVICE))
    expected = reference(*args)
    act = activate(*args)
    assert torch.allclose(act.double().cpu(), expected, rtol=1e-4, atol=1e-5)
    assert 0 < int((expected != 0).sum()) < expected.numel()
    out = down(act, weights["down_t"])
    assert torch.allclose(out.double().cpu(), act.double().cpu() @ as_float64(weights["down_t"]), rtol=1e-4, atol=1e-5)


def test_gate_and_up_of_different_layouts_are_refused() -> None:
    gate = torch.zeros(SLOTS, E, dtype=torch.float16, device=DEVICE)
    up = q4_0(torch.zeros(SLOTS, E))
    slot_neuron = torch.arange(SLOTS, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="one type and row length"):
        activate(ACTIVATIONS["relu"], torch.zeros(1, E, device=DEVICE), gate, up, slot_neuron, Select.ALL)


def test_rows_no_token_selects_are_not_read() -> None:
    """A row of NaNs that nothing selects leaves the output finite: masked-off rows are never loaded. The whole FFN
    is its two kernels' product, bit for bit."""
    form = ACTIVATIONS["relu"]
    gen = torch.Generator().manual_seed(2)
    gate, up, down_t = (torch.randn(SLOTS, E, generator=gen).to(DEVICE) for _ in range(3))
    for w in (gate, up, down_t):
        w[5] = float("nan")
    slot_neuron = torch.arange(SLOTS, dtype=torch.int32, device=DEVICE)
    scores = torch.ones(1, SLOTS, device=DEVICE)
    scores[0, 5] = -1.0
    x = torch.randn(1, E, device=DEVICE)
    out = hot_ffn(form, x, gate, up, down_t, slot_neuron, Select.PREDICTOR, 0.0, scores)
    assert bool(torch.isfinite(out).all())
    act = activate(form, x, gate, up, slot_neuron, Select.PREDICTOR, 0.0, scores)
    assert bool((act != 0).any()) and torch.equal(out, down(act, down_t))


@pytest.mark.parametrize("rows", ["f16", "f32", "Q4_0"])
@pytest.mark.parametrize("tokens", [1, 3, 11])
def test_matvec_equals_float64(rows: str, tokens: int) -> None:
    """The plain product over the same row reader (the dense parts of a Q4_0 file on a GPU), with row and column
    counts off the kernel's blocks, and more tokens than one program takes."""
    w32 = torch.randn(SLOTS, E)
    w = q4_0(w32) if rows == "Q4_0" else w32.to(getattr(torch, {"f16": "float16", "f32": "float32"}[rows])).to(DEVICE)
    x = torch.randn(tokens, E, device=DEVICE)
    out = matvec(x, w)
    expected = x.double().cpu() @ as_float64(w).T
    assert out.shape == (tokens, SLOTS) and out.dtype == torch.float32
    assert torch.allclose(out.double().cpu(), expected, rtol=1e-5, atol=1e-4)


def test_the_kernels_build_for_a_hopper_gpu_without_spilling() -> None:
    """Built by triton's compiler for sm_90 as the launchers launch them (tests/support/hopper_build.py), in a
    process without the interpreter: what only a GPU would otherwise show, a kernel that does not build, or one that
    spills its products to memory (kernels/hot_ffn.py's PRODUCTS_PER_LOOP). A frame of a few bytes is no spill:
    spilled products took a hundred bytes and more."""
    if torch.cuda.is_available():
        pytest.skip("a GPU builds the kernels for itself in the tests beside this one (the GPU check's time is short)")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[3]
    command = [sys.executable, "-m", "tests.support.hopper_build"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert done.returncode == 0 and done.stdout, done.stderr
    built = [json.loads(line) for line in done.stdout.splitlines()]
    if "skip" in built[0]:
        pytest.skip(built[0]["skip"])
    assert len(built) == 24
    assert [b for b in built if b["stack"] > 16] == []
