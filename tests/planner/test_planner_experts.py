"""A mixture of experts in the plan: a dense GGUF's experts as the unit, placed whole by routing frequency, written
to and reused from the .gpuidx, against llama.cpp's `--n-cpu-moe`, whose modelled speed is checked by hand."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from typer.testing import CliRunner

from qinfer.cli.main import app
from qinfer.core.errors import UserError
from qinfer.core.model_spec import Experts, ModelSpec
from qinfer.core.names import EXPERT_STACKS, tensor_name
from qinfer.formats.gpuidx import read_gpuidx
from qinfer.planner.activation_stats import load_activation
from qinfer.planner.baselines import n_cpu_moe_placement, smallest_n_cpu_moe
from qinfer.planner.budget import GIB, BudgetOptions, account, kv_cache_bytes, vram_used
from qinfer.planner.device_profiles import DEFAULT_CPU, load_profile
from qinfer.planner.make_plan import PlanOptions, compare_expert_splits, dry_run_account, load_or_make_gpuidx
from qinfer.planner.model_layout import layout_for_spec, read_model_layout
from qinfer.planner.time_model import build_time_model
from qinfer.prep.synth.moe import MOE_FAMILIES
from tests.support.fake_activation import write_expert_activation, write_power_law_activation

# Qwen3-MoE's tiny model: 8 experts, 2 chosen per token. Each layer's counts sum to 2 x the 1000 tokens; the
# hottest experts of layer 0 are 1, 3, 5 and 0, of layer 1 are 6, 2, 7 and 4.
TOKENS = 1000
GPU, CPU = load_profile(PlanOptions().gpu, "gpu"), load_profile(DEFAULT_CPU, "cpu")  # the planner's defaults
COUNTS = [[250, 500, 40, 450, 60, 300, 20, 380], [30, 90, 420, 10, 310, 40, 700, 400]]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_layout_bytes_are_the_files_tensor_bytes(moe: dict[str, dict[str, Path]], family: str) -> None:
    path = moe[family]["dense-f32"]
    layout = read_model_layout(path)
    experts = layout.spec.experts
    assert experts is not None and layout.unit == "expert"
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    e = layout.spec.hidden
    for i, layer in enumerate(layout.layers):
        assert layer.ffn_neurons == experts.count
        assert layer.neuron_bytes == 3 * e * experts.ffn * 4  # gate, up and down slices of one expert, f32
        assert layer.neuron_bytes * experts.count == sum(tensors[tensor_name(part, i)] for part in EXPERT_STACKS)
        assert layer.predictor_bytes == 0
    total = sum(layer.neuron_bytes * layer.ffn_neurons + layer.attention_bytes for layer in layout.layers)
    assert total + layout.output_bytes + layout.embedding_bytes == sum(tensors.values())


def test_a_mixtral_shape_has_the_layout_of_its_converted_file(moe: dict[str, dict[str, Path]]) -> None:
    """Mixtral has neither biases nor head norms, so its shape alone gives every byte: attention, norms and the
    router (F32) as the dense part."""
    read = read_model_layout(moe["mixtral"]["dense-f32"])
    shaped = layout_for_spec(read.spec, weight_type="F32")
    assert shaped.layers == read.layers
    assert (shaped.output_bytes, shaped.embedding_bytes) == (read.output_bytes, read.embedding_bytes)
    e, kv, n = 64, 32, 4
    assert read.layers[0].attention_bytes == (2 * e * e + 2 * e * kv) * 4 + 2 * e * 4 + n * e * 4


@pytest.fixture
def qwen3(tmp_path: Path, moe: dict[str, dict[str, Path]]) -> Path:
    path = tmp_path / "qwen3moe.gguf"
    shutil.copy(moe["qwen3moe"]["dense-f32"], path)
    write_expert_activation(tmp_path / "activation", COUNTS, TOKENS)
    return path


def _room_for_6_experts(model: Path) -> tuple[int, int]:
    """A budget holding the dense parts and 6 of the 16 experts with room to spare for less than one more, and
    an expert's bytes. Not 8: in so small a model a layer's sync costs more than its experts, so the plan would
    fill one layer whole and leave the other on the CPU, whatever the counts."""
    _, acct = dry_run_account(model, 1 << 40, PlanOptions())
    expert = int(acct.neuron_bytes[0])
    return acct.dense + 6 * expert + expert // 2, expert


def test_the_most_routed_experts_go_to_the_gpu_within_the_budget(qwen3: Path) -> None:
    budget, expert = _room_for_6_experts(qwen3)
    plan = load_or_make_gpuidx(qwen3, budget, options=PlanOptions(group_size=64))
    assert plan.options.group_size == 1  # experts are placed whole, whatever --group-size says
    assert plan.vram_total <= budget and plan.vram["ffn neurons"] == 6 * expert
    for counts, mask in zip(COUNTS, plan.placement.gpu_neurons, strict=True):
        hottest = np.argsort(counts)[::-1][: int(mask.sum())]
        assert sorted(np.flatnonzero(mask)) == sorted(hottest)
    on_gpu = sum(int(np.asarray(row)[m].sum()) for row, m in zip(COUNTS, plan.placement.gpu_neurons, strict=True))
    assert plan.gpu_activation_share == pytest.approx(on_gpu / (2 * 2 * TOKENS))
    # Room for 6 experts is room for no layer's 8: `--n-cpu-moe` keeps every expert on the CPU.
    assert plan.n_cpu_moe is not None and plan.n_cpu_moe.layers == 2
    assert plan.tokens_per_second > plan.n_cpu_moe.tokens_per_second
    index = read_gpuidx(plan.gpuidx_path)
    assert [len(m) for m in index.gpu_idx] == [8, 8]
    assert [m.astype(bool).tolist() for m in index.gpu_idx] == [m.tolist() for m in plan.placement.gpu_neurons]
    assert index.vram_capacity == 6 * expert
    assert index.provenance is not None and index.provenance.group_size == 1


def test_cli_prints_the_planned_and_n_cpu_moe_speeds_and_their_ratio(qwen3: Path) -> None:
    budget, _ = _room_for_6_experts(qwen3)
    result = CliRunner().invoke(
        app, ["plan", "-m", str(qwen3), "--vram-budget", str(budget / GIB)], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    plan = load_or_make_gpuidx(qwen3, budget)
    assert plan.reused and plan.n_cpu_moe is not None
    ratio = plan.tokens_per_second / plan.n_cpu_moe.tokens_per_second
    for row in (
        f"modelled decode tokens/s {plan.tokens_per_second:.2f}",
        f"--n-cpu-moe 2 modelled tokens/s {plan.n_cpu_moe.tokens_per_second:.2f}",
        f"planned / --n-cpu-moe {ratio:.2f}x",
        "experts on GPU 6 / 16",
    ):
        assert row in " ".join(result.output.replace("│", " ").split()), row
    dry = CliRunner().invoke(app, ["plan", "-m", str(qwen3), "--vram-budget", "1", "--dry-run"], env={"COLUMNS": "200"})
    assert "FFN experts (all)" in dry.output and "16 experts x 24576.0 B" in dry.output


def test_an_expert_plan_is_reused_and_refused_when_stale(qwen3: Path) -> None:
    budget, _ = _room_for_6_experts(qwen3)
    made = load_or_make_gpuidx(qwen3, budget)
    again = load_or_make_gpuidx(qwen3, budget, options=PlanOptions(group_size=7))
    assert again.reused and again.solve is None
    assert [m.tolist() for m in again.placement.gpu_neurons] == [m.tolist() for m in made.placement.gpu_neurons]
    assert again.tokens_per_second == pytest.approx(made.tokens_per_second)
    # The same counts over twice the tokens are half the routing probabilities.
    write_expert_activation(qwen3.parent / "activation", COUNTS, 2 * TOKENS)
    with pytest.raises(UserError, match="stale: activation files changed.*--reset-gpu-index"):
        load_or_make_gpuidx(qwen3, budget)
    assert not load_or_make_gpuidx(qwen3, budget, reset=True).reused


def test_an_activation_directory_of_the_other_unit_is_refused(
    qwen3: Path, tmp_path: Path, gguf_files: dict[str, Path]
) -> None:
    neurons = tmp_path / "neurons"
    write_power_law_activation(neurons, f=8)
    with pytest.raises(UserError, match="counts FFN neurons but this model places experts; profile this model"):
        load_or_make_gpuidx(qwen3, 1 << 40, neurons)
    experts = tmp_path / "experts"
    write_expert_activation(experts, [[1] * 256] * 2, TOKENS)
    powerinfer = tmp_path / "tiny.powerinfer.gguf"
    shutil.copy(gguf_files["pi-f16"], powerinfer)
    with pytest.raises(UserError, match="counts experts but this model places FFN neurons"):
        load_or_make_gpuidx(powerinfer, 1 << 40, experts)


def test_expert_counts_are_routing_probabilities(tmp_path: Path) -> None:
    write_expert_activation(tmp_path, COUNTS, TOKENS)
    stats = load_activation(tmp_path, (8, 8), "expert")
    assert stats.firing[1].tolist() == [c / TOKENS for c in COUNTS[1]]


def test_a_dense_gguf_without_experts_is_still_refused(gguf_files: dict[str, Path]) -> None:
    with pytest.raises(UserError, match="is a dense GGUF; plan a PowerInfer one"):
        read_model_layout(gguf_files["dense-f16"])


def _mixtral(layers: int) -> ModelSpec:
    return ModelSpec(
        arch="llama", name="mixtral", vocab_size=32000, context_length=32768, hidden=4096, layers=layers, ffn=14336,
        heads=32, kv_heads=8, norm_eps=1e-5, experts=Experts(count=8, used=2, ffn=14336),
    )  # fmt: skip


def test_n_cpu_moe_is_the_smallest_n_that_fits() -> None:
    layout = layout_for_spec(_mixtral(4))
    options = BudgetOptions()
    acct = account(layout, options)
    times = build_time_model(layout, (np.full(8, 0.25),) * 4, GPU, CPU, options)
    layer = 8 * acct.neuron_bytes[0]
    budgets = [(acct.dense, 4), (acct.dense + layer, 3), (acct.dense + 3 * layer - 1, 2), (acct.dense + 4 * layer, 0)]
    for budget, n in budgets:
        found = smallest_n_cpu_moe(acct, times, int(budget))
        assert found is not None and found.layers == n
        assert sum(vram_used(acct, found.placement).values()) <= budget
        if n:
            assert sum(vram_used(acct, n_cpu_moe_placement(acct, n - 1)).values()) > budget
        assert found.tokens_per_second == times.tokens_per_second(found.placement)
    assert smallest_n_cpu_moe(acct, times, acct.dense - 1) is None


def test_planned_and_n_cpu_moe_speeds_equal_a_hand_computation() -> None:
    """2 Mixtral layers, room for 8 of the 16 experts. llama.cpp's `--n-cpu-moe 1` runs layer 0's experts on the
    CPU and layer 1's on the GPU; the plan keeps 4 experts of each layer on the GPU, the GPU half of each layer hidden
    under its CPU half. Uniform routing: each expert p = 1/4; skewed: the top half takes 70% of the routings."""
    gpu, host = GPU, CPU
    layout = layout_for_spec(_mixtral(2))
    options = PlanOptions()
    acct = account(layout, options.budget_options())
    layer, spec = layout.layers[0], layout.spec
    expert = acct.neuron_bytes[0]
    budget = int(acct.dense + 8 * expert + expert / 2)
    # One expert chosen by every token: its bytes read and 2 FLOPs per weight, on each device.
    g = max(expert / gpu.bandwidth, 2 * layer.neuron_weights / gpu.flops)
    c = max(expert / host.bandwidth, 2 * layer.neuron_weights / host.flops)
    kv = kv_cache_bytes(layout, options.budget_options())
    attention = max(
        (layer.attention_bytes + kv) / gpu.bandwidth,
        (2 * layer.attention_weights + 4 * options.ctx_size * spec.hidden) / gpu.flops,
    )
    output = max(layout.output_bytes / gpu.bandwidth, 2 * layout.output_weights / gpu.flops)
    sync = gpu.sync_latency + 2 * spec.hidden * 4 / gpu.pcie_bandwidth
    assert 10 * g < c  # so that the GPU half of a layer, up to 7 experts, hides under the CPU half

    uniform = compare_expert_splits(layout, (np.full(8, 0.25),) * 2, budget, options)
    assert uniform.n_cpu_moe is not None and uniform.n_cpu_moe.layers == 1
    n_cpu_moe_step = 2 * attention + (2 * c + sync) + 2 * g + output
    assert uniform.n_cpu_moe.tokens_per_second == pytest.approx(1 / n_cpu_moe_step, rel=1e-9)
    assert uniform.planned_tokens_per_second == pytest.approx(1 / (2 * attention + 2 * (c + sync) + output), rel=1e-9)
    assert 1.0 < uniform.ratio < 1.1

    skewed_p = np.array([0.35] * 4 + [0.15] * 4)
    skewed = compare_expert_splits(layout, (skewed_p, skewed_p[::-1].copy()), budget, options)
    assert [sorted(np.flatnonzero(m)) for m in skewed.planned.gpu_neurons] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert skewed.n_cpu_moe is not None and skewed.n_cpu_moe.tokens_per_second == pytest.approx(1 / n_cpu_moe_step)
    planned_step = 2 * attention + 2 * (4 * 0.15 * c + sync) + output
    assert skewed.planned_tokens_per_second == pytest.approx(1 / planned_step, rel=1e-9)
    assert skewed.ratio == pytest.approx(n_cpu_moe_step / planned_step) and skewed.ratio > 1.4
