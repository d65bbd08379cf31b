"""VRAM accounting against hand-worked numbers; budgets too small for the dense parts; device profiles."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from qinfer.core.errors import UserError
from qinfer.planner import device_profiles
from qinfer.planner.budget import SCRATCH_FIXED, BudgetOptions, account, require_budget, vram_used
from qinfer.planner.device_profiles import load_profile
from qinfer.planner.model_layout import layout_for_spec, read_model_layout
from qinfer.planner.placement import Placement
from tests.support.cli_in_process import run_in_process
from tests.support.shapes import shape_spec


def test_tiny_f16_gguf_matches_hand_worked_account(gguf_files: dict[str, Path]) -> None:
    # Tiny model: E=64, F=256, 4 heads of 16, 2 kv heads, vocab 512, predictor P=32, 2 layers, f16 2-D, f32 norms.
    layout = read_model_layout(gguf_files["pi-f16"])
    acct = account(layout, BudgetOptions(ctx_size=100, batch=3))
    assert acct.neuron_bytes == (3 * 64 * 2, 3 * 64 * 2)  # gate, up and down_t rows of 64 f16
    assert acct.predictors == ((64 * 32 + 32 * 256) * 2,) * 2
    # q and o 64x64, k and v 64x32, f16; attn_norm and ffn_norm 64 f32
    assert acct.attention == ((2 * 64 * 64 + 2 * 64 * 32) * 2 + 2 * 64 * 4,) * 2
    assert acct.kv_cache == (2 * 100 * 3 * 2 * 16 * 2,) * 2  # K and V x ctx x batch x kv heads x head dim x f16
    assert acct.output == 64 * 512 * 2 + 64 * 4
    assert acct.embeddings == 0
    # 256 MiB + batch x (2 buffers x (hidden, 2 x kv, q/k/v pair, FFN pair, scores over ctx per head) x f32, and the
    # f32 keys and values over ctx, cast and masked: 4 x kv x ctx x f32)
    assert acct.scratch == SCRATCH_FIXED + 3 * (2 * (2 * 64 + 2 * 32 + 2 * 256 + 4 * 100) * 4 + 4 * 32 * 100 * 4)
    assert acct.dense == 2 * 25088 + 2 * 38400 + 65792 + acct.scratch


def test_f32_and_q4_neuron_bytes(gguf_files: dict[str, Path]) -> None:
    assert read_model_layout(gguf_files["pi-f32"]).layers[0].neuron_bytes == 3 * 64 * 4
    q4 = layout_for_spec(
        shape_spec("llama", layers=1, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000),
        1024,
        weight_type="Q4_0",
    )
    assert q4.layers[0].neuron_bytes == 3 * 4096 / 32 * 18
    falcon = layout_for_spec(
        shape_spec("falcon", layers=1, hidden=8192, ffn=32768, heads=128, kv_heads=8, vocab=65024),
        1024,
    )
    assert falcon.layers[0].neuron_bytes == 2 * 8192 * 2  # no gate


def test_dense_model_is_refused(gguf_files: dict[str, Path]) -> None:
    with pytest.raises(UserError, match="dense GGUF"):
        read_model_layout(gguf_files["dense-f16"])


def test_placement_bytes_by_category() -> None:
    layout = layout_for_spec(
        shape_spec("llama", layers=2, hidden=64, ffn=256, heads=4, kv_heads=2, vocab=512),
        32,
    )
    acct = account(layout, BudgetOptions(ctx_size=10, batch=1, gpu_embeddings=True))
    masks = (np.arange(256) < 10, np.zeros(256, dtype=bool))
    used = vram_used(acct, Placement(masks, (True, False), False))
    assert used["ffn neurons"] == 10 * 384
    assert used["predictors"] == acct.predictors[0]
    assert used["attention"] == acct.attention[0]
    assert used["kv cache"] == 2 * 10 * 2 * 16 * 2
    assert used["output head"] == 0
    assert used["embeddings"] == 64 * 512 * 2


def test_too_small_budget_names_the_minimum() -> None:
    layout = layout_for_spec(
        shape_spec("llama", layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=32000),
        1024,
    )
    acct = account(layout, BudgetOptions(ctx_size=4096, batch=4))
    with pytest.raises(UserError) as info:
        require_budget(acct, 8 << 30, dense_on_gpu=True)
    message = str(info.value)
    assert "\n" not in message
    # 28.5033 GiB: the need rounded up, a budget that holds it.
    assert f"at least 28.5033 GiB ({acct.dense} bytes)" in message and acct.dense <= 28.5033 * (1 << 30)
    require_budget(acct, acct.dense, dense_on_gpu=True)
    require_budget(acct, acct.scratch, dense_on_gpu=False)


def test_device_profiles() -> None:
    gpu = load_profile("rtx4090", "gpu")
    assert (gpu.bandwidth, gpu.pcie_bandwidth, gpu.memory_bytes) == (1008e9, 25e9, 24 << 30)
    assert load_profile("generic-desktop", "cpu").bandwidth == 60e9
    assert load_profile("h200", "gpu").bandwidth == 4800e9
    assert load_profile("rtx2080ti", "gpu").pcie_bandwidth == 12e9
    assert load_profile("h100", "gpu").bandwidth == 3350e9
    with pytest.raises(UserError, match="known gpu profiles: h100, h100-pcie, h200, rtx2080ti, rtx4090"):
        load_profile("a100", "gpu")
    with pytest.raises(UserError, match="is a cpu profile"):
        load_profile("generic-desktop", "gpu")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("bandwidth_gb_s", 0),
        ("tflops", -1.5),
        ("memory_gib", math.nan),
        ("pcie_gb_s", math.inf),
        ("pcie_gb_s", 0),  # a GPU's link: the time to ship a neuron would divide by it
        ("sync_latency_us", -1),
        ("bandwidth_gb_s", 1e300),
        ("tflops", True),
        ("memory_gib", "24"),
        ("bandwidth_gb_s", None),
    ],
)
def test_a_device_profile_with_a_meaningless_number_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: object
) -> None:
    profile = json.loads((device_profiles.PROFILE_DIR / "rtx4090.json").read_text())
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({**profile, "name": "mine", field: value}))
    monkeypatch.setattr(device_profiles, "PROFILE_DIR", tmp_path)
    result = run_in_process("profiles")
    assert result.returncode == 2 and result.stdout == ""
    line = f"error: device profile {mine}: {field} is {value!r}, not a number in ["
    assert result.stderr.startswith(line) and result.stderr.endswith("; fix or delete it\n"), result.stderr
    assert result.stderr.count("\n") == 1


def test_a_cpu_profile_needs_no_pcie_link_and_a_kind_is_one_of_two(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = json.loads((device_profiles.PROFILE_DIR / "generic-desktop.json").read_text())
    assert cpu["pcie_gb_s"] == 0
    (tmp_path / "mine.json").write_text(json.dumps({**cpu, "name": "mine", "sync_latency_us": 0}))
    monkeypatch.setattr(device_profiles, "PROFILE_DIR", tmp_path)
    assert load_profile("mine", "cpu").pcie_bandwidth == 0
    (tmp_path / "mine.json").write_text(json.dumps({**cpu, "kind": "tpu"}))
    with pytest.raises(UserError, match="kind is 'tpu', not gpu or cpu"):
        load_profile("mine", "cpu")
