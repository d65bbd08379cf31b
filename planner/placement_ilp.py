"""The placement ILP (pulp): per layer how many neuron groups (hottest first) and whether attention go on the GPU.

Within a layer the groups are sorted hottest first and a layer takes a prefix of them, so a layer's choice is an
option (k groups on the GPU, attention on the GPU or not) whose exact modelled time and bytes are computed here,
including the max() of the concurrent GPU and CPU halves, the predictor (on the GPU with the layer's first group)
and the synchronisation cost. The program picks one option per layer (a multiple-choice knapsack) under the VRAM
budget. Options that need more bytes and are no faster than another of the same layer can never be part of an
optimum and are dropped before solving, which keeps 70B (80 layers x 449 prefix lengths) small.

Objective `time` minimises the modelled decode step; `activation` is the reference engine's goal (maximise the
firing probability held on the GPU), here under the full VRAM account instead of its neuron count.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pulp

from planner.budget import VramAccount
from planner.neuron_groups import NeuronGroups
from planner.placement import Placement
from planner.time_model import TimeModel
from qinfer_core.errors import UserError

Objective = Literal["time", "activation"]
INTEGER_TOLERANCE = 0.5
# Solvers work to absolute tolerances near 1e-7..1e-9: seconds (~1e-5) and bytes (~1e10) would sit at both ends of
# that, so the program is written in microseconds and MiB.
TIME_SCALE = 1e6
BYTE_SCALE = 1.0 / (1 << 20)
# The solver may stop once within this relative distance of its bound; proving the last 0.1% can cost minutes on 70B.
MIP_GAP = 1e-3


@dataclass(frozen=True)
class SolveResult:
    placement: Placement
    status: str
    solver: str
    objective: float
    lp_bound: float
    gap: float
    seconds: float
    options: int


@dataclass(frozen=True)
class LayerOptions:
    """Candidate choices of one layer: `groups[j]` GPU groups, attention on the GPU if `attention[j]`."""

    groups: np.ndarray
    attention: np.ndarray
    cost: np.ndarray
    mib: np.ndarray


def layer_options(
    acct: VramAccount,
    times: TimeModel,
    firing: tuple[np.ndarray, ...],
    groups: NeuronGroups,
    layer: int,
    *,
    objective: Objective,
    dense_on_gpu: bool,
) -> LayerOptions:
    t = times.layers[layer]
    g = groups.count(layer)
    k = np.arange(g + 1)
    any_gpu = k > 0
    all_gpu = k == g
    gpu = np.concatenate([[0.0], np.cumsum(groups.sums(layer, t.gpu_neuron))]) + t.predictor_gpu * any_gpu
    cpu_groups = groups.sums(layer, t.cpu_neuron)
    cpu = cpu_groups.sum() - np.concatenate([[0.0], np.cumsum(cpu_groups)]) + t.predictor_cpu * ~any_gpu
    sizes = np.diff(groups.starts[layer]) * acct.neuron_bytes[layer]
    ffn_bytes = np.concatenate([[0.0], np.cumsum(sizes)]) + acct.predictors[layer] * any_gpu
    heat = np.concatenate([[0.0], np.cumsum(groups.sums(layer, firing[layer]))])
    choices = [True] if dense_on_gpu else [True, False]
    parts = []
    for attention_gpu in choices:
        if objective == "activation":
            cost = -heat
        else:
            attention = t.attention_gpu if attention_gpu else t.attention_cpu
            spans = ~all_gpu if attention_gpu else any_gpu
            cost = (attention + np.maximum(gpu, cpu) + t.sync * spans) * TIME_SCALE
        dense = acct.attention[layer] + acct.kv_cache[layer] if attention_gpu else 0
        parts.append((k, np.full(g + 1, attention_gpu), cost, (ffn_bytes + dense) * BYTE_SCALE))
    options = LayerOptions(*(np.concatenate([p[i] for p in parts]) for i in range(4)))
    return _pareto(options)


def _pareto(options: LayerOptions) -> LayerOptions:
    """Keep the options that no cheaper-or-equal-bytes option beats on cost."""
    order = np.lexsort((options.cost, options.mib))
    cost = options.cost[order]
    best_before = np.concatenate([[np.inf], np.minimum.accumulate(cost)[:-1]])
    keep = order[cost < best_before]
    return LayerOptions(options.groups[keep], options.attention[keep], options.cost[keep], options.mib[keep])


def _solver(name: str, time_limit: float, mip: bool, warm: bool, gap: float) -> tuple[str, pulp.LpSolver]:
    if name in ("auto", "highs"):
        highs = pulp.HiGHS(msg=False, timeLimit=time_limit, mip=mip, gapRel=gap)
        if highs.available():
            return "highs", highs
        if name == "highs":
            raise UserError("the HiGHS solver is not installed (pip install highspy); use the default CBC")
    # pulp 3 deprecates PULP_CBC_CMD, but it is the only way to the CBC binary bundled with pulp.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return "cbc", pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, mip=mip, warmStart=warm, gapRel=gap)


def solve_placement(
    acct: VramAccount,
    times: TimeModel,
    firing: tuple[np.ndarray, ...],
    groups: NeuronGroups,
    budget: int,
    *,
    objective: Objective = "time",
    dense_on_gpu: bool = True,
    time_limit: float = 10.0,
    solver: str = "auto",
    warm_start: Placement | None = None,
    mip_gap: float = MIP_GAP,
) -> SolveResult:
    started = time.perf_counter()
    n_layers = len(acct.attention)
    table = [
        layer_options(acct, times, firing, groups, i, objective=objective, dense_on_gpu=dense_on_gpu)
        for i in range(n_layers)
    ]
    output_gpu_cost = times.output_gpu * TIME_SCALE if objective == "time" else 0.0
    output_cpu_cost = times.output_cpu * TIME_SCALE if objective == "time" else 0.0
    room = (budget - acct.fixed) * BYTE_SCALE
    if sum(float(o.mib.min()) for o in table) + (acct.output * BYTE_SCALE if dense_on_gpu else 0) > room:
        raise UserError(f"no placement fits a VRAM budget of {budget} bytes; raise --vram-budget")

    prob = pulp.LpProblem("placement", pulp.LpMinimize)
    y = [
        [prob.add_variable(f"y_{i}_{j}", 0, 1, pulp.LpBinary) for j in range(len(o.cost))] for i, o in enumerate(table)
    ]
    for i, row in enumerate(y):
        prob += pulp.LpAffineExpression([(v, 1) for v in row]) == 1, f"layer_{i}"
    used = [(v, float(m)) for row, o in zip(y, table, strict=True) for v, m in zip(row, o.mib, strict=True)]
    terms = [(v, float(c)) for row, o in zip(y, table, strict=True) for v, c in zip(row, o.cost, strict=True)]
    objective_constant = output_gpu_cost
    output: pulp.LpVariable | None = None
    if dense_on_gpu:
        room -= acct.output * BYTE_SCALE
    else:
        output = prob.add_variable("o", 0, 1, pulp.LpBinary)
        used.append((output, acct.output * BYTE_SCALE))
        terms.append((output, output_gpu_cost - output_cpu_cost))
        objective_constant = output_cpu_cost
    prob += pulp.LpAffineExpression(used) <= room, "vram"
    goal = pulp.LpAffineExpression(terms)
    goal.constant = objective_constant
    prob += goal

    solver_name, lp_solver = _solver(solver, time_limit, mip=False, warm=False, gap=mip_gap)
    prob.solve(lp_solver)
    lp_bound = float(pulp.value(prob.objective))

    start_choice = None
    if warm_start is not None:
        start_choice = _choices_for(table, groups, warm_start)
        for i, row in enumerate(y):
            for j, v in enumerate(row):
                v.setInitialValue(int(j == start_choice[i]))
        if output is not None:
            output.setInitialValue(int(warm_start.output_on_gpu))
    remaining = max(1.0, time_limit - (time.perf_counter() - started))
    solver_name, mip_solver = _solver(solver, remaining, mip=True, warm=warm_start is not None, gap=mip_gap)
    prob.solve(mip_solver)
    if prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible) and _integral(y):
        choice = [max(range(len(row)), key=lambda j, row=row: row[j].value() or 0.0) for row in y]
        output_on_gpu = dense_on_gpu or (output is not None and (output.value() or 0.0) > INTEGER_TOLERANCE)
        status = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "time limit"
    elif start_choice is not None and warm_start is not None:
        choice, output_on_gpu, status = start_choice, warm_start.output_on_gpu, "time limit (kept the warm start)"
    else:
        raise UserError(f"the solver found no placement within {time_limit:g} s; raise --time-limit")
    value = sum(float(o.cost[c]) for o, c in zip(table, choice, strict=True))
    value += output_gpu_cost if output_on_gpu else output_cpu_cost
    placement = Placement(
        gpu_neurons=tuple(
            groups.mask(i, np.arange(groups.count(i)) < o.groups[c])
            for i, (o, c) in enumerate(zip(table, choice, strict=True))
        ),
        attention_on_gpu=tuple(bool(o.attention[c]) for o, c in zip(table, choice, strict=True)),
        output_on_gpu=output_on_gpu,
    )
    gap = max(0.0, (value - lp_bound) / abs(lp_bound)) if lp_bound else 0.0
    scale = -1.0 if objective == "activation" else 1.0 / TIME_SCALE
    return SolveResult(
        placement=placement,
        status=status,
        solver=solver_name,
        objective=value * scale,
        lp_bound=lp_bound * scale,
        gap=gap,
        seconds=time.perf_counter() - started,
        options=sum(len(o.cost) for o in table),
    )


def _integral(y: list[list[pulp.LpVariable]]) -> bool:
    return all(sum(1 for v in row if (v.value() or 0.0) > INTEGER_TOLERANCE) == 1 for row in y)


def _choices_for(table: list[LayerOptions], groups: NeuronGroups, start: Placement) -> list[int]:
    """Per layer the kept option that is no larger and no slower than what `start` does there."""
    choice = []
    for i, options in enumerate(table):
        mask = start.gpu_neurons[i]
        chosen = np.array([mask[groups.members(i, g)].all() for g in range(groups.count(i))], dtype=bool)
        prefix = int(np.argmin(chosen)) if not chosen.all() else len(chosen)
        fits = (options.groups <= prefix) & (options.attention <= start.attention_on_gpu[i])
        candidates = np.flatnonzero(fits)
        choice.append(int(candidates[np.argmin(options.cost[candidates])]))
    return choice
