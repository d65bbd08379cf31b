"""The planner's Python API: account, solve, write or reuse `<model>.generated.gpuidx`. Plain dataclasses in and out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import KVPolicy
from qinfer.core.names import PLAN_KEYS
from qinfer.formats.atomic_file import check_not_special
from qinfer.formats.gpuidx import GpuIndex, Provenance, gpuidx_path_for, gpuidx_write_path, read_gpuidx, write_gpuidx
from qinfer.planner.activation_stats import ActivationStats, load_activation
from qinfer.planner.baselines import NCpuMoe, greedy_placement, smallest_n_cpu_moe
from qinfer.planner.budget import GIB, BudgetOptions, VramAccount, account, minimum_budget, require_budget, vram_used
from qinfer.planner.device_profiles import DEFAULT_CPU, load_profile
from qinfer.planner.model_layout import ModelLayout, read_model_layout
from qinfer.planner.neuron_groups import group_neurons
from qinfer.planner.placement import Placement
from qinfer.planner.placement_ilp import Objective, SolveResult, solve_placement
from qinfer.planner.time_model import TimeModel, build_time_model


@dataclass(frozen=True)
class PlanOptions:
    ctx_size: int = 512
    batch: int = 1
    group_size: int = 64
    gpu: str = "rtx4090"
    cpu: str = DEFAULT_CPU
    objective: Objective = "time"
    time_limit: float = 10.0
    dense: Literal["gpu", "auto"] = "gpu"
    gpu_embeddings: bool = False
    solver: str = "auto"
    kv_policy: KVPolicy = KVPolicy()

    def budget_options(self) -> BudgetOptions:
        return BudgetOptions(
            ctx_size=self.ctx_size, batch=self.batch, gpu_embeddings=self.gpu_embeddings, kv_policy=self.kv_policy
        )

    @property
    def window_rows(self) -> int:
        """What a plan records of its KV policy beside the policy's name: the rows a window keeps, 0 under `full`
        (whose rows are the ctx size, recorded already)."""
        return self.kv_policy.rows(self.ctx_size) if self.kv_policy.windowed else 0


@dataclass(frozen=True)
class Plan:
    model_path: Path
    vram_budget: int
    options: PlanOptions
    layout: ModelLayout
    account: VramAccount
    placement: Placement
    vram: dict[str, float]
    tokens_per_second: float
    gpu_activation_share: float
    layer_activation_share: tuple[float, ...]
    solve: SolveResult | None
    n_cpu_moe: NCpuMoe | None = None  # for a mixture: llama.cpp's `--n-cpu-moe` split of the same budget
    gpuidx_path: Path | None = None
    reused: bool = False
    notes: tuple[str, ...] = field(default=())

    @property
    def vram_total(self) -> float:
        return float(sum(self.vram.values()))

    def gpu_index(self, activation_sha256: str) -> GpuIndex:
        p = self.placement
        return GpuIndex(
            vram_capacity=int(round(self.vram["ffn neurons"] + self.vram["predictors"])),
            gpu_idx=tuple(m.astype(np.int32) for m in p.gpu_neurons),
            provenance=provenance(self.model_path, self.vram_budget, activation_sha256, self.options, p),
        )


def provenance(
    model_path: Path, budget: int, activation_sha256: str, options: PlanOptions, placed: Placement
) -> Provenance:
    """What a plan of these inputs records: the model file, budget, activation and settings it was made from, and
    where it put attention and the output."""
    stat = model_path.stat()
    return Provenance(
        model_size=stat.st_size,
        model_mtime_ns=stat.st_mtime_ns,
        vram_budget=budget,
        activation_sha256=activation_sha256,
        group_size=options.group_size,
        objective=options.objective,
        ctx_size=options.ctx_size,
        batch=options.batch,
        gpu=options.gpu,
        cpu=options.cpu,
        dense=options.dense,
        attention_on_gpu=placed.attention_on_gpu,
        output_on_gpu=placed.output_on_gpu,
        kv_policy=options.kv_policy.kind,
        kv_rows=options.window_rows,
    )


def _fit_model(options: PlanOptions, layout: ModelLayout) -> PlanOptions:
    """`options` as they apply to this model: the context capped at the model's own, as the runtime caps it, so that
    a plan made with the default --ctx-size is the plan a run of the same model asks for; and a mixture's experts
    placed one by one whatever --group-size says (an expert is already the size of many neuron groups), recorded
    so, so that another --group-size does not make its plan stale. A KV policy the runtime would refuse for this
    model is refused here too."""
    options.kv_policy.require_fits(layout.spec)
    if 0 < layout.spec.context_length < options.ctx_size:
        options = replace(options, ctx_size=layout.spec.context_length)
    if layout.unit == "expert":
        options = replace(options, group_size=1)
    return options


def _account(
    model_path: Path, vram_budget_bytes: int, options: PlanOptions
) -> tuple[PlanOptions, ModelLayout, VramAccount]:
    layout = read_model_layout(model_path)
    options = _fit_model(options, layout)
    acct = account(layout, options.budget_options())
    require_budget(acct, vram_budget_bytes, options.dense == "gpu")
    return options, layout, acct


def dry_run_account(model_path: Path, vram_budget_bytes: int, options: PlanOptions) -> tuple[ModelLayout, VramAccount]:
    """The VRAM account alone (no activation files needed); raises if the budget cannot hold the dense parts."""
    _, layout, acct = _account(model_path, vram_budget_bytes, options)
    return layout, acct


def _inputs(
    model_path: Path, vram_budget_bytes: int, activation_dir: Path | None, options: PlanOptions
) -> tuple[PlanOptions, ModelLayout, VramAccount, ActivationStats, TimeModel]:
    options, layout, acct = _account(model_path, vram_budget_bytes, options)
    directory = activation_dir or model_path.parent / "activation"
    stats = load_activation(directory, acct.ffn_neurons, layout.unit, layout.spec.arch)
    return options, layout, acct, stats, _time_model(layout, stats.firing, options)


def _time_model(layout: ModelLayout, firing: tuple[np.ndarray, ...], options: PlanOptions) -> TimeModel:
    gpu = load_profile(options.gpu, "gpu")
    cpu = load_profile(options.cpu, "cpu")
    return build_time_model(layout, firing, gpu, cpu, options.budget_options())


def _plan(
    model_path: Path,
    budget: int,
    options: PlanOptions,
    layout: ModelLayout,
    acct: VramAccount,
    stats: ActivationStats,
    times: TimeModel,
    placement: Placement,
    solve: SolveResult | None,
) -> Plan:
    held = [float(p[m].sum()) for p, m in zip(stats.firing, placement.gpu_neurons, strict=True)]
    totals = [float(p.sum()) for p in stats.firing]
    return Plan(
        model_path=model_path,
        vram_budget=budget,
        options=options,
        layout=layout,
        account=acct,
        placement=placement,
        vram=vram_used(acct, placement),
        tokens_per_second=times.tokens_per_second(placement),
        gpu_activation_share=sum(held) / sum(totals) if sum(totals) else 0.0,
        layer_activation_share=tuple(h / t if t else 0.0 for h, t in zip(held, totals, strict=True)),
        solve=solve,
        n_cpu_moe=smallest_n_cpu_moe(acct, times, budget) if layout.unit == "expert" else None,
    )


def make_plan(
    model_path: Path, vram_budget_bytes: int, activation_dir: Path | None = None, options: PlanOptions | None = None
) -> Plan:
    """Solve the placement for `model_path` under `vram_budget_bytes`; writes nothing."""
    return _make(model_path, vram_budget_bytes, activation_dir, options or PlanOptions())[0]


def _make(
    model_path: Path, budget: int, activation_dir: Path | None, options: PlanOptions
) -> tuple[Plan, ActivationStats]:
    options, layout, acct, stats, times = _inputs(model_path, budget, activation_dir, options)
    result = _solve(acct, times, stats.firing, budget, options)
    plan = _plan(model_path, budget, options, layout, acct, stats, times, result.placement, result)
    return plan, stats


def _solve(
    acct: VramAccount, times: TimeModel, firing: tuple[np.ndarray, ...], budget: int, options: PlanOptions
) -> SolveResult:
    groups = group_neurons(firing, options.group_size)
    start = greedy_placement(acct, firing, groups, budget) if options.dense == "gpu" else None
    return solve_placement(
        acct,
        times,
        firing,
        groups,
        budget,
        objective=options.objective,
        dense_on_gpu=options.dense == "gpu",
        time_limit=options.time_limit,
        solver=options.solver,
        warm_start=start,
    )


@dataclass(frozen=True)
class ExpertSplits:
    """A mixture under one budget: the planner's split of its experts and llama.cpp's `--n-cpu-moe` split (None
    where that cannot fit), each with its modelled decode tokens/s by the same time model."""

    planned: Placement
    planned_tokens_per_second: float
    n_cpu_moe: NCpuMoe | None

    @property
    def ratio(self) -> float:
        """Planned over `--n-cpu-moe` tokens/s; NaN where `--n-cpu-moe` cannot fit."""
        return math.nan if self.n_cpu_moe is None else self.planned_tokens_per_second / self.n_cpu_moe.tokens_per_second


def compare_expert_splits(
    layout: ModelLayout, frequencies: tuple[np.ndarray, ...], vram_budget_bytes: int, options: PlanOptions | None = None
) -> ExpertSplits:
    """Plan a mixture without a file (a layout from `layout_for_spec`, say): `frequencies[i][j]` is the chance a
    token chooses expert j of layer i (its count over the tokens profiled). Raises if the budget cannot hold the
    dense parts (with --dense-placement gpu)."""
    if layout.unit != "expert":
        raise ValueError("compare_expert_splits needs a layout with experts")
    options = _fit_model(options or PlanOptions(), layout)
    acct = account(layout, options.budget_options())
    require_budget(acct, vram_budget_bytes, options.dense == "gpu")
    times = _time_model(layout, frequencies, options)
    result = _solve(acct, times, frequencies, vram_budget_bytes, options)
    return ExpertSplits(
        planned=result.placement,
        planned_tokens_per_second=times.tokens_per_second(result.placement),
        n_cpu_moe=smallest_n_cpu_moe(acct, times, vram_budget_bytes),
    )


@dataclass(frozen=True)
class FullKVComparison:
    """What a window buys: the same context, batch and budget with a `full` KV cache."""

    account: VramAccount
    plan: Plan | None  # None when the budget cannot hold `full`'s dense parts


def full_kv_account(layout: ModelLayout, options: PlanOptions) -> VramAccount:
    """The account `options` would have with a `full` KV cache."""
    return account(layout, replace(_fit_model(options, layout), kv_policy=KVPolicy()).budget_options())


def compare_with_full_kv(plan: Plan, activation_dir: Path | None = None) -> FullKVComparison:
    """Plan `plan`'s budget again, by the same solver and settings, with a `full` KV cache."""
    options = replace(plan.options, kv_policy=KVPolicy())
    full = full_kv_account(plan.layout, options)
    if plan.vram_budget < minimum_budget(full, options.dense == "gpu"):
        return FullKVComparison(full, None)
    return FullKVComparison(full, _make(plan.model_path, plan.vram_budget, activation_dir, options)[0])


def load_or_make_gpuidx(
    model_path: Path,
    vram_budget_bytes: int,
    activation_dir: Path | None = None,
    options: PlanOptions | None = None,
    *,
    reset: bool = False,
    replace_stale: bool = False,
) -> Plan:
    """Reuse `<model>.generated.gpuidx` when it still matches the model, activation and settings, else refuse (or
    with `replace_stale`, plan again, saying why); make and write it when absent or when `reset`."""
    options = options or PlanOptions()
    path = gpuidx_path_for(model_path)
    check_not_special(path, "regular file")  # before reading it too: opening a pipe would wait for a writer

    def make(notes: tuple[str, ...] = ()) -> Plan:
        plan, stats = _make(model_path, vram_budget_bytes, activation_dir, options)
        target = gpuidx_write_path(model_path)
        try:
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the user's cache, for a read-only model
        except OSError as exc:
            fix = "set XDG_CACHE_HOME to a directory of yours"
            raise UserError(f"cannot write {target} ({exc.strerror}); {fix}") from None
        write_gpuidx(target, plan.gpu_index(stats.digest))
        return replace(plan, gpuidx_path=target, notes=notes)

    def unusable(problem: str, fix: str = "rerun with --reset-gpu-index") -> Plan:
        if replace_stale:
            return make((f"the plan in {path} {problem}; planned again",))
        raise UserError(f"{path} {problem}; {fix}")

    if reset or not path.exists():
        return make()
    options, layout, acct, stats, times = _inputs(model_path, vram_budget_bytes, activation_dir, options)
    index = read_gpuidx(path)
    shapes = tuple(len(m) for m in index.gpu_idx)
    if shapes != acct.ffn_neurons:
        return unusable(
            f"was made for a model with FFN sizes {_short(shapes)}, this one has {_short(acct.ffn_neurons)}"
        )
    masks = tuple(m.astype(bool) for m in index.gpu_idx)
    notes: tuple[str, ...] = ()
    if index.provenance is None:
        placement = Placement(masks, (True,) * len(masks), True)
        room = vram_budget_bytes - acct.dense
        if index.vram_capacity > room:
            return unusable(
                f"(made by another tool) needs {index.vram_capacity} bytes for the FFN split but this budget "
                f"leaves {room}"
            )
        notes = ("unknown provenance (no qinfer.plan.* keys): reused because it fits the budget and the shapes",)
    else:
        placement = Placement(masks, index.provenance.attention_on_gpu, index.provenance.output_on_gpu)
        changed = _changes(
            index.provenance, provenance(model_path, vram_budget_bytes, stats.digest, options, placement)
        )
        if changed:
            return unusable(f"is stale: {'; '.join(changed)}", "rebuild it with --reset-gpu-index")
    plan = _plan(model_path, vram_budget_bytes, options, layout, acct, stats, times, placement, None)
    if index.provenance is not None and index.vram_capacity != plan.gpu_index(stats.digest).vram_capacity:
        return unusable("records an FFN split size its neurons do not have (damaged)")
    if plan.vram_total > vram_budget_bytes:
        return unusable(f"would use {plan.vram_total:.0f} bytes, over the budget")
    return replace(plan, gpuidx_path=path, reused=True, notes=notes)


def _short(values: tuple[int, ...]) -> str:
    return str(list(values)) if len(set(values)) > 1 else f"{len(values)} x {values[0] if values else 0}"


# Provenance whose values mean nothing to a reader: only that they changed is said. The rest is said with its values,
# so that a plan made by `make all` (batch 1) and reused by `serve` (a batch of its slots) says what differs, and how.
_OPAQUE = ("model_mtime_ns", "activation_sha256")


def _changes(made: Provenance, now: Provenance) -> list[str]:
    """How each setting a plan was made with differs from now, in words."""
    inputs = [(name, label) for name, (_, label) in PLAN_KEYS.items() if label is not None]
    changed = []
    for name, label in inputs:
        then, current = getattr(made, name), getattr(now, name)
        if then == current:
            continue
        if name in _OPAQUE:
            changed.append(f"{label} changed since it was made")
            continue
        if name == "vram_budget" and f"{then / GIB:.4g}" != f"{current / GIB:.4g}":
            then, current = f"{then / GIB:.4g} GiB", f"{current / GIB:.4g} GiB"
        elif name in ("vram_budget", "model_size"):
            then, current = f"{then} bytes", f"{current} bytes"
        changed.append(f"{label} was {then}, is now {current}")
    return changed
