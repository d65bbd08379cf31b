"""CBC (pulp) against HiGHS (scipy) on the placement ILP, on the published models' shapes: the plans each finds,
side by side in one run.

    .venv/bin/python bench/solver_compare.py [--shapes 7B,13B,70B] [--batch 1] [--time-limit 10]

For each shape, budget and dense placement (all dense parts on the GPU, or placed by the ILP too): each solver's
modelled tokens/s, solve time, and whether the two placements are identical. HiGHS / CBC >= 1 means HiGHS's plan
is at least as fast as CBC's under the planner's model.
"""

from __future__ import annotations

import argparse

import numpy as np
from plan_bench import SHAPES, shape_inputs
from rich.console import Console
from rich.table import Table

from qinfer.planner.baselines import greedy_placement
from qinfer.planner.budget import GIB, BudgetOptions, account
from qinfer.planner.device_profiles import load_profile
from qinfer.planner.neuron_groups import group_neurons
from qinfer.planner.placement import Placement
from qinfer.planner.placement_ilp import MIP_GAP, solve_placement
from qinfer.planner.time_model import build_time_model


def same(a: Placement, b: Placement) -> bool:
    return (
        a.attention_on_gpu == b.attention_on_gpu
        and a.output_on_gpu == b.output_on_gpu
        and all(np.array_equal(x, y) for x, y in zip(a.gpu_neurons, b.gpu_neurons, strict=True))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="7B,13B,70B")
    parser.add_argument("--gpu", default="rtx4090")
    parser.add_argument("--cpu", default="generic-desktop")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--highs-gap", type=float, default=MIP_GAP, help="HiGHS's relative MIP gap (CBC: the default)")
    args = parser.parse_args()
    gpu, cpu = load_profile(args.gpu, "gpu"), load_profile(args.cpu, "cpu")
    title = f"CBC (gap {MIP_GAP:g}) against HiGHS (gap {args.highs_gap:g}) on {gpu.name} + {cpu.name}, F16"
    table = Table(title=f"{title}, batch {args.batch}")
    for column in ("model", "budget GiB", "dense", "CBC tok/s", "HiGHS tok/s", "HiGHS / CBC", "CBC s", "HiGHS s",
                   "same plan"):  # fmt: skip
        table.add_column(column, justify="right")
    worst = np.inf
    gaps = {"cbc": MIP_GAP, "highs": args.highs_gap}
    for name in args.shapes.split(","):
        layout, firing = shape_inputs(name, "F16")
        options = BudgetOptions(batch=args.batch)
        acct = account(layout, options)
        times = build_time_model(layout, firing, gpu, cpu, options)
        groups = group_neurons(firing, 64)
        for budget_gib in SHAPES[name][1]:
            budget = int(budget_gib * GIB)
            for dense_on_gpu in (True, False):
                if dense_on_gpu and budget < acct.dense:
                    continue
                start = greedy_placement(acct, firing, groups, budget) if dense_on_gpu else None
                found = {
                    solver: solve_placement(
                        acct, times, firing, groups, budget, dense_on_gpu=dense_on_gpu, warm_start=start,
                        time_limit=args.time_limit, solver=solver, mip_gap=gaps[solver],
                    )
                    for solver in ("cbc", "highs")
                }  # fmt: skip
                speed = {s: times.tokens_per_second(r.placement) for s, r in found.items()}
                ratio = speed["highs"] / speed["cbc"]
                worst = min(worst, ratio)
                table.add_row(
                    name, f"{budget_gib:g}", "gpu" if dense_on_gpu else "auto", f"{speed['cbc']:.4f}",
                    f"{speed['highs']:.4f}", f"{ratio:.6f}", f"{found['cbc'].seconds:.2f}",
                    f"{found['highs'].seconds:.2f}", "yes" if same(*(r.placement for r in found.values())) else "no",
                )  # fmt: skip
    Console(width=200).print(table)
    print(f"worst HiGHS / CBC: {worst:.6f}")


if __name__ == "__main__":
    main()
