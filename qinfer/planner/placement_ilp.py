"""The placement ILP: per layer how many neuron groups (hottest first) and whether attention go on the GPU.

Within a layer the groups are sorted hottest first and a layer takes a prefix of them, so a layer's choice is an
option (k groups on the GPU, attention on the GPU or not) whose exact modelled time and bytes are computed here,
including the max() of the concurrent GPU and CPU halves, the predictor (on the GPU with the layer's first group)
and the synchronisation cost. The program picks one option per layer (a multiple-choice knapsack) under the VRAM
budget. Options that need more bytes and are no faster than another of the same layer can never be part of an
optimum and are dropped before solving, which keeps 70B (80 layers x 449 prefix lengths) small.

Objective `time` minimises the modelled decode step; `activation` is the reference engine's goal (maximise the
firing probability held on the GPU), here under the full VRAM account instead of its neuron count.

CBC (bundled with pulp) solves it by default; HiGHS (bundled with scipy) where "highs" is asked for or CBC is missing.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import pulp
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from qinfer.core.errors import UserError
from qinfer.planner.budget import VramAccount
from qinfer.planner.cbc_run import solve_with_cbc
from qinfer.planner.neuron_groups import NeuronGroups
from qinfer.planner.placement import Placement
from qinfer.planner.time_model import TimeModel

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


@dataclass(frozen=True)
class Problem:
    """The program in solver-neutral form: one option per layer, and a binary for the output matrix on the GPU when
    `decide_output`, all under `room` MiB."""

    table: list[LayerOptions]
    room: float
    decide_output: bool
    output_mib: float
    output_gpu_cost: float
    output_cpu_cost: float

    @property
    def constant(self) -> float:
        """The output matrix's cost where it starts: on the CPU when the program decides it, else on the GPU."""
        return self.output_cpu_cost if self.decide_output else self.output_gpu_cost


@dataclass(frozen=True)
class _Solution:
    solver: str
    lp_bound: float
    choice: list[int] | None  # None when the solver found no integral placement
    output_on_gpu: bool
    status: str


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
    """Solve with CBC (pulp), or with HiGHS (scipy) when `solver` is "highs" or is "auto" and CBC is missing."""
    started = time.perf_counter()
    problem = build_problem(acct, times, firing, groups, budget, objective=objective, dense_on_gpu=dense_on_gpu)
    start_choice = None if warm_start is None else _choices_for(problem.table, groups, warm_start)
    if _backend(solver) == "highs":
        solution = _solve_highs(problem, started, time_limit, mip_gap)
    else:
        solution = _solve_cbc(problem, started, time_limit, mip_gap, warm_start, start_choice)
    if start_choice is not None and warm_start is not None:
        start_cost = _cost(problem, start_choice, warm_start.output_on_gpu)
        # A solver stopped by its time limit may hold an incumbent worse than the start it was given.
        if solution.choice is None or _cost(problem, solution.choice, solution.output_on_gpu) > start_cost:
            kept = f"{solution.status} (kept the warm start)"
            solution = replace(solution, choice=start_choice, output_on_gpu=warm_start.output_on_gpu, status=kept)
    if solution.choice is None:
        raise UserError(f"the solver found no placement within {time_limit:g} s; raise --time-limit")
    return _result(problem, groups, objective, solution, started)


def _cost(problem: Problem, choice: list[int], output_on_gpu: bool) -> float:
    value = sum(float(o.cost[c]) for o, c in zip(problem.table, choice, strict=True))
    return value + (problem.output_gpu_cost if output_on_gpu else problem.output_cpu_cost)


def build_problem(
    acct: VramAccount,
    times: TimeModel,
    firing: tuple[np.ndarray, ...],
    groups: NeuronGroups,
    budget: int,
    *,
    objective: Objective,
    dense_on_gpu: bool,
) -> Problem:
    table = [
        layer_options(acct, times, firing, groups, i, objective=objective, dense_on_gpu=dense_on_gpu)
        for i in range(len(acct.attention))
    ]
    output_gpu_cost = times.output_gpu * TIME_SCALE if objective == "time" else 0.0
    output_cpu_cost = times.output_cpu * TIME_SCALE if objective == "time" else 0.0
    room = (budget - acct.fixed) * BYTE_SCALE
    if sum(float(o.mib.min()) for o in table) + (acct.output * BYTE_SCALE if dense_on_gpu else 0) > room:
        raise UserError(f"no placement fits a VRAM budget of {budget} bytes; raise --vram-budget")
    if dense_on_gpu:
        room -= acct.output * BYTE_SCALE
    return Problem(table, room, not dense_on_gpu, acct.output * BYTE_SCALE, output_gpu_cost, output_cpu_cost)


def _backend(name: str) -> str:
    """The solver to run: HiGHS when asked for, or for "auto" where pulp lacks its CBC binary; otherwise CBC."""
    if name == "highs" or (name == "auto" and not _cbc_solver(1.0, mip=False, warm=False, gap=0.0).available()):
        return "highs"
    return "cbc"


def _cbc_solver(time_limit: float, mip: bool, warm: bool, gap: float) -> pulp.LpSolver_CMD:
    # pulp 3 deprecates PULP_CBC_CMD, but it is the only way to the CBC binary bundled with pulp.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, mip=mip, warmStart=warm, gapRel=gap)


def _solve_cbc(
    problem: Problem,
    started: float,
    time_limit: float,
    mip_gap: float,
    warm_start: Placement | None,
    start_choice: list[int] | None,
) -> _Solution:
    prob, y, output = _pulp_problem(problem)
    solve_with_cbc(prob, _cbc_solver(time_limit, mip=False, warm=False, gap=mip_gap))
    lp_bound = float(pulp.value(prob.objective))
    # After the LP solve, which overwrites the variables' values that CBC reads its start from.
    if warm_start is not None and start_choice is not None:
        for i, row in enumerate(y):
            for j, v in enumerate(row):
                v.setInitialValue(int(j == start_choice[i]))
        if output is not None:
            output.setInitialValue(int(warm_start.output_on_gpu))
    remaining = max(1.0, time_limit - (time.perf_counter() - started))
    solve_with_cbc(prob, _cbc_solver(remaining, mip=True, warm=warm_start is not None, gap=mip_gap))
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible) or not _integral(y):
        return _Solution("cbc", lp_bound, None, False, "no solution")
    choice = [max(range(len(row)), key=lambda j, row=row: row[j].value() or 0.0) for row in y]
    output_on_gpu = not problem.decide_output or (output is not None and (output.value() or 0.0) > INTEGER_TOLERANCE)
    status = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "time limit"
    return _Solution("cbc", lp_bound, choice, output_on_gpu, status)


def _pulp_problem(problem: Problem) -> tuple[pulp.LpProblem, list[list[pulp.LpVariable]], pulp.LpVariable | None]:
    table = problem.table
    prob = pulp.LpProblem("placement", pulp.LpMinimize)
    y = [
        [prob.add_variable(f"y_{i}_{j}", 0, 1, pulp.LpBinary) for j in range(len(o.cost))] for i, o in enumerate(table)
    ]
    for i, row in enumerate(y):
        prob += pulp.LpAffineExpression([(v, 1) for v in row]) == 1, f"layer_{i}"
    used = [(v, float(m)) for row, o in zip(y, table, strict=True) for v, m in zip(row, o.mib, strict=True)]
    terms = [(v, float(c)) for row, o in zip(y, table, strict=True) for v, c in zip(row, o.cost, strict=True)]
    output: pulp.LpVariable | None = None
    if problem.decide_output:
        output = prob.add_variable("o", 0, 1, pulp.LpBinary)
        used.append((output, problem.output_mib))
        terms.append((output, problem.output_gpu_cost - problem.output_cpu_cost))
    prob += pulp.LpAffineExpression(used) <= problem.room, "vram"
    goal = pulp.LpAffineExpression(terms)
    goal.constant = problem.constant
    prob += goal
    return prob, y, output


def _solve_highs(problem: Problem, started: float, time_limit: float, mip_gap: float) -> _Solution:
    form = _matrix_form(problem)
    relaxed = linprog(
        form.cost,
        A_ub=form.vram,
        b_ub=[problem.room],
        A_eq=form.one_each,
        b_eq=np.ones(len(problem.table)),
        bounds=(0, 1),
        method="highs",
        options={"time_limit": time_limit},
    )
    if relaxed.status != 0:
        return _Solution("highs", math.nan, None, False, "no LP bound")
    lp_bound = float(relaxed.fun) + problem.constant
    found = milp(
        form.cost,
        integrality=np.ones(len(form.cost)),
        bounds=Bounds(0, 1),
        constraints=[LinearConstraint(form.one_each, 1, 1), LinearConstraint(form.vram, -np.inf, problem.room)],
        options={"time_limit": max(1.0, time_limit - (time.perf_counter() - started)), "mip_rel_gap": mip_gap},
    )
    if found.x is None or (choice := _integral_choice(problem, found.x)) is None:
        return _Solution("highs", lp_bound, None, False, "no solution")
    output_on_gpu = not problem.decide_output or bool(found.x[-1] > INTEGER_TOLERANCE)
    return _Solution("highs", lp_bound, choice, output_on_gpu, _MILP_STATUS.get(found.status, "no solution"))


# scipy.optimize.milp's status codes for a returned point: proven optimal (within the gap), or stopped by a limit.
_MILP_STATUS = {0: "optimal", 1: "time limit"}


@dataclass(frozen=True)
class _MatrixForm:
    """The program over the options of every layer in order, then the output binary if decided."""

    cost: np.ndarray
    one_each: sparse.csr_array  # one row per layer: its options sum to one
    vram: sparse.csr_array  # one row: the MiB of every option


def _matrix_form(problem: Problem) -> _MatrixForm:
    table = problem.table
    cost = np.concatenate([o.cost for o in table])
    mib = np.concatenate([o.mib for o in table])
    layer_of = np.repeat(np.arange(len(table)), [len(o.cost) for o in table])
    if problem.decide_output:
        cost = np.append(cost, problem.output_gpu_cost - problem.output_cpu_cost)
        mib = np.append(mib, problem.output_mib)
    options = np.arange(len(layer_of))
    one_each = sparse.csr_array((np.ones(len(options)), (layer_of, options)), shape=(len(table), len(cost)))
    return _MatrixForm(cost, one_each, sparse.csr_array(mib[None, :]))


def _integral_choice(problem: Problem, x: np.ndarray) -> list[int] | None:
    """Per layer the chosen option, or None unless every layer has exactly one."""
    bounds = np.cumsum([0] + [len(o.cost) for o in problem.table])
    rows = [x[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if any(int((row > INTEGER_TOLERANCE).sum()) != 1 for row in rows):
        return None
    return [int(np.argmax(row)) for row in rows]


def _result(
    problem: Problem,
    groups: NeuronGroups,
    objective: Objective,
    solution: _Solution,
    started: float,
) -> SolveResult:
    table, output_on_gpu, choice = problem.table, solution.output_on_gpu, solution.choice
    assert choice is not None
    value = _cost(problem, choice, output_on_gpu)
    placement = Placement(
        gpu_neurons=tuple(
            groups.mask(i, np.arange(groups.count(i)) < o.groups[c])
            for i, (o, c) in enumerate(zip(table, choice, strict=True))
        ),
        attention_on_gpu=tuple(bool(o.attention[c]) for o, c in zip(table, choice, strict=True)),
        output_on_gpu=output_on_gpu,
    )
    lp_bound = solution.lp_bound
    # Without a bound (its LP ran out of time) the gap is unknown, not zero.
    gap = math.nan if math.isnan(lp_bound) else max(0.0, (value - lp_bound) / abs(lp_bound)) if lp_bound else 0.0
    scale = -1.0 if objective == "activation" else 1.0 / TIME_SCALE
    return SolveResult(
        placement=placement,
        status=solution.status,
        solver=solution.solver,
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
