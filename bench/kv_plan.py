"""What a window KV cache buys the planner: VRAM it frees, FFN neurons that move onto the GPU, modelled tokens/s.

    .venv/bin/python bench/kv_plan.py [--cases 7B:rtx4090,7B:rtx2080ti,13B:rtx4090,70B:h200] [--ctx 2048,8192,32768]
        [--batch 1,4] [--kv-budgets 1024,25%] [--time-limit 3]

Each case is a shape of bench/plan_bench.py (its synthetic power-law firing) on a GPU profile whose whole memory is
the VRAM budget. For each context and batch the same budget is planned (greedy warm start, then the ILP, as
`qinfer plan` does) with a full KV cache and with each window budget. "-": the budget cannot even hold the
policy's dense parts (attention, KV cache, output head, scratch), so the model does not plan there at all.
The ILP minimises modelled time and stops within its MIP gap (or time limit), so where the FFN fits, or nearly,
either way, a window's plan may hold fewer neurons than full's at about the same modelled speed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from plan_bench import shape_inputs
from rich.console import Console
from rich.table import Table

from qinfer.core.kv_policy import KVPolicy, parse_kv_budget
from qinfer.planner.baselines import greedy_placement
from qinfer.planner.budget import GIB, BudgetOptions, account
from qinfer.planner.device_profiles import DeviceProfile, load_profile
from qinfer.planner.model_layout import ModelLayout
from qinfer.planner.neuron_groups import NeuronGroups, group_neurons
from qinfer.planner.placement_ilp import solve_placement
from qinfer.planner.time_model import build_time_model


def plan(
    layout: ModelLayout,
    firing: tuple[np.ndarray, ...],
    groups: NeuronGroups,
    gpu: DeviceProfile,
    cpu: DeviceProfile,
    options: BudgetOptions,
    time_limit: float,
) -> tuple[int, float] | None:
    """GPU neurons and modelled tokens/s of the plan for the GPU's whole memory; None when that cannot hold the
    dense parts."""
    acct = account(layout, options)
    budget = gpu.memory_bytes
    if budget < acct.dense:
        return None
    times = build_time_model(layout, firing, gpu, cpu, options)
    start = greedy_placement(acct, firing, groups, budget)
    result = solve_placement(acct, times, firing, groups, budget, warm_start=start, time_limit=time_limit)
    return result.placement.gpu_neuron_count(), times.tokens_per_second(result.placement)


def kv_gib(layout: ModelLayout, options: BudgetOptions) -> str:
    return f"{sum(account(layout, options).kv_cache) / GIB:.2f}"


def compare(full: tuple[int, float] | None, window: tuple[int, float] | None, total: int) -> list[str]:
    """Neurons full and window, the gain, tokens/s full and window, their ratio; "-" where a plan does not fit."""
    cells = ["-"] * 6
    if full is not None:
        cells[0], cells[3] = str(full[0]), f"{full[1]:.2f}"
    if window is not None:
        cells[1], cells[4] = str(window[0]), f"{window[1]:.2f}"
    if full is not None and window is not None:
        gain = window[0] - full[0]
        cells[2], cells[5] = f"{gain:+d} ({100 * gain / total:+.1f}%)", f"{window[1] / full[1]:.2f}x"
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="7B:rtx4090,7B:rtx2080ti,13B:rtx4090,70B:h200")
    parser.add_argument("--ctx", default="2048,8192,32768")
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--kv-budgets", default="1024,25%")
    parser.add_argument("--cpu", default="generic-desktop")
    parser.add_argument("--weight-type", default="F16")
    parser.add_argument("--time-limit", type=float, default=3.0)
    args = parser.parse_args()
    cpu = load_profile(args.cpu, "cpu")
    windows = [KVPolicy("window", parse_kv_budget(text)) for text in args.kv_budgets.split(",")]
    table = Table(
        title=f"full vs window KV cache, {args.weight_type}, budget = the GPU's memory, CPU {cpu.name}, "
        f"ILP time limit {args.time_limit:g} s"
    )
    for column in (
        "model", "GPU", "budget GiB", "ctx", "batch", "window rows", "KV GiB full", "KV GiB window", "neurons full",
        "neurons window", "gain (of FFN)", "tok/s full", "tok/s window", "window/full",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    began = time.perf_counter()
    for case in args.cases.split(","):
        name, gpu_name = case.split(":")
        gpu = load_profile(gpu_name, "gpu")
        layout, firing = shape_inputs(name, args.weight_type)
        groups = group_neurons(firing, 64)
        total = sum(layer.ffn_neurons for layer in layout.layers)
        for ctx in map(int, args.ctx.split(",")):
            for batch in map(int, args.batch.split(",")):
                full_options = BudgetOptions(ctx_size=ctx, batch=batch)
                full = plan(layout, firing, groups, gpu, cpu, full_options, args.time_limit)
                for policy in windows:
                    options = BudgetOptions(ctx_size=ctx, batch=batch, kv_policy=policy)
                    window = plan(layout, firing, groups, gpu, cpu, options, args.time_limit)
                    kv = [kv_gib(layout, full_options), kv_gib(layout, options)]
                    head = [name, gpu.name, f"{gpu.memory_bytes / GIB:g}", str(ctx), str(batch)]
                    rows = f"{policy.rows(ctx)} ({policy.budget:g})"
                    table.add_row(*head, rows, *kv, *compare(full, window, total))
    Console(width=240).print(table)
    print(f"{time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
