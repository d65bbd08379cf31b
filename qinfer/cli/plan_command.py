"""`qinfer plan`: GPU placement of FFN neurons (or of a mixture's experts), written as `<model>.generated.gpuidx`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, cast

import typer

from qinfer.cli.app import app, err
from qinfer.cli.options import VRAM_BUDGET, KvBudgetOption, KvPolicyOption, Real, ResetGpuIndex, kv_policy
from qinfer.planner.device_profiles import DEFAULT_CPU

TIME_LIMIT = Real(0.0, low_open=True)


@app.command("plan")
def plan_cmd(
    model: Annotated[
        Path,
        typer.Option(
            "--model", "-m", help="The PowerInfer GGUF (*.powerinfer.gguf), or a dense GGUF with experts, to plan."
        ),
    ],
    vram_budget: Annotated[
        float,
        typer.Option(
            parser=VRAM_BUDGET, help=f"GiB of GPU memory the whole model may use, everything included ({VRAM_BUDGET})."
        ),
    ],
    activation: Annotated[
        Path | None, typer.Option(help="Directory of activation_{i}.pt files; default: <model dir>/activation.")
    ] = None,
    ctx_size: Annotated[int, typer.Option(min=1, help="Context length the KV cache and scratch are sized for.")] = 512,
    kv_policy_kind: KvPolicyOption = "full",
    kv_budget: KvBudgetOption = None,
    batch: Annotated[
        int, typer.Option(min=1, help="Number of sequences decoded together (KV cache, scratch, timing).")
    ] = 1,
    group_size: Annotated[
        int,
        typer.Option(
            min=1, help="Neurons per placement group (hottest first within a layer); experts are placed one by one."
        ),
    ] = 64,
    device: Annotated[str, typer.Option(help="GPU profile (`qinfer profiles` lists them).")] = "rtx4090",
    cpu: Annotated[str, typer.Option(help="CPU profile name (`qinfer profiles` lists them).")] = DEFAULT_CPU,
    objective: Annotated[
        str, typer.Option(help="time: minimise modelled decode time; activation: the reference engine's goal.")
    ] = "time",
    dense_placement: Annotated[
        str, typer.Option(help="gpu: keep attention and output head on the GPU; auto: let the planner decide.")
    ] = "gpu",
    gpu_embeddings: Annotated[
        bool, typer.Option("--gpu-embeddings", help="Also keep token_embd on the GPU (the engine keeps it on the CPU).")
    ] = False,
    time_limit: Annotated[
        float, typer.Option(parser=TIME_LIMIT, help=f"Seconds the solver may spend on the plan ({TIME_LIMIT}).")
    ] = 10.0,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only print the VRAM account; solve and write nothing.")
    ] = False,
    reset_gpu_index: ResetGpuIndex = False,
    report: Annotated[Path | None, typer.Option(help="Write a per-layer PNG of the plan (needs matplotlib).")] = None,
) -> None:
    """Decide which FFN neurons (or experts) live on the GPU and write <model>.generated.gpuidx beside the model
    (an earlier plan that still holds is reused, one that cannot be, made with other settings say, is made again);
    for a mixture, also model llama.cpp's --n-cpu-moe split of the same budget."""
    # Imported here, as in the other commands, so that `qinfer --help` and unrelated commands start fast.
    from qinfer.cli.stop_signals import stop_signals_raise
    from qinfer.formats.atomic_file import check_output_file
    from qinfer.planner.budget import GIB
    from qinfer.planner.make_plan import (
        PlanOptions,
        compare_with_full_kv,
        dry_run_account,
        full_kv_account,
        load_or_make_gpuidx,
    )
    from qinfer.planner.placement_ilp import Objective
    from qinfer.planner.plan_report import account_table, require_plotting, summary_table, write_report_png

    if objective not in ("time", "activation"):
        raise typer.BadParameter("use time or activation", param_hint="--objective")
    if dense_placement not in ("gpu", "auto"):
        raise typer.BadParameter("use gpu or auto", param_hint="--dense-placement")
    options = PlanOptions(
        ctx_size=ctx_size,
        batch=batch,
        group_size=group_size,
        gpu=device,
        cpu=cpu,
        objective=cast(Objective, objective),
        time_limit=time_limit,
        dense=cast(Literal["gpu", "auto"], dense_placement),
        gpu_embeddings=gpu_embeddings,
        kv_policy=kv_policy(kv_policy_kind, kv_budget),
    )
    windowed = options.kv_policy.windowed
    budget = int(vram_budget * GIB)
    if dry_run:
        layout, acct = dry_run_account(model, budget, options)
        full = full_kv_account(layout, options) if windowed else None
        err.print(account_table(acct, budget, dense_on_gpu=options.dense == "gpu", full_kv=full), soft_wrap=False)
        return
    if report is not None:
        if report.suffix.lower() != ".png":
            raise typer.BadParameter("the report is a PNG file; name it *.png", param_hint="--report")
        # Before the solver's seconds, not after them.
        check_output_file(report)
        require_plotting()
    # The solver runs as a subprocess with files of its own: a stop signal must end it and remove them.
    with stop_signals_raise():
        plan = load_or_make_gpuidx(model, budget, activation, options, reset=reset_gpu_index, replace_stale=True)
        for note in plan.notes:
            err.print(f"note: {note}")
        err.print(summary_table(plan, compare_with_full_kv(plan, activation) if windowed else None), soft_wrap=False)
        verb = "reused" if plan.reused else "wrote"
        err.print(f"{verb} {plan.gpuidx_path}")
        if report is not None:
            write_report_png(plan, report)
            err.print(f"wrote {report}")
