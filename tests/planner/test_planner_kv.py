"""The planner under a KV-cache policy: `full` keeps the bytes of before, `window` budgets the rows it keeps, the
VRAM it frees goes to FFN neurons, the report shows the gain, and a .gpuidx records the policy it was made for."""

from __future__ import annotations

import io
import re
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from rich.table import Table

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import WINDOW_ROW_EXTRA_BYTES, KVPolicy
from qinfer.core.model_spec import ModelSpec
from qinfer.formats.gpuidx import GpuIndex, Provenance, gpuidx_path_for, read_gpuidx, write_gpuidx
from qinfer.planner.activation_stats import power_law_firing
from qinfer.planner.baselines import greedy_placement
from qinfer.planner.budget import GIB, KV_ELEMENT_BYTES, SCRATCH_FIXED, BudgetOptions, account
from qinfer.planner.device_profiles import load_profile
from qinfer.planner.make_plan import (
    PlanOptions,
    compare_with_full_kv,
    dry_run_account,
    full_kv_account,
    load_or_make_gpuidx,
    make_plan,
)
from qinfer.planner.model_layout import layout_for_spec
from qinfer.planner.neuron_groups import group_neurons
from qinfer.planner.plan_report import account_table, summary_table
from qinfer.planner.time_model import build_time_model
from tests.planner.test_planner_plan import _binding_budget
from tests.planner.test_planner_plan import model as model  # the tiny model copied beside power-law activation files
from tests.support.cli_in_process import run_in_process
from tests.support.shapes import shape_spec

TINY_SHAPE = shape_spec("llama", layers=2, hidden=64, ffn=256, heads=4, kv_heads=2, vocab=512)
LLAMA_7B = shape_spec("llama", layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000)
LLAMA_70B = shape_spec("llama", layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=32000)
WINDOW = KVPolicy("window", 16)  # of the tiny model's 256 tokens of context


def _text(table: Table) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(table)
    return out.getvalue()


def _row(text: str, *cells: str) -> bool:
    """Whether the rendered table has a row whose first cells are `cells`."""
    return re.search(r"│\s*" + r"\s*│\s*".join(map(re.escape, cells)) + r"\s*│", text) is not None


@pytest.mark.parametrize("spec", [TINY_SHAPE, LLAMA_7B, LLAMA_70B], ids=["tiny", "7B", "70B"])
@pytest.mark.parametrize(("ctx", "batch"), [(1, 1), (100, 3), (32768, 4)])
def test_full_keeps_its_kv_bytes_and_scratch_covers_the_f32_rows(spec: ModelSpec, ctx: int, batch: int) -> None:
    layout = layout_for_spec(spec, 1024)
    acct = account(layout, BudgetOptions(ctx_size=ctx, batch=batch))
    s = layout.spec
    # K and V x ctx x batch x kv_dim x f16, as before KV policies; scratch: scores over ctx per head, and the float32
    # keys and values over ctx that attention casts and masks.
    assert acct.kv_cache == (2 * ctx * batch * s.kv_dim * 2,) * s.layers
    buffers = 2 * (2 * s.hidden + 2 * s.kv_dim + 2 * s.ffn + s.heads * ctx) * 4
    assert acct.scratch == SCRATCH_FIXED + batch * (buffers + 4 * s.kv_dim * ctx * 4)
    assert account(layout, BudgetOptions(ctx_size=ctx, batch=batch, kv_policy=KVPolicy())) == acct


@pytest.mark.parametrize(
    ("budget", "ctx", "rows"), [(16, 256, 16), (0.25, 4096, 1024), (0.001, 8192, 9), (1024, 512, 512)]
)
def test_window_kv_bytes_are_rows_times_slots_times_row_bytes(budget: float, ctx: int, rows: int) -> None:
    layout = layout_for_spec(LLAMA_70B, 1024)
    policy = KVPolicy("window", budget)
    acct = account(layout, BudgetOptions(ctx_size=ctx, batch=3, kv_policy=policy))
    row_bytes = 8 * (2 * 128 * KV_ELEMENT_BYTES + WINDOW_ROW_EXTRA_BYTES)  # 8 kv heads of 128, position and mass
    assert policy.rows(ctx) == rows
    assert acct.kv_cache == (rows * 3 * row_bytes,) * 80
    full = account(layout, BudgetOptions(ctx_size=ctx, batch=3))
    # The scores and the float32 keys and values cover the kept rows and the new token's, not the whole context.
    assert full.scratch - acct.scratch == 3 * (2 * 64 + 4 * 1024) * (ctx - (rows + 1)) * 4


def test_window_attention_reads_only_the_kept_rows() -> None:
    layout = layout_for_spec(LLAMA_7B, 1024)
    firing = power_law_firing(32, 11008, seed=0)
    gpu, cpu = load_profile("rtx4090", "gpu"), load_profile("generic-desktop", "cpu")
    full = build_time_model(layout, firing, gpu, cpu, BudgetOptions(ctx_size=8192))
    window = build_time_model(
        layout, firing, gpu, cpu, BudgetOptions(ctx_size=8192, kv_policy=KVPolicy("window", 0.25))
    )
    kv_full = 2 * 8192 * 4096 * 2
    kv_window = 2048 * 32 * (2 * 128 * 2 + WINDOW_ROW_EXTRA_BYTES)
    attention = layout.layers[0].attention_bytes
    # Memory-bound on the GPU: the time is the bytes read over the bandwidth.
    assert full.layers[0].attention_gpu == pytest.approx((attention + kv_full) / gpu.bandwidth)
    assert window.layers[0].attention_gpu == pytest.approx((attention + kv_window) / gpu.bandwidth)
    assert window.layers[0].gpu_neuron.tolist() == full.layers[0].gpu_neuron.tolist()


@pytest.mark.parametrize(("spec", "budget_gib", "ctx"), [(LLAMA_7B, 24, 32768), (LLAMA_70B, 131, 32768)])
def test_window_frees_vram_that_greedy_fills_with_neurons(spec: ModelSpec, budget_gib: float, ctx: int) -> None:
    layout = layout_for_spec(spec, 1024)
    firing = power_law_firing(layout.spec.layers, layout.spec.ffn, seed=1)
    groups = group_neurons(firing, 64)
    budget = int(budget_gib * GIB)
    full = account(layout, BudgetOptions(ctx_size=ctx))
    window = account(layout, BudgetOptions(ctx_size=ctx, kv_policy=KVPolicy("window", 1024)))
    assert window.dense < full.dense <= budget
    before, after = (greedy_placement(a, firing, groups, budget).gpu_neuron_count() for a in (full, window))
    assert after > before
    # The freed bytes become neurons, less what newly used layers' predictors and partly filled groups take.
    usable = full.dense - window.dense - sum(full.predictors)
    total = sum(full.ffn_neurons)
    assert after - before >= min(total - before, usable // layout.layers[0].neuron_bytes - 64 * layout.n_layers)


def test_window_plan_places_more_neurons_and_the_report_says_how_many(model: Path) -> None:
    budget = _binding_budget(model)
    plan = make_plan(model, budget, options=PlanOptions(kv_policy=WINDOW))
    comparison = compare_with_full_kv(plan)
    full = comparison.plan
    assert full is not None and full.options.kv_policy == KVPolicy()
    assert full.placement.gpu_neuron_count() == make_plan(model, budget).placement.gpu_neuron_count()
    gain = plan.placement.gpu_neuron_count() - full.placement.gpu_neuron_count()
    # The tiny model frees 2 x 30464 bytes of KV and 130016 of scratch (scores and f32 rows): room for 497 more
    # neurons of 384 bytes, less what the predictors of newly used layers and partly filled groups take.
    assert gain >= 440
    assert plan.vram["kv cache"] == 2 * 16 * 2 * (2 * 16 * 2 + WINDOW_ROW_EXTRA_BYTES)
    assert sum(comparison.account.kv_cache) == 2 * 2 * 256 * 32 * 2
    assert plan.tokens_per_second > full.tokens_per_second
    text = _text(summary_table(plan, comparison))
    counts = f"{full.placement.gpu_neuron_count()} -> {plan.placement.gpu_neuron_count()} ({gain:+d})"
    assert _row(text, "neurons on GPU, full -> window", counts)
    speed = f"{full.tokens_per_second:.2f} -> {plan.tokens_per_second:.2f}"
    assert _row(
        text, "modelled tokens/s, full -> window", f"{speed} ({plan.tokens_per_second / full.tokens_per_second:.2f}x)"
    )
    split = WINDOW.split(256)
    assert split.sinks + split.recent + split.heavy == 16 and split.heavy > 0
    parts = f"{split.sinks} sinks, {split.recent} recent, {split.heavy} heavy"
    assert _row(text, "KV window rows", f"16 of 256 ({parts})")
    assert "full -> window" not in _text(summary_table(full))


def test_report_says_when_full_cannot_hold_the_dense_parts(model: Path) -> None:
    _, window = dry_run_account(model, 1 << 40, PlanOptions(kv_policy=WINDOW))
    budget = window.dense + 10_000  # full needs 68576 bytes more for its KV cache and scores
    plan = make_plan(model, budget, options=PlanOptions(kv_policy=WINDOW))
    comparison = compare_with_full_kv(plan)
    assert comparison.plan is None and comparison.account.dense > budget
    assert "does not fit" in _text(summary_table(plan, comparison))


def test_dry_run_table_shows_the_bytes_the_window_frees(model: Path) -> None:
    options = PlanOptions(ctx_size=1 << 20, kv_policy=WINDOW)  # capped at the model's 256 as a plan is
    layout, acct = dry_run_account(model, 1 << 30, options)
    full = full_kv_account(layout, options)
    assert full == dry_run_account(model, 1 << 30, PlanOptions())[1]
    text = _text(account_table(acct, 1 << 30, dense_on_gpu=True, full_kv=full))
    assert _row(text, "KV cache with full", "0.000061", str(2 * 2 * 256 * 32 * 2))
    assert _row(text, "freed by the window", "0.000178", str(full.dense - acct.dense))
    assert f"room for {(full.dense - acct.dense) // 384} more FFN neurons" in text


def test_cli_plans_a_window_and_reports_the_gain(model: Path) -> None:
    budget = f"{_binding_budget(model) / GIB:.9f}"
    done = run_in_process(
        "plan", "-m", str(model), "--vram-budget", budget, "--kv-policy", "window", "--kv-budget", "16"
    )
    assert done.returncode == 0, done.stderr
    assert "full -> window" in done.stderr and "x)" in done.stderr
    provenance = read_gpuidx(gpuidx_path_for(model)).provenance
    assert provenance is not None and (provenance.kv_policy, provenance.kv_rows) == ("window", 16)
    dry = run_in_process(
        "plan", "-m", str(model), "--vram-budget", "1", "--dry-run", "--kv-policy", "window", "--kv-budget", "6.25%"
    )
    assert dry.returncode == 0, dry.stderr
    assert "freed by the window" in dry.stderr and "KV cache with full" in dry.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-policy", "window"], "--kv-policy window needs --kv-budget"),
        (["--kv-budget", "512"], "only --kv-policy window keeps a budget"),
        (["--kv-policy", "lru", "--kv-budget", "512"], "--kv-policy: use full or window"),
        (["--kv-policy", "window", "--kv-budget", "3"], "--kv-budget keeps 3 of 256 tokens; a window needs at least 4"),
        (["--kv-policy", "window", "--kv-budget", "1%"], "--kv-budget keeps 3 of 256 tokens"),
    ],
)
def test_cli_kv_options_that_cannot_work_are_one_line(model: Path, args: list[str], message: str) -> None:
    done = run_in_process("plan", "-m", str(model), "--vram-budget", "1", *args)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and message in lines[0]
    assert not gpuidx_path_for(model).exists()


MADE = Provenance(
    model_size=10, model_mtime_ns=5, vram_budget=8 << 30, activation_sha256="ab" * 32, group_size=64,
    objective="time", ctx_size=4096, batch=1, gpu="rtx4090", cpu="generic-desktop", dense="gpu",
    attention_on_gpu=(True, True), output_on_gpu=True,
)  # fmt: skip


def _key_count(path: Path) -> int:
    return int(struct.unpack_from("<Q", path.read_bytes(), 16)[0])


def test_gpuidx_records_a_window_and_reads_a_file_without_one_as_full(tmp_path: Path) -> None:
    masks = (np.array([1, 0, 1, 0], dtype=np.int32), np.zeros(4, dtype=np.int32))
    path = tmp_path / "m.gpuidx"
    write_gpuidx(path, GpuIndex(1234, masks, MADE))
    assert _key_count(path) == 3 + 13  # `full` writes no policy keys: its bytes are those of before
    full = read_gpuidx(path).provenance
    assert full is not None and (full.kv_policy, full.kv_rows) == ("full", 0)
    window = replace(MADE, kv_policy="window", kv_rows=1024)
    write_gpuidx(path, GpuIndex(1234, masks, window))
    assert _key_count(path) == 3 + 15
    assert read_gpuidx(path).provenance == window
    # A policy without its rows is a damaged file, not a `full` one.
    path.write_bytes(path.read_bytes().replace(b"qinfer.plan.kv_rows", b"qinfer.plan.kv_rowz"))
    with pytest.raises(UserError, match="damaged qinfer.plan"):
        read_gpuidx(path)
    write_gpuidx(path, GpuIndex(1234, masks, replace(MADE, kv_policy="lru", kv_rows=8)))
    with pytest.raises(UserError, match="damaged qinfer.plan"):
        read_gpuidx(path)


def test_a_plan_is_reused_only_under_the_policy_and_rows_it_was_made_for(model: Path) -> None:
    budget = _binding_budget(model)
    made = load_or_make_gpuidx(model, budget, options=PlanOptions(kv_policy=WINDOW))
    assert not made.reused
    same_rows = KVPolicy("window", 16 / 256)  # a fraction that keeps the same 16 rows
    assert load_or_make_gpuidx(model, budget, options=PlanOptions(kv_policy=same_rows)).reused
    changed = "stale: kv policy was window, is now full; kv window rows was 16, is now 0; rebuild it with"
    with pytest.raises(UserError, match=changed):
        load_or_make_gpuidx(model, budget)
    with pytest.raises(UserError, match="stale: kv window rows was 16, is now 32; rebuild it"):
        load_or_make_gpuidx(model, budget, options=PlanOptions(kv_policy=KVPolicy("window", 32)))
    full = load_or_make_gpuidx(model, budget, reset=True)
    assert not full.reused and full.placement.gpu_neuron_count() < made.placement.gpu_neuron_count()
    with pytest.raises(UserError, match="stale: kv policy was full, is now window; kv window rows was 0, is now"):
        load_or_make_gpuidx(model, budget, options=PlanOptions(kv_policy=WINDOW))
