"""The typer app, its command groups and the console and progress bars the commands share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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
# Messages print as they are: not wrapped at the console's width (80 columns where stderr is a pipe or a log, which
# split notes mid-phrase), and not read as markup (a path such as models[old]/ lost its "[old]"). Tables ask for
# wrapping where they print.
err = Console(stderr=True, soft_wrap=True, markup=False)


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    )


@contextmanager
def progress_when_started() -> Iterator[Progress]:
    """A progress bar the body starts (`bar.start()`) once its inputs are checked, so that a refused input prints
    only its error line; stopped on the way out only where it started, since rich prints an empty line for a bar
    that stops without having started."""
    bar = progress_bar()
    try:
        yield bar
    finally:
        if bar.live.is_started:
            bar.stop()
