"""The `qinfer` command line: wires qinfer_prep, planner and qinfer_runtime into commands."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from qinfer_prep.errors import PrepError
from qinfer_runtime.errors import RunError

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


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    )


@prep.command("synth")
def synth_cmd(
    out: Annotated[Path, typer.Option(help="Directory to create; gets model/ (HF checkpoint) and predictor/.")],
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same model.")] = 0,
    layers: Annotated[int, typer.Option(help="Number of transformer layers.")] = 4,
    hidden: Annotated[int, typer.Option(help="Hidden (embedding) size E.")] = 128,
    ffn: Annotated[int, typer.Option(help="FFN size F (neurons per layer).")] = 512,
    heads: Annotated[int, typer.Option(help="Attention heads.")] = 4,
    kv_heads: Annotated[int, typer.Option(help="Key/value heads (fewer than heads = grouped-query attention).")] = 2,
    vocab: Annotated[int, typer.Option(help="Tokenizer vocabulary size.")] = 1024,
    predictor_rank: Annotated[int, typer.Option(help="Predictor hidden width P (a multiple of 32).")] = 64,
    train_steps: Annotated[
        int | None, typer.Option(help="Training steps; 0 builds the model without training.")
    ] = None,
    sparsity: Annotated[float, typer.Option(help="Target FFN activation sparsity (fraction of idle neurons).")] = 0.9,
) -> None:
    """Build a tiny ReLU-LLaMA (HF format, real tokenizer) and its predictors, for trying the pipeline offline."""
    from qinfer_prep.synth import SynthShape, build_synth

    shape = SynthShape(
        layers=layers,
        hidden=hidden,
        ffn=ffn,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        predictor_rank=predictor_rank,
    )
    with _progress() as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        report = build_synth(
            out, shape, seed=seed, train_steps=train_steps, target_sparsity=sparsity, progress=progress
        )
    err.print(
        f"model: {report.model_dir}\npredictor: {report.predictor_dir}\n"
        f"FFN sparsity {report.sparsity:.1%}, hottest 20% of neurons hold {report.top20_share:.1%} of activations"
    )


def _convert(model_dir: Path, predictor_dir: Path | None, outfile: Path, outtype: str) -> None:
    from qinfer_prep.convert import convert
    from qinfer_prep.gguf_writer import TensorPlan

    bar = _progress()
    task = bar.add_task("convert", total=None)

    def planned(plans: list[TensorPlan]) -> None:
        # The bar appears only once every input has been checked, so an error is the only output.
        bar.update(task, total=len(plans))
        bar.start()

    try:
        result = convert(
            model_dir,
            outfile,
            predictor_dir,
            outtype,
            on_plan=planned,
            on_tensor=lambda plan: bar.update(task, advance=1, description=plan.name),
        )
        bar.update(task, description="convert")
    finally:
        bar.stop()
    err.print(f"wrote {result.outfile} ({result.arch}, {result.tensor_count} tensors, {result.nbytes / 2**20:.1f} MiB)")


OutType = Annotated[str, typer.Option(help="Type of 2-D weights: f16 or f32 (norms are always f32).")]


@prep.command("convert")
def convert_cmd(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face model directory (config.json, safetensors or .bin).")],
    predictor_dir: Annotated[Path, typer.Argument(help="Predictor directory with model_{i}.pt per layer.")],
    outfile: Annotated[Path, typer.Option(help="Output file, by convention NAME.powerinfer.gguf.")],
    outtype: OutType = "f16",
) -> None:
    """Write a PowerInfer GGUF (sparse: transposed down weights plus the activation predictors)."""
    _convert(model_dir, predictor_dir, outfile, outtype)


@prep.command("convert-dense")
def convert_dense_cmd(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face model directory (config.json, safetensors or .bin).")],
    outfile: Annotated[Path, typer.Option(help="Output file, for example NAME.gguf.")],
    outtype: OutType = "f16",
) -> None:
    """Write a plain GGUF that any llama.cpp-style engine can run (no predictors)."""
    _convert(model_dir, None, outfile, outtype)


@app.command("plan")
def plan_cmd(
    vram_budget: Annotated[float, typer.Option(help="GiB of GPU memory the model may use.")] = 8.0,
) -> None:
    """Decide which FFN neurons live on the GPU and write the .gpuidx file (not available yet)."""
    raise PrepError("the planner is not part of this version yet; `qinfer run` runs the whole model on the CPU")


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


def main() -> None:
    """Entry point: user-caused errors end as one line on stderr and exit code 2, never a traceback."""
    try:
        app()
    except (PrepError, RunError) as exc:
        # Plain write: rich would wrap a long path onto a second line.
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
