"""The placement ILP against brute force on small cases, and against the baselines it must not lose to."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pulp
import pytest

from qinfer.core.errors import UserError
from qinfer.planner import placement_ilp
from qinfer.planner.activation_stats import power_law_firing
from qinfer.planner.baselines import greedy_placement, reference_capacity, reference_placement
from qinfer.planner.budget import BudgetOptions, VramAccount, account, vram_used
from qinfer.planner.device_profiles import DeviceProfile, load_profile
from qinfer.planner.model_layout import layout_for_spec
from qinfer.planner.neuron_groups import group_neurons
from qinfer.planner.placement import Placement
from qinfer.planner.placement_ilp import MIP_GAP, Objective, build_problem, solve_placement
from qinfer.planner.time_model import TimeModel, build_time_model
from tests.support.shapes import shape_spec

# Slow, latency-free devices make every choice matter at this size: otherwise the sync latency dwarfs 256 neurons.
GPU = DeviceProfile("g", "gpu", "", 1 << 30, 2e9, 1e12, 1e9, 1e-7)
CPU = DeviceProfile("c", "cpu", "", 1 << 30, 1e8, 1e10, 0.0, 0.0)
LAYOUT = layout_for_spec(
    shape_spec("llama", layers=2, hidden=64, ffn=256, heads=4, kv_heads=2, vocab=512),
    32,
)


def _setup(group_size: int = 64) -> tuple[VramAccount, TimeModel, tuple[np.ndarray, ...]]:
    firing = power_law_firing(2, 256, seed=3)
    options = BudgetOptions(ctx_size=64, batch=1)
    return account(LAYOUT, options), build_time_model(LAYOUT, firing, GPU, CPU, options), firing


def _placements(firing: tuple[np.ndarray, ...], group_size: int, dense_auto: bool, prefixes_only: bool):
    groups = group_neurons(firing, group_size)
    per_layer = []
    for i in range(len(firing)):
        g = groups.count(i)
        if prefixes_only:
            masks = [groups.mask(i, np.arange(g) < k) for k in range(g + 1)]
        else:
            masks = [groups.mask(i, np.array(bits, dtype=bool)) for bits in itertools.product((0, 1), repeat=g)]
        per_layer.append(masks)
    dense_choices = list(itertools.product((True, False), repeat=len(firing) + 1)) if dense_auto else [(True,) * 3]
    for masks in itertools.product(*per_layer):
        for dense in dense_choices:
            yield Placement(tuple(masks), tuple(dense[:-1]), dense[-1])


def _budgets(acct: VramAccount) -> list[int]:
    return [int(acct.dense + f * acct.ffn_total) for f in (0.0, 0.1, 0.3, 0.55, 0.8, 1.0)]


@pytest.mark.parametrize("dense_auto", [False, True], ids=["dense-on-gpu", "dense-decided"])
def test_time_objective_equals_brute_force(dense_auto: bool) -> None:
    acct, times, firing = _setup()
    candidates = list(_placements(firing, 64, dense_auto, prefixes_only=True))
    optima = set()
    for budget in _budgets(acct):
        feasible = [p for p in candidates if sum(vram_used(acct, p).values()) <= budget]
        best = min(times.step_seconds(p) for p in feasible)
        result = solve_placement(
            acct, times, firing, group_neurons(firing, 64), budget, dense_on_gpu=not dense_auto, mip_gap=0.0
        )
        assert result.objective == pytest.approx(best, rel=1e-9)
        assert times.step_seconds(result.placement) == pytest.approx(best, rel=1e-9)
        assert sum(vram_used(acct, result.placement).values()) <= budget
        assert result.lp_bound <= result.objective * (1 + 1e-9)
        optima.add(round(best, 12))
    assert len(optima) >= 4  # the budgets really change the answer


def test_activation_objective_equals_brute_force_over_every_subset() -> None:
    acct, times, firing = _setup()
    candidates = list(_placements(firing, 64, dense_auto=False, prefixes_only=False))
    for budget in _budgets(acct)[1:-1]:
        best = max(
            sum(float(p[m].sum()) for p, m in zip(firing, c.gpu_neurons, strict=True))
            for c in candidates
            if sum(vram_used(acct, c).values()) <= budget
        )
        result = solve_placement(
            acct, times, firing, group_neurons(firing, 64), budget, objective="activation", mip_gap=0.0
        )
        assert result.objective == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("objective", ["time", "activation"])
@pytest.mark.parametrize("dense_auto", [False, True], ids=["dense-on-gpu", "dense-decided"])
def test_highs_finds_the_objective_and_bound_cbc_finds(objective: Objective, dense_auto: bool) -> None:
    acct, times, firing = _setup()
    groups = group_neurons(firing, 64)
    for budget in _budgets(acct):
        cbc, highs = (
            solve_placement(
                acct, times, firing, groups, budget, objective=objective, dense_on_gpu=not dense_auto, solver=solver
            )
            for solver in ("cbc", "highs")
        )
        assert (cbc.solver, highs.solver, highs.status) == ("cbc", "highs", "optimal")
        assert highs.objective == pytest.approx(cbc.objective, rel=MIP_GAP)
        assert highs.lp_bound == pytest.approx(cbc.lp_bound, rel=1e-6)
        assert sum(vram_used(acct, highs.placement).values()) <= budget
        if objective == "time":
            assert times.step_seconds(highs.placement) == pytest.approx(highs.objective, rel=1e-9)


def test_auto_solves_with_highs_where_cbc_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    acct, times, firing = _setup()
    groups = group_neurons(firing, 64)
    budget = _budgets(acct)[2]
    with_cbc = solve_placement(acct, times, firing, groups, budget, dense_on_gpu=False)
    monkeypatch.setattr(pulp.PULP_CBC_CMD, "available", lambda _self: False)
    monkeypatch.setattr(pulp.PULP_CBC_CMD, "actualSolve", lambda *_args, **_kw: pytest.fail("CBC ran"))
    without_cbc = solve_placement(acct, times, firing, groups, budget, dense_on_gpu=False)
    assert (with_cbc.solver, without_cbc.solver) == ("cbc", "highs")
    assert without_cbc.objective == pytest.approx(with_cbc.objective, rel=MIP_GAP)


def test_never_worse_than_greedy_and_never_over_budget() -> None:
    layout = layout_for_spec(
        shape_spec("llama", layers=8, hidden=1024, ffn=4096, heads=8, kv_heads=8, vocab=1000),
        128,
    )
    firing = power_law_firing(8, 4096, seed=1)
    acct = account(layout, BudgetOptions())
    gpu, cpu = load_profile("rtx4090", "gpu"), load_profile("generic-desktop", "cpu")
    times = build_time_model(layout, firing, gpu, cpu, BudgetOptions())
    groups = group_neurons(firing, 64)
    for share in (0.05, 0.2, 0.5):
        budget = int(acct.dense + share * acct.ffn_total)
        greedy = greedy_placement(acct, firing, groups, budget)
        result = solve_placement(acct, times, firing, groups, budget, warm_start=greedy)
        assert sum(vram_used(acct, result.placement).values()) <= budget
        assert times.step_seconds(result.placement) <= times.step_seconds(greedy) * (1 + 1e-12)
        assert result.status == "optimal"


def test_reference_capacity_formula() -> None:
    layout = layout_for_spec(
        shape_spec("llama", layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000),
        1024,
    )
    dense = sum(layer.attention_bytes for layer in layout.layers) + layout.output_bytes
    budget = dense + 10**9
    assert reference_capacity(layout, budget) == (10**9 // int(11008 * 2 * 4.5)) * 4
    firing = power_law_firing(32, 11008, seed=2)
    placement = reference_placement(layout, firing, budget)
    assert placement.gpu_neuron_count() == reference_capacity(layout, budget) // 256 * 256


def test_infeasible_budget_is_a_plan_error() -> None:
    acct, times, firing = _setup()
    with pytest.raises(UserError, match="no placement fits"):
        solve_placement(acct, times, firing, group_neurons(firing, 64), acct.dense - 1)


def test_a_solver_stopped_early_never_returns_worse_than_its_warm_start(monkeypatch: pytest.MonkeyPatch) -> None:
    acct, times, firing = _setup()
    groups = group_neurons(firing, 64)
    budget = int(acct.dense + 0.4 * acct.ffn_total)
    greedy = greedy_placement(acct, firing, groups, budget)
    real_milp = placement_ilp.milp

    def worst_incumbent(cost: np.ndarray, **kwargs: object) -> object:
        found = real_milp(cost, **kwargs)
        # The feasible point that keeps every layer's first option (fewest GPU neurons), as a stopped solver may hold.
        x = np.zeros_like(found.x)
        problem = build_problem(acct, times, firing, groups, budget, objective="time", dense_on_gpu=True)
        bounds = np.cumsum([0] + [len(o.cost) for o in problem.table])
        x[bounds[:-1]] = 1.0
        return SimpleNamespace(x=x, status=1)

    monkeypatch.setattr(placement_ilp, "milp", worst_incumbent)
    result = solve_placement(acct, times, firing, groups, budget, solver="highs", warm_start=greedy)
    assert "kept the warm start" in result.status
    assert times.step_seconds(result.placement) == pytest.approx(times.step_seconds(greedy))
