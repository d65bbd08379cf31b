"""`qinfer serve`: an OpenAI-compatible HTTP server for a GGUF model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qinfer.app import app, err


@app.command("serve")
def serve_cmd(
    model: Annotated[Path, typer.Option("-m", "--model", help="GGUF or PowerInfer GGUF model file.")],
    vram_budget: Annotated[
        float | None, typer.Option(help="GiB of GPU memory the model may use; plans (or reuses) the .gpuidx.")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on; 0.0.0.0 exposes the server to the network.")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    slots: Annotated[int, typer.Option(help="Requests decoded together; more wait for a free slot.")] = 4,
    ctx_size: Annotated[int, typer.Option("-c", "--ctx-size", help="Context length per slot (0 = the model's).")] = 512,
    threads: Annotated[int, typer.Option("-t", "--threads", help="CPU threads (default: all cores).")] = 0,
    schedule: Annotated[str, typer.Option(help="GPU/CPU schedule of the runtime (see `qinfer run --help`).")] = "auto",
) -> None:
    """Serve /v1/completions, /v1/chat/completions (streaming with server-sent events), /v1/models and /health.

    Chat messages are rendered as a plain "System: / User: / Assistant:" transcript, since the supported base models
    have no chat template; generation stops before the next "User:" line.
    """
    import torch
    import uvicorn

    from qinfer_runtime.engine import Engine
    from qinfer_runtime.engine_worker import EngineWorker
    from qinfer_runtime.server import create_app

    if threads > 0:
        torch.set_num_threads(threads)
    engine = Engine.open(model, slots=slots, ctx_size=ctx_size, vram_budget_gib=vram_budget, schedule=schedule)
    server = create_app(EngineWorker(engine), model_id=model.name)
    err.print(f"serving {model.name} on http://{host}:{port}/v1 ({slots} slots, context {engine.ctx_size})")
    uvicorn.run(server, host=host, port=port, log_level="warning")
