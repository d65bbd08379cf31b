"""`qinfer serve`: an OpenAI-compatible HTTP server for a GGUF model."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Annotated

import typer

from qinfer.cli.app import app, err
from qinfer.cli.options import (
    CTX_HELP,
    VRAM_BUDGET,
    CacheTypeK,
    CacheTypeV,
    KvBudgetOption,
    KvPolicyOption,
    Real,
    ResetGpuIndex,
    Threads,
    kv_policy,
    kv_types,
    use_threads,
)
from qinfer.core.errors import needs_extra
from qinfer.core.step_budget import DEFAULT_PREFILL_CHUNK

API_KEY_VARIABLE = "QINFER_API_KEY"


@app.command("serve")
def serve_cmd(
    model: Annotated[Path, typer.Option("-m", "--model", help="GGUF or PowerInfer GGUF model file.")],
    vram_budget: Annotated[
        float | None,
        typer.Option(
            parser=VRAM_BUDGET,
            help=f"GiB of GPU memory the model may use; plans (or reuses) the .gpuidx ({VRAM_BUDGET}).",
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on; 0.0.0.0 exposes the server to the network.")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8080,
    slots: Annotated[int, typer.Option(min=1, help="Requests decoded together; more wait for a free slot.")] = 4,
    prefill_chunk: Annotated[
        int,
        typer.Option(
            min=1,
            help="Prompt tokens one step computes beside the running requests' next tokens: a longer prompt goes in "
            "chunks, and running streams wait one chunk at a time rather than for its whole prompt.",
        ),
    ] = DEFAULT_PREFILL_CHUNK,
    ctx_size: Annotated[int | None, typer.Option("-c", "--ctx-size", min=0, help=f"Per slot: {CTX_HELP}")] = None,
    kv_policy_kind: KvPolicyOption = "full",
    kv_budget: KvBudgetOption = None,
    cache_type_k: CacheTypeK = "f16",
    cache_type_v: CacheTypeV = "f16",
    threads: Threads = 0,
    schedule: Annotated[str, typer.Option(help="GPU/CPU schedule of the runtime (see `qinfer run --help`).")] = "auto",
    api_key: Annotated[
        str | None,
        typer.Option(envvar=API_KEY_VARIABLE, help="Require 'Authorization: Bearer KEY' on /v1/*; /health stays open."),
    ] = None,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="Largest request body; a larger one gets a 413.")] = (
        8 * 1024 * 1024
    ),
    read_timeout: Annotated[
        float,
        typer.Option(
            parser=Real(0.1, 3600.0),
            help="Seconds a client may take to send a request's head, or pause while sending its body.",
        ),
    ] = 10.0,
    idle_timeout: Annotated[
        int, typer.Option(min=1, help="Seconds a kept-alive connection may wait for its next request.")
    ] = 5,
    max_connections: Annotated[int, typer.Option(min=1, help="Open connections served at once; more get a 503.")] = 256,
    chat_template: Annotated[
        Path | None,
        typer.Option(help="A Jinja chat template file to use instead of the model file's own."),
    ] = None,
    no_webui: Annotated[
        bool, typer.Option("--no-webui", help="Serve the API alone, without the chat page at /.")
    ] = False,
    allowed_hosts: Annotated[
        str,
        typer.Option(
            help="Comma-separated names the Host header may give besides IP addresses, localhost and --host "
            "(the names clients reach this server by); '*' allows any, which lets a web page whose name points at "
            "this machine (DNS rebinding) use the server through its visitors' browsers."
        ),
    ] = "",
    reset_gpu_index: ResetGpuIndex = False,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            parser=Real(0.5, 600.0),
            help="Seconds open responses get, after SIGINT or SIGTERM, to send their last event (every queued and "
            "running request ends at once with a 503 'shutting down'); then the server exits.",
        ),
    ] = 5.0,
    no_prompt_cache: Annotated[
        bool,
        typer.Option(
            "--no-prompt-cache",
            help="Compute every prompt whole. By default a slot's KV rows serve a prompt that begins with its tokens, "
            "and clients that share a server can tell from timings.cache_n (or from how soon a prompt is done) how "
            "much of their prompt another sent.",
        ),
    ] = False,
) -> None:
    """Serve /v1/completions, /v1/chat/completions (streaming with server-sent events), /v1/models and /health,
    llama.cpp's /metrics, /props, /slots, /tokenize and /detokenize, and a chat page at /.

    Chat messages are rendered with the model's chat template (the file's tokenizer.chat_template, or
    --chat-template) in a sandbox; a model without one gets a plain "System: / User: / Assistant:" transcript, and
    generation stops before the next "User:" line.
    """
    from qinfer.cli.stop_signals import stop_signals_raise
    from qinfer.runtime.engine.engine import Engine
    from qinfer.runtime.engine.worker import EngineWorker

    with needs_extra("serve", "qinfer serve"):
        from qinfer.runtime.engine.chat_template import load_chat_template, read_chat_template
        from qinfer.runtime.server.app import ServerOptions, create_app
        from qinfer.runtime.server.thread import listening_sockets, url_of, uvicorn_server

    if api_key is None:
        # click reads a variable set to "" as unset; an empty key must be refused, not mean "no key".
        api_key = os.environ.get(API_KEY_VARIABLE)
    # Settings a user can get wrong are refused before the model loads.
    options = ServerOptions(
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        read_timeout_s=read_timeout,
        idle_timeout_s=idle_timeout,
        max_connections=max_connections,
        allowed_hosts=(host, *(name.strip() for name in allowed_hosts.split(",") if name.strip())),
        shutdown_timeout_s=shutdown_timeout,
    )
    use_threads(threads)
    policy = kv_policy(kv_policy_kind, kv_budget)
    types = kv_types(cache_type_k, cache_type_v)
    template_source = None if chat_template is None else read_chat_template(chat_template)
    # Listening before the model loads: an address in use is refused at once; closed however the command ends.
    with listening_sockets(host, port) as sockets:
        # A budget may start the planner's solver: a stop signal must end it and its files too.
        with stop_signals_raise():
            engine = Engine.open(
                model,
                slots=slots,
                ctx_size=ctx_size,
                vram_budget_gib=vram_budget,
                schedule=schedule,
                kv_policy=policy,
                kv_types=types,
                reuse_prompts=not no_prompt_cache,
                prefill_chunk=prefill_chunk,
                reset_gpu_index=reset_gpu_index,
            )
        for note in engine.runtime.notes if engine.runtime is not None else []:
            err.print(f"note: {note}")
        tokenizer = engine.tokenizer
        template = load_chat_template(tokenizer.chat_template, tokenizer.special_tokens, template_source)
        worker = EngineWorker(engine)
        app = create_app(worker, model.name, options, template, webui=not no_webui)
        server = uvicorn_server(app, options, host, port, on_exit=worker.close)
        guarded = ", API key required" if api_key else ""
        chat = "its chat template" if template is not None else "a plain transcript (no chat template)"
        err.print(
            f"serving {model.name} on {url_of(host, sockets[0])}/v1 ({slots} slots, context {engine.ctx_size}"
            f"{guarded}); chat turns through {chat}"
        )
        # What the imports, the model and its tokenizer made lives as long as the server. Frozen, it is left out of the
        # collector's full passes, each of which walked all of it (254,000 objects: 77-132 ms with every thread
        # stopped, the engine's too). What is garbage already is collected first: frozen, it would stay.
        gc.collect()
        gc.freeze()
        server.run(sockets=sockets)
