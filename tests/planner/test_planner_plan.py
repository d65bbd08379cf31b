"""`qinfer plan` and the Python API on the tiny converted model: activation files, reuse, staleness, CLI."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from qinfer.cli.main import app
from qinfer.core.errors import UserError
from qinfer.formats.activation_files import activation_paths, write_activations
from qinfer.formats.gpuidx import GpuIndex, gpuidx_path_for, read_gpuidx, write_gpuidx
from qinfer.planner.activation_stats import load_activation
from qinfer.planner.budget import GIB
from qinfer.planner.make_plan import PlanOptions, dry_run_account, load_or_make_gpuidx, make_plan
from tests.support.fake_activation import write_power_law_activation


@pytest.fixture
def model(tmp_path: Path, gguf_files: dict[str, Path]) -> Path:
    path = tmp_path / "tiny.powerinfer.gguf"
    shutil.copy(gguf_files["pi-f16"], path)
    write_power_law_activation(tmp_path / "activation")
    return path


def _binding_budget(model: Path) -> int:
    """Room for the dense parts and about a third of the FFN neurons."""
    _, acct = dry_run_account(model, 1 << 40, PlanOptions())
    return int(acct.dense + acct.ffn_total / 3)


def test_layer_files_sort_by_integer_index(tmp_path: Path) -> None:
    for i in (10, 2, 0, 1, 11, 3, 4, 5, 6, 7, 8, 9):
        (tmp_path / f"activation_{i}.pt").touch()
    assert [p.name for p in activation_paths(tmp_path, 12)] == [f"activation_{i}.pt" for i in range(12)]
    with pytest.raises(UserError, match=r"missing layers \[12\]"):
        activation_paths(tmp_path, 13)
    with pytest.raises(UserError, match=r"extra layers \[11\]"):
        activation_paths(tmp_path, 11)


def test_wrong_length_activation_is_refused(tmp_path: Path) -> None:
    write_power_law_activation(tmp_path, f=100)
    with pytest.raises(UserError, match="expected a 1-D tensor of 256 counts"):
        load_activation(tmp_path, (256, 256))


def test_counts_of_a_model_of_another_architecture_are_refused(model: Path, tmp_path: Path) -> None:
    counts = torch.stack([torch.arange(256, dtype=torch.int64)] * 2)
    write_activations(tmp_path / "falcon", counts, 1000, {"arch": "falcon"})
    with pytest.raises(UserError, match="profiled on a falcon model, but this is a llama model"):
        load_or_make_gpuidx(model, _binding_budget(model), tmp_path / "falcon")
    assert not gpuidx_path_for(model).exists()
    write_activations(tmp_path / "llama", counts, 1000, {"arch": "llama"})
    assert not load_or_make_gpuidx(model, _binding_budget(model), tmp_path / "llama").reused


def test_plan_is_written_reused_and_read_back(model: Path) -> None:
    budget = _binding_budget(model)
    plan = load_or_make_gpuidx(model, budget)
    assert not plan.reused and plan.gpuidx_path == gpuidx_path_for(model)
    assert 0 < plan.placement.gpu_neuron_count() < 512
    assert plan.vram_total <= budget
    index = read_gpuidx(plan.gpuidx_path)
    assert [m.astype(bool).tolist() for m in index.gpu_idx] == [m.tolist() for m in plan.placement.gpu_neurons]
    assert index.vram_capacity == round(plan.vram["ffn neurons"] + plan.vram["predictors"])
    assert index.provenance is not None and index.provenance.vram_budget == budget
    again = load_or_make_gpuidx(model, budget)
    assert again.reused and again.solve is None
    assert [m.tolist() for m in again.placement.gpu_neurons] == [m.tolist() for m in plan.placement.gpu_neurons]
    assert again.tokens_per_second == pytest.approx(plan.tokens_per_second)


def test_stale_plan_is_refused_until_reset(model: Path) -> None:
    budget = _binding_budget(model)
    load_or_make_gpuidx(model, budget)
    write_power_law_activation(model.parent / "activation", seed=1)
    with pytest.raises(UserError, match="stale: activation files changed.*--reset-gpu-index"):
        load_or_make_gpuidx(model, budget)
    # Budgets a byte apart, which print as the same GiB, are told in bytes.
    changed = f"stale: vram budget was {budget} bytes, is now {budget + 1} bytes; activation files changed since"
    with pytest.raises(UserError, match=changed):
        load_or_make_gpuidx(model, budget + 1)
    assert not load_or_make_gpuidx(model, budget, reset=True).reused
    os.utime(model, ns=(1, 1))
    with pytest.raises(UserError, match="stale: model mtime changed"):
        load_or_make_gpuidx(model, budget)


def test_context_is_capped_at_the_models_as_the_runtime_does(model: Path) -> None:
    budget = _binding_budget(model)
    model_context = 256  # the tiny synth model's context_length
    plan = load_or_make_gpuidx(model, budget, options=PlanOptions(ctx_size=4 * model_context))
    index = read_gpuidx(gpuidx_path_for(model))
    assert plan.options.ctx_size == model_context
    assert index.provenance is not None and index.provenance.ctx_size == model_context
    assert load_or_make_gpuidx(model, budget, options=PlanOptions(ctx_size=model_context)).reused
    _, capped = dry_run_account(model, budget, PlanOptions(ctx_size=4 * model_context))
    _, exact = dry_run_account(model, budget, PlanOptions(ctx_size=model_context))
    assert capped == exact
    with pytest.raises(UserError, match="stale: ctx size was 256, is now 128; rebuild it with --reset-gpu-index"):
        load_or_make_gpuidx(model, budget, options=PlanOptions(ctx_size=model_context // 2))


def test_reference_engine_index_is_used_only_when_it_fits(model: Path) -> None:
    budget = _binding_budget(model)
    masks = (np.arange(256) < 64, np.zeros(256, dtype=bool))
    write_gpuidx(gpuidx_path_for(model), GpuIndex(vram_capacity=1000, gpu_idx=tuple(m.astype(np.int32) for m in masks)))
    plan = load_or_make_gpuidx(model, budget)
    assert plan.reused and plan.notes and plan.placement.gpu_neuron_count() == 64
    write_gpuidx(gpuidx_path_for(model), GpuIndex(vram_capacity=10**12, gpu_idx=plan.placement.gpu_neurons))
    with pytest.raises(UserError, match="made by another tool"):
        load_or_make_gpuidx(model, budget)
    write_gpuidx(gpuidx_path_for(model), GpuIndex(vram_capacity=0, gpu_idx=(np.zeros(128, dtype=np.int32),) * 2))
    with pytest.raises(UserError, match="FFN sizes"):
        load_or_make_gpuidx(model, budget)


def test_activation_objective_holds_at_least_as_much_firing(model: Path) -> None:
    budget = _binding_budget(model)
    time_plan = make_plan(model, budget)
    activation_plan = make_plan(model, budget, options=PlanOptions(objective="activation"))
    assert activation_plan.gpu_activation_share >= time_plan.gpu_activation_share - 1e-12
    assert time_plan.tokens_per_second >= activation_plan.tokens_per_second * (1 - 1e-9)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "200"})
    if isinstance(result.exception, UserError):
        return 2, str(result.exception)
    return result.exit_code, result.output


def test_cli_dry_run_prints_the_account_and_writes_nothing(model: Path) -> None:
    code, out = _cli("-m", str(model), "--vram-budget", "8", "--dry-run")
    assert code == 0, out
    assert "KV cache" in out and "minimum budget" in out and "scratch reserve" in out
    assert not gpuidx_path_for(model).exists()


def test_cli_too_small_budget_is_one_clear_line(model: Path) -> None:
    code, message = _cli("-m", str(model), "--vram-budget", "0.1", "--dry-run")
    assert code == 2
    assert "a VRAM budget of 0.1 GiB cannot hold the dense parts" in message and "\n" not in message
    least = float(message.split("at least ")[1].split(" GiB")[0])
    need = int(message.split("GiB (")[1].split(" bytes")[0])
    assert least > 0.25 and need <= least * GIB < need + GIB * 1e-4  # a budget that holds it, rounded up


def test_cli_without_matplotlib_refuses_a_report_before_it_plans(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # each import of it fails, as if it were not installed
    code, message = _cli("-m", str(model), "--vram-budget", "8", "--report", str(tmp_path / "plan.png"))
    assert code == 2 and "pip install 'qinfer[plot]'" in message
    assert not gpuidx_path_for(model).exists()


def test_cli_plans_and_reports(model: Path, tmp_path: Path) -> None:
    budget_gib = str(_binding_budget(model) / GIB)
    report = tmp_path / "plan.png"
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib (the plot extra) is not installed")
    code, out = _cli("-m", str(model), "--vram-budget", budget_gib, "--report", str(report))
    assert code == 0, out
    assert report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert gpuidx_path_for(model).exists()
    code, out = _cli("-m", str(model), "--vram-budget", budget_gib)
    assert code == 0, out
    assert "GPU-served activation share" in out and "reused" in out
    code, message = _cli("-m", str(model), "--vram-budget", budget_gib, "--device", "a100")
    assert code == 2 and "known gpu profiles" in message


def test_cli_plans_again_where_its_earlier_plan_had_other_settings(model: Path) -> None:
    """`plan` is asked for a plan: with a new budget it makes one, saying what changed, where run and serve would
    refuse the old one as stale."""
    budget = _binding_budget(model)
    assert _cli("-m", str(model), "--vram-budget", str(budget / GIB))[0] == 0
    code, out = _cli("-m", str(model), "--vram-budget", str((budget + 4096) / GIB))
    assert code == 0, out
    assert f"note: the plan in {gpuidx_path_for(model)} is stale: vram budget was {budget} bytes, is now" in out
    assert "; planned again" in out
    index = read_gpuidx(gpuidx_path_for(model))
    assert index.provenance is not None and index.provenance.vram_budget == budget + 4096
    with pytest.raises(UserError, match="stale: vram budget was"):
        load_or_make_gpuidx(model, budget)
