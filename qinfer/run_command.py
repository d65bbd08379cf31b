"""`qinfer run`: generate text from a GGUF model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from qinfer.app import app, err


@app.command("run")
def run_cmd(
    model: Annotated[Path, typer.Option("-m", "--model", help="GGUF or PowerInfer GGUF model file.")],
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="Text to continue.")] = "Once upon a time",
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", help="Number of tokens to generate.")] = 128,
    threads: Annotated[int, typer.Option("-t", "--threads", help="CPU threads (default: all cores).")] = 0,
    ctx_size: Annotated[int, typer.Option("-c", "--ctx-size", help="Context length (0 = the model's).")] = 512,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    temp: Annotated[float, typer.Option(help="Sampling temperature; 0 = greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens (0 = all).")] = 40,
    top_p: Annotated[
        float, typer.Option(help="Sample among the most likely tokens holding this probability mass.")
    ] = 0.95,
    ignore_eos: Annotated[bool, typer.Option(help="Keep generating after the end-of-text token.")] = False,
) -> None:
    """Generate text from a prompt, streaming tokens, then print prompt and decode speed."""
    import torch

    from qinfer_runtime.generate import generate
    from qinfer_runtime.llama_forward import LlamaForward
    from qinfer_runtime.model_file import open_model
    from qinfer_runtime.sampling import SamplingParams
    from qinfer_runtime.tokenizer import GGUFTokenizer

    if threads > 0:
        torch.set_num_threads(threads)
    loaded = open_model(model)
    ctx = loaded.config.context_length if ctx_size <= 0 else min(ctx_size, loaded.config.context_length)
    tokenizer = GGUFTokenizer(loaded.metadata)
    out = sys.stdout
    out.write(prompt)
    out.flush()

    def show(piece: str) -> None:
        out.write(piece)
        out.flush()

    result = generate(
        LlamaForward(loaded),
        tokenizer,
        prompt,
        n_predict,
        SamplingParams(temp, top_k, top_p),
        ctx,
        seed=seed,
        ignore_eos=ignore_eos,
        on_text=show,
    )
    out.write("\n")
    err.print(
        f"prompt: {result.prompt_tokens} tokens, {result.prompt_tps:.1f} tokens/s | "
        f"decode: {len(result.tokens)} tokens, {result.decode_tps:.1f} tokens/s"
    )
