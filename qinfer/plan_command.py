"""`qinfer plan`: GPU placement of FFN neurons."""

from __future__ import annotations

from typing import Annotated

import typer

from qinfer.app import app
from qinfer_prep.errors import PrepError


@app.command("plan")
def plan_cmd(
    vram_budget: Annotated[float, typer.Option(help="GiB of GPU memory the model may use.")] = 8.0,
) -> None:
    """Decide which FFN neurons live on the GPU and write the .gpuidx file (not available yet)."""
    raise PrepError("the planner is not part of this version yet; `qinfer run` runs the whole model on the CPU")
