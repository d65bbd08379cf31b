"""The placement ILP against a greedy fill and the reference engine's formulation, on the published models' shapes.

    .venv/bin/python bench/plan_bench.py [--shapes 7B,13B,40B,70B] [--gpu rtx4090] [--weight-type F16]

Synthetic power-law activation statistics (qinfer.planner.activation_stats.power_law_firing); for each shape and budget
prints, from one run: solve time and gap to the LP bound of ours, and modelled tokens/s and VRAM used of ours,
greedy (all dense on GPU, then groups by firing per byte into the true budget) and the reference (equal weights,
256-neuron groups, capacity floor(vram / (F * elt * 4.5)) * 4 after the dense weights, KV cache and scratch ignored).
The reference overshoots the budget (OOM), so it is also shown at "ref fit": the largest budget one could pass it
whose placement really fits, found by bisection. "auto" is ours with the dense parts placed by the ILP too
(`--dense-placement auto`), which also plans budgets too small for all of attention.
"""

from __future__ import annotations

import argparse

import numpy as np
from rich.console import Console
from rich.table import Table

from qinfer.planner.activation_stats import power_law_firing
from qinfer.planner.baselines import greedy_placement, reference_placement
from qinfer.planner.budget import GIB, BudgetOptions, VramAccount, account, vram_used
from qinfer.planner.device_profiles import load_profile
from qinfer.planner.model_layout import ModelLayout, layout_for_spec
from qinfer.planner.neuron_groups import group_neurons
from qinfer.planner.placement import Placement
from qinfer.planner.placement_ilp import solve_placement
from qinfer.planner.time_model import build_time_model
from qinfer.prep.hub.model_profiles import load_model_profile

# Each shape is a supported model's profile (qinfer/profiles/models), with the budgets to try.
SHAPES = {
    "7B": ("ReluLLaMA-7B", (4, 6, 8, 11, 16)),
    "13B": ("ReluLLaMA-13B", (8, 11, 16, 24)),
    "40B": ("ReluFalcon-40B", (24, 40, 64)),
    "70B": ("ReluLLaMA-70B", (30, 40, 64, 100)),
}


def shape_inputs(name: str, weight_type: str) -> tuple[ModelLayout, tuple[np.ndarray, ...]]:
    """The layout of shape `name` (a key of SHAPES) in `weight_type`, and its synthetic firing rates."""
    spec = load_model_profile(SHAPES[name][0]).spec
    layout = layout_for_spec(spec, predictor_rank=1024, weight_type=weight_type)
    return layout, power_law_firing(spec.layers, spec.ffn, seed=len(name))


def reference_that_fits(
    layout: ModelLayout, acct: VramAccount, firing: tuple[np.ndarray, ...], budget: int
) -> Placement:
    """The reference placement for the largest nominal budget whose true VRAM use stays within `budget`."""
    low, high = 0, budget
    while high - low > 1 << 20:
        mid = (low + high) // 2
        fits = sum(vram_used(acct, reference_placement(layout, firing, mid)).values()) <= budget
        low, high = (mid, high) if fits else (low, mid)
    return reference_placement(layout, firing, low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="7B,13B,40B,70B")
    parser.add_argument("--gpu", default="rtx4090")
    parser.add_argument("--cpu", default="generic-desktop")
    parser.add_argument("--weight-type", default="F16")
    parser.add_argument("--ctx-size", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    gpu, cpu = load_profile(args.gpu, "gpu"), load_profile(args.cpu, "cpu")
    table = Table(
        title=f"placement on {gpu.name} + {cpu.name}, {args.weight_type}, ctx {args.ctx_size}, batch {args.batch}"
    )
    for column in (
        "model", "budget GiB", "binds", "solve s", "status", "gap %", "tok/s ours", "greedy", "reference", "ref fit",
        "ours/greedy", "ours/ref fit", "VRAM ours", "VRAM greedy", "VRAM ref", "VRAM ref fit", "auto tok/s", "auto s",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for name in args.shapes.split(","):
        layout, firing = shape_inputs(name, args.weight_type)
        options = BudgetOptions(ctx_size=args.ctx_size, batch=args.batch)
        acct = account(layout, options)
        times = build_time_model(layout, firing, gpu, cpu, options)
        groups = group_neurons(firing, 64)
        for budget_gib in SHAPES[name][1]:
            budget = int(budget_gib * GIB)
            auto = solve_placement(acct, times, firing, groups, budget, dense_on_gpu=False, time_limit=args.time_limit)
            auto_cells = (f"{times.tokens_per_second(auto.placement):.2f}", f"{auto.seconds:.2f}")
            assert sum(vram_used(acct, auto.placement).values()) <= budget
            if budget < acct.dense:
                table.add_row(name, f"{budget_gib:g}", *["-"] * 12, f"needs {acct.dense / GIB:.2f}", "-", *auto_cells)
                continue
            greedy = greedy_placement(acct, firing, groups, budget)
            ours = solve_placement(acct, times, firing, groups, budget, warm_start=greedy, time_limit=args.time_limit)
            plans = {
                "o": ours.placement,
                "g": greedy,
                "r": reference_placement(layout, firing, budget),
                "f": reference_that_fits(layout, acct, firing, budget),
            }
            speed = {k: times.tokens_per_second(p) for k, p in plans.items()}
            used = {k: sum(vram_used(acct, p).values()) / GIB for k, p in plans.items()}
            binds = ours.placement.gpu_neuron_count() < sum(acct.ffn_neurons)
            table.add_row(
                name,
                f"{budget_gib:g}",
                "yes" if binds else "no",
                f"{ours.seconds:.2f}",
                ours.status,
                f"{100 * ours.gap:.4f}",
                f"{speed['o']:.2f}",
                f"{speed['g']:.2f}",
                f"{speed['r']:.2f}",
                f"{speed['f']:.2f}",
                f"{speed['o'] / speed['g']:.3f}",
                f"{speed['o'] / speed['f']:.3f}",
                f"{used['o']:.2f}",
                f"{used['g']:.2f}",
                f"{used['r']:.2f}" + (" OOM" if used["r"] > budget_gib else ""),
                f"{used['f']:.2f}",
                *auto_cells,
            )
    Console(width=240).print(table)


if __name__ == "__main__":
    main()
