"""`qinfer perplexity`: llama.cpp-style perplexity of a GGUF model on a text file, dense or sparse."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qinfer.cli.app import app, err, progress_when_started
from qinfer.cli.options import (
    CacheTypeK,
    CacheTypeV,
    KvBudgetOption,
    KvPolicyOption,
    Threads,
    kv_policy,
    kv_types,
    use_threads,
)


@app.command("perplexity")
def perplexity_cmd(
    model: Annotated[Path, typer.Option("-m", "--model", help="GGUF or PowerInfer GGUF model file.")],
    file: Annotated[Path, typer.Option("-f", "--file", help="Plain text file to score.")],
    ctx_size: Annotated[
        int | None,
        typer.Option(
            "-c", "--ctx-size", min=4, help="Window length, the second half scored: 512, or the model's if shorter."
        ),
    ] = None,
    ffn: Annotated[
        str, typer.Option(help="dense (each window as one prompt), sparse (token by token, predictor-selected).")
    ] = "dense",
    kv_policy_kind: KvPolicyOption = "full",
    kv_budget: KvBudgetOption = None,
    cache_type_k: CacheTypeK = "f16",
    cache_type_v: CacheTypeV = "f16",
    threads: Threads = 0,
) -> None:
    """Perplexity over non-overlapping windows of the text, as llama.cpp's `perplexity` reports it."""
    from qinfer.core.errors import UserError
    from qinfer.runtime.engine.perplexity import perplexity
    from qinfer.runtime.engine.tokenizer import GGUFTokenizer
    from qinfer.runtime.model.loader import RuntimeOptions, fit_context, load_forward
    from qinfer.runtime.model.model_file import open_model

    if ffn not in ("dense", "sparse"):
        raise typer.BadParameter("dense or sparse", param_hint="--ffn")
    use_threads(threads)
    policy = kv_policy(kv_policy_kind, kv_budget)
    types = kv_types(cache_type_k, cache_type_v)
    if file.is_dir():
        raise UserError(f"{file} is a directory; name a text file")
    if not file.exists():
        raise UserError(f"text file not found: {file}")
    if not file.is_file():
        raise UserError(f"{file} is not a regular file (a device or a pipe); name a text file")
    opened = open_model(model)
    ctx_size, clamped = fit_context(opened, ctx_size)
    if clamped is not None:
        err.print(f"note: {clamped}")
    tokenizer = GGUFTokenizer(opened.metadata)
    ids = tokenizer.encode(file.read_text(encoding="utf-8", errors="replace"))
    forward = load_forward(opened, RuntimeOptions(ffn=ffn), ctx_size=ctx_size).forward
    with progress_when_started() as bar:
        task = bar.add_task("perplexity", total=None)

        def step(i: int, n: int, ppl: float) -> None:
            # Started on the first window, so that a refused input prints only its error line.
            bar.start()
            bar.update(task, completed=i + 1, total=n, description=f"perplexity {ppl:.4f}")

        result = perplexity(forward, ids, ctx_size, tokenizer.bos_id, ffn == "sparse", step, policy, types)
    kept = "" if not policy.windowed else f", KV window of {policy.rows(ctx_size)} rows"
    err.print(f"{result.windows} windows of {ctx_size} tokens, {result.scored_tokens} tokens scored ({ffn} FFN{kept})")
    print(f"Final estimate: PPL = {result.perplexity:.4f} +/- {result.stderr:.5f}")
