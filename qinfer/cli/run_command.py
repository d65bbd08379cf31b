"""`qinfer run`: generate text from a GGUF model, sparse and split between GPU and CPU when it can be."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from qinfer.cli.app import app, err
from qinfer.cli.options import (
    CTX_HELP,
    SEED_MAX,
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

TEMPERATURE = Real(0.0)
TOP_P = Real(0.0, 1.0, low_open=True)


@app.command("run")
def run_cmd(
    model: Annotated[Path, typer.Option("-m", "--model", help="GGUF or PowerInfer GGUF model file.")],
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="Text to continue.")] = "Once upon a time",
    n_predict: Annotated[
        int,
        typer.Option("-n", "--n-predict", min=-1, help="Tokens to generate; -1: until end of text or a full context."),
    ] = 128,
    threads: Threads = 0,
    ctx_size: Annotated[int | None, typer.Option("-c", "--ctx-size", min=0, help=CTX_HELP)] = None,
    kv_policy_kind: KvPolicyOption = "full",
    kv_budget: KvBudgetOption = None,
    cache_type_k: CacheTypeK = "f16",
    cache_type_v: CacheTypeV = "f16",
    seed: Annotated[int, typer.Option(min=0, max=SEED_MAX, help="Sampling seed.")] = 0,
    temp: Annotated[
        float, typer.Option(parser=TEMPERATURE, help=f"Sampling temperature; 0 = greedy ({TEMPERATURE}).")
    ] = 0.8,
    top_k: Annotated[int, typer.Option(min=0, help="Sample among the k most likely tokens (0 = all).")] = 40,
    top_p: Annotated[
        float,
        typer.Option(
            parser=TOP_P, help=f"Sample among the most likely tokens holding this probability mass ({TOP_P})."
        ),
    ] = 0.95,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Keep generating after the end-of-text token.")
    ] = False,
    vram_budget: Annotated[
        float | None,
        typer.Option(
            parser=VRAM_BUDGET,
            help=f"GiB of GPU memory the model may use; plans (or reuses) the .generated.gpuidx file "
            f"beside it ({VRAM_BUDGET}).",
        ),
    ] = None,
    reset_gpu_index: ResetGpuIndex = False,
    disable_gpu_index: Annotated[
        bool, typer.Option("--disable-gpu-index", help="Ignore any .gpuidx: no FFN neurons on the GPU.")
    ] = False,
    schedule: Annotated[
        str,
        typer.Option(
            help="static: keep the plan's split; dynamic: rebalance per step and cache hot neurons on the "
            "GPU; auto: dynamic when a GPU is present."
        ),
    ] = "auto",
    ffn: Annotated[
        str,
        typer.Option(
            help="auto (sparse when the file has predictors or calibrated gate thresholds), sparse, or dense FFN "
            "in decode."
        ),
    ] = "auto",
    parallel: Annotated[
        int, typer.Option(min=1, help="Decode this many sequences of the prompt together (seed + i).")
    ] = 1,
) -> None:
    """Generate text from a prompt, streaming tokens, then print prompt and decode speed."""
    from qinfer.cli.stop_signals import stop_signals_raise
    from qinfer.runtime.engine.engine import Engine
    from qinfer.runtime.engine.generate import generate, generate_many
    from qinfer.runtime.engine.sampling import SamplingParams
    from qinfer.runtime.engine.tokenizer import require_utf8

    use_threads(threads)
    require_utf8(prompt)  # before the model loads, and before the prompt is echoed
    policy = kv_policy(kv_policy_kind, kv_budget)
    types = kv_types(cache_type_k, cache_type_v)
    # A budget may start the planner's solver: a stop signal must end it and its files too.
    with stop_signals_raise():
        engine = Engine.open(
            model,
            slots=parallel,
            ctx_size=ctx_size,
            kv_policy=policy,
            kv_types=types,
            vram_budget_gib=vram_budget,
            schedule=schedule,
            ffn=ffn,
            reset_gpu_index=reset_gpu_index,
            disable_gpu_index=disable_gpu_index,
        )
    if engine.runtime is not None:
        for note in engine.runtime.notes:
            err.print(f"note: {note}")
    if n_predict == 0:
        # llama.cpp's -n 0: the model loads and nothing is generated.
        sys.stdout.write(prompt + "\n")
        return
    # Before the prompt is echoed: an error must not be glued to its text.
    engine.require_room(engine.tokenizer.encode(prompt))
    # The engine ends a sequence whose context is full, so "until the end" needs no count of its own.
    max_tokens = engine.ctx_size if n_predict < 0 else n_predict
    sampling = SamplingParams(temp, top_k, top_p)
    out = sys.stdout
    if parallel == 1:
        out.write(prompt)
        out.flush()

        def show(piece: str) -> None:
            out.write(piece)
            out.flush()

        results = [generate(engine, prompt, max_tokens, sampling, seed, ignore_eos, show)]
        out.write("\n")
    else:
        results = generate_many(engine, [prompt] * parallel, max_tokens, sampling, seed, ignore_eos)
        for i, result in enumerate(results):
            out.write(f"[{i}] {prompt}{result.text}\n")
    # The text before the speeds, where both go to one pipe or file (a log), as they do on a terminal.
    out.flush()
    first = results[0]
    tokens = sum(len(r.tokens) for r in results)
    steps = sum(len(r.tokens) if r.stopped_at_eos else max(len(r.tokens) - 1, 0) for r in results)
    # Sequences decode together, from the first one's first token to the last one's end: prompts computed in
    # chunks start their sequences' decoding at different steps.
    decode_seconds = max(r.decode_started + r.decode_seconds for r in results) - min(r.decode_started for r in results)
    decode_tps = steps / decode_seconds if decode_seconds > 0 else 0.0
    err.print(
        f"prompt: {first.prompt_tokens} tokens, {first.prompt_tps:.1f} tokens/s | "
        f"decode: {tokens} tokens, {decode_tps:.1f} tokens/s"
    )
    if n_predict > 0 and any(len(r.tokens) < n_predict and not r.stopped_at_eos for r in results):
        err.print(f"note: stopped before -n {n_predict}: the context of {engine.ctx_size} tokens is full (-c)")
