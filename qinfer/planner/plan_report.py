"""What a plan looks like to a person: rich tables, and a per-layer picture (matplotlib, an optional extra)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from qinfer.core.errors import needs_extra
from qinfer.core.names import Tensor
from qinfer.formats.atomic_file import atomic_output
from qinfer.planner.budget import GIB, MIB, VramAccount, minimum_budget
from qinfer.planner.make_plan import FullKVComparison, Plan

# How each unit the planner places is named in a table: its plural, and what the dense part of a layer holds.
_UNITS = {"neuron": "neurons", "expert": "experts"}
_DENSE_NOTE = {"neuron": "weights and norms", "expert": "weights, norms, router, shared expert"}


def _gib(n: float) -> str:
    return f"{n / GIB:.3f}" if n >= MIB else f"{n / GIB:.6f}"


def account_table(
    acct: VramAccount,
    budget: int,
    *,
    dense_on_gpu: bool,
    title: str = "VRAM account",
    full_kv: VramAccount | None = None,
) -> Table:
    """`full_kv`: for a window KV cache, the same account with a full one, to show what the window frees."""
    table = Table(title=title)
    table.add_column("part")
    table.add_column("GiB", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("note")
    neurons = sum(acct.ffn_neurons)
    units = _UNITS[acct.unit]
    per_neuron = sum(b * n for b, n in zip(acct.neuron_bytes, acct.ffn_neurons, strict=True)) / max(1, neurons)
    rows = [
        ("attention (all layers)", sum(acct.attention), _DENSE_NOTE[acct.unit]),
        ("KV cache", sum(acct.kv_cache), "f16 K and V for ctx x batch" if full_kv is None else "window rows x batch"),
        ("output head", acct.output, f"{Tensor.OUTPUT} and {Tensor.OUTPUT_NORM}"),
        ("embeddings", acct.embeddings, "on GPU" if acct.embeddings else "kept on CPU"),
        ("scratch reserve", acct.scratch, "256 MiB + per-sequence buffers"),
        ("predictors (all layers)", sum(acct.predictors), "on GPU with a layer's first neuron"),
        (f"FFN {units} (all)", acct.ffn_total - sum(acct.predictors), f"{neurons} {units} x {per_neuron:.1f} B"),
    ]
    if full_kv is not None:
        freed = full_kv.dense - acct.dense
        rows += [
            ("KV cache with full", sum(full_kv.kv_cache), "f16 K and V for ctx x batch"),
            ("freed by the window", freed, f"KV and scratch: room for {int(freed // per_neuron)} more FFN {units}"),
        ]
    for name, n, note in rows:
        table.add_row(name, _gib(n), f"{int(round(n))}", note)
    need = minimum_budget(acct, dense_on_gpu)
    table.add_row("minimum budget", _gib(need), str(need), "dense parts on GPU" if dense_on_gpu else "scratch only")
    table.add_row("budget", _gib(budget), str(budget), f"{_gib(max(0, budget - need))} GiB left for the FFN split")
    return table


def summary_table(plan: Plan, full_kv: FullKVComparison | None = None) -> Table:
    """`full_kv`: for a window KV cache, the same budget planned with a full one."""
    table = Table(title=f"plan for {plan.model_path.name}")
    table.add_column("")
    table.add_column("value", justify="right")
    solve = plan.solve
    units = _UNITS[plan.account.unit]
    rows = [
        ("GPU-served activation share", f"{100 * plan.gpu_activation_share:.2f} %"),
        ("modelled decode tokens/s", f"{plan.tokens_per_second:.2f}"),
        (f"{units} on GPU", f"{plan.placement.gpu_neuron_count()} / {sum(plan.account.ffn_neurons)}"),
        ("layers with attention on GPU", f"{sum(plan.placement.attention_on_gpu)} / {len(plan.account.attention)}"),
    ]
    if plan.account.unit == "expert":
        rows += _n_cpu_moe_rows(plan)
    if full_kv is not None:
        rows += _window_rows(plan, full_kv)
    rows += [(f"VRAM: {_vram_label(name, units)}", f"{_gib(n)} GiB") for name, n in plan.vram.items()]
    rows.append(("VRAM used / budget", f"{_gib(plan.vram_total)} / {_gib(plan.vram_budget)} GiB"))
    if solve is not None:
        rows += [
            ("solver", f"{solve.solver} ({solve.status}, {solve.options} options)"),
            ("solve time", f"{solve.seconds:.2f} s"),
            ("gap to LP bound", f"{100 * solve.gap:.4f} %"),
        ]
    else:
        rows.append(("solver", "not run: reused the existing .gpuidx"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def _vram_label(category: str, units: str) -> str:
    return f"ffn {units}" if category == "ffn neurons" else category


def _n_cpu_moe_rows(plan: Plan) -> list[tuple[str, str]]:
    baseline = plan.n_cpu_moe
    if baseline is None:
        return [("llama.cpp --n-cpu-moe", "does not fit: the budget cannot hold the dense parts")]
    ratio = plan.tokens_per_second / baseline.tokens_per_second
    return [
        (f"--n-cpu-moe {baseline.layers} modelled tokens/s", f"{baseline.tokens_per_second:.2f}"),
        ("planned / --n-cpu-moe", f"{ratio:.2f}x"),
    ]


def _window_rows(plan: Plan, full_kv: FullKVComparison) -> list[tuple[str, str]]:
    split = plan.options.kv_policy.split(plan.options.ctx_size)
    kept = f"{split.rows} of {plan.options.ctx_size}"
    kv_full, kv_window = _gib(sum(full_kv.account.kv_cache)), _gib(sum(plan.account.kv_cache))
    rows = [
        ("KV window rows", f"{kept} ({split.sinks} sinks, {split.recent} recent, {split.heavy} heavy)"),
        ("KV cache, full -> window", f"{kv_full} -> {kv_window} GiB"),
    ]
    full = full_kv.plan
    if full is None:
        return [*rows, ("with a full KV cache", "does not fit: the budget cannot hold its dense parts")]
    neurons, full_neurons = plan.placement.gpu_neuron_count(), full.placement.gpu_neuron_count()
    speed = plan.tokens_per_second / full.tokens_per_second
    return [
        *rows,
        (
            f"{_UNITS[plan.account.unit]} on GPU, full -> window",
            f"{full_neurons} -> {neurons} ({neurons - full_neurons:+d})",
        ),
        (
            "modelled tokens/s, full -> window",
            f"{full.tokens_per_second:.2f} -> {plan.tokens_per_second:.2f} ({speed:.2f}x)",
        ),
    ]


def require_plotting() -> None:
    """Refuse a report where matplotlib is missing: a command asks before its solver's seconds, not after them."""
    with needs_extra("plot", "--report"):
        import matplotlib  # noqa: F401


def write_report_png(plan: Plan, path: Path) -> None:
    """Per layer: neurons (or experts) on GPU vs CPU (bars) and the share of firing the GPU serves (line)."""
    require_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    layers = list(range(len(plan.placement.gpu_neurons)))
    gpu = [int(m.sum()) for m in plan.placement.gpu_neurons]
    cpu = [len(m) - g for m, g in zip(plan.placement.gpu_neurons, gpu, strict=True)]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.15 * len(layers) + 4), 4.5))
    units = _UNITS[plan.account.unit]
    ax.bar(layers, gpu, label=f"{units} on GPU", color="tab:green")
    ax.bar(layers, cpu, bottom=gpu, label=f"{units} on CPU", color="tab:gray")
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"FFN {units}")
    share = ax.twinx()
    share.plot(layers, [100 * s for s in plan.layer_activation_share], color="tab:red", marker=".", label="GPU share")
    share.set_ylabel("activation served by GPU (%)")
    share.set_ylim(0, 100)
    ax.set_title(
        f"{plan.model_path.name}\n{100 * plan.gpu_activation_share:.1f}% of firing on GPU, "
        f"{plan.tokens_per_second:.1f} tok/s modelled, {plan.vram_total / GIB:.2f} of {plan.vram_budget / GIB:.2f} GiB",
        fontsize=10,
    )
    handles = ax.get_legend_handles_labels()[0] + share.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="lower left")
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
