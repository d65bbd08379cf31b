"""The typer app, its command groups and the console and progress bars the commands share."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

app = typer.Typer(
    help="Q-Infer: run ReLU-sparse LLMs with hot neurons on the GPU and cold ones on the CPU.",
    no_args_is_help=True,
    add_completion=False,
)
prep = typer.Typer(
    help="Prepare models offline: build, convert, quantize, profile, train predictors.", no_args_is_help=True
)
app.add_typer(prep, name="prep")
err = Console(stderr=True)


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    )
