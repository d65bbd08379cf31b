"""`qinfer prep ...`: synth, convert, convert-dense and quantize."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from qinfer.cli.app import err, prep, progress_bar, progress_when_started
from qinfer.cli.options import SEED_MAX, Real
from qinfer.cli.stop_signals import stops_cleanly

if TYPE_CHECKING:
    from qinfer.formats.gguf_writer import TensorPlan

SPARSITY = Real(0.5, 1.0, high_open=True)
# The options of a build with predictors, which the other families refuse when given.
PREDICTOR_OPTIONS = {"predictor_rank": "--predictor-rank", "sparsity": "--sparsity", "train_seq_len": "--train-seq-len"}


@prep.command("synth")
@stops_cleanly
def synth_cmd(
    ctx: typer.Context,
    out: Annotated[
        Path, typer.Option(help="Directory to create; gets model/ (HF checkpoint) and, for relu-llama, predictor/.")
    ],
    seed: Annotated[
        int, typer.Option(min=0, max=SEED_MAX, help="Random seed; the same seed gives the same model.")
    ] = 0,
    layers: Annotated[int, typer.Option(min=1, help="Number of transformer layers.")] = 4,
    hidden: Annotated[int, typer.Option(min=2, help="Hidden (embedding) size E.")] = 128,
    ffn: Annotated[int, typer.Option(min=5, help="FFN size F (neurons per layer).")] = 512,
    heads: Annotated[int, typer.Option(min=1, help="Attention heads.")] = 4,
    kv_heads: Annotated[
        int, typer.Option(min=1, help="Key/value heads (fewer than heads = grouped-query attention).")
    ] = 2,
    vocab: Annotated[int, typer.Option(min=384, help="Tokenizer vocabulary size.")] = 1024,
    predictor_rank: Annotated[int, typer.Option(min=32, help="Predictor hidden width P (a multiple of 32).")] = 64,
    context: Annotated[int, typer.Option(min=1, help="Context length (max positions) of the model.")] = 256,
    train_seq_len: Annotated[
        int | None,
        typer.Option(min=1, help="Tokens per training window, up to --context (default 128; long-context models)."),
    ] = None,
    train_steps: Annotated[
        int | None, typer.Option(min=0, help="Training steps; 0 builds the model without training.")
    ] = None,
    sparsity: Annotated[
        float,
        typer.Option(
            parser=SPARSITY, help=f"Target FFN activation sparsity, the fraction of idle neurons ({SPARSITY})."
        ),
    ] = 0.9,
    force: Annotated[
        bool, typer.Option("--force", help="Replace --out even if it is neither empty nor an earlier build.")
    ] = False,
    family: Annotated[
        str,
        typer.Option(
            help="relu-llama (with predictors); a SwiGLU family, llama3, mistral or qwen2 (untrained unless "
            "--train-steps; made sparse by `prep calibrate`); or a mixture of experts, mixtral, qwen2moe or "
            "qwen3moe (untrained; --ffn is each expert's)."
        ),
    ] = "relu-llama",
) -> None:
    """Build a tiny model (HF format, real tokenizer) for trying the pipeline offline: a ReLU-LLaMA and its
    predictors by default, or a SwiGLU or mixture-of-experts family's (--family)."""
    from qinfer.prep.synth.build import SynthShape, build_synth
    from qinfer.prep.synth.family_build import RELU_FAMILY, build_family
    from qinfer.prep.synth.tokenizer import SEQ_LEN

    shape = SynthShape(
        layers=layers,
        hidden=hidden,
        ffn=ffn,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        predictor_rank=predictor_rank,
        context=context,
    )
    if family != RELU_FAMILY:
        # By the source's name: typer brings its own copy of click's ParameterSource, not click's.
        given = [flag for name, flag in PREDICTOR_OPTIONS.items() if ctx.get_parameter_source(name).name != "DEFAULT"]
        if given:
            raise typer.BadParameter(
                f"only relu-llama has predictors ({', '.join(given)}); a SwiGLU model is made sparse by "
                "`qinfer prep calibrate`",
                param_hint="--family",
            )
        err.print(f"model: {build_family(out, family, shape, seed, train_steps or 0, force)}")
        return
    with progress_bar() as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        report = build_synth(
            out,
            shape,
            seed=seed,
            train_steps=train_steps,
            target_sparsity=sparsity,
            progress=progress,
            force=force,
            train_seq_len=train_seq_len or SEQ_LEN,
        )
    err.print(
        f"model: {report.model_dir}\npredictor: {report.predictor_dir}\n"
        f"FFN sparsity {report.sparsity:.1%}, hottest 20% of neurons hold {report.top20_share:.1%} of activations"
    )


@contextmanager
def tensor_progress(stage: str) -> Iterator[tuple[Callable[[list[TensorPlan]], None], Callable[[TensorPlan], None]]]:
    """Callbacks for a tensor-by-tensor writer: (on_plan, on_tensor) driving one progress bar."""
    with progress_when_started() as bar:
        task = bar.add_task(stage, total=None)

        def planned(plans: list[TensorPlan]) -> None:
            # The bar appears only once every input has been checked, so an error is the only output.
            bar.update(task, total=len(plans))
            bar.start()

        yield planned, lambda plan: bar.update(task, advance=1, description=plan.name)
        bar.update(task, description=stage)


def _convert(
    model_dir: Path,
    predictor_dir: Path | None,
    outfile: Path,
    outtype: str,
    calibration: Path | None = None,
    dense: bool = False,
) -> None:
    from qinfer.formats.atomic_file import check_output_file
    from qinfer.prep.convert.convert import convert

    # Checked before the progress bar starts, so that the error is the only output.
    check_output_file(outfile)
    with tensor_progress("convert") as (planned, done):
        result = convert(
            model_dir, outfile, predictor_dir, outtype, calibration, dense, on_plan=planned, on_tensor=done
        )
    err.print(f"wrote {result.outfile} ({result.arch}, {result.tensor_count} tensors, {result.nbytes / 2**20:.1f} MiB)")


OutType = Annotated[str, typer.Option(help="Type of 2-D weights: f16 or f32 (norms are always f32).")]


@prep.command("convert")
@stops_cleanly
def convert_cmd(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face model directory (config.json, safetensors or .bin).")],
    outfile: Annotated[Path, typer.Option(help="Output file, by convention NAME.powerinfer.gguf.")],
    predictor_dir: Annotated[
        Path | None, typer.Argument(help="Predictor directory with model_{i}.pt per layer.")
    ] = None,
    outtype: OutType = "f16",
    calibration: Annotated[
        Path | None,
        typer.Option(help="Calibration directory of `qinfer prep calibrate`: its gate thresholds go into the file."),
    ] = None,
) -> None:
    """Write a PowerInfer GGUF (sparse: transposed down weights plus the activation predictors, a calibration's
    gate thresholds, or both)."""
    from qinfer.core.errors import UserError

    if predictor_dir is None and calibration is None:
        raise UserError(
            "convert needs a predictor directory or --calibration DIR to make a sparse file; "
            "for a dense one use `qinfer prep convert-dense`"
        )
    _convert(model_dir, predictor_dir, outfile, outtype, calibration)


@prep.command("convert-dense")
@stops_cleanly
def convert_dense_cmd(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face model directory (config.json, safetensors or .bin).")],
    outfile: Annotated[Path, typer.Option(help="Output file, for example NAME.gguf.")],
    outtype: OutType = "f16",
    calibration: Annotated[
        Path | None,
        typer.Option(help="A calibration directory: its gate thresholds ride along (llama.cpp ignores them)."),
    ] = None,
) -> None:
    """Write a plain GGUF that any llama.cpp-style engine can run (no predictors). With --calibration our runtime
    skips the quiet neurons' up rows, but reads all of down (llama.cpp's layout): on Q4_0 files on the CPU that is
    faster than the PowerInfer layout's row sums until sparsity is high."""
    _convert(model_dir, None, outfile, outtype, calibration, dense=True)


@prep.command("corpus")
@stops_cleanly
def corpus_cmd(
    out: Annotated[Path, typer.Option(help="Text file to write (stories separated by blank lines).")],
    chars: Annotated[int, typer.Option(min=1, help="Write at least this many characters.")] = 200_000,
    split: Annotated[str, typer.Option(help="train, calibrate or heldout: each is its own text.")] = "calibrate",
    seed: Annotated[int, typer.Option(min=0, max=SEED_MAX, help="Random seed; the same seed gives the same text.")] = 0,
) -> None:
    """Write the synth model's TinyStories-like corpus, for profiling or training predictors offline."""
    from qinfer.core.errors import UserError
    from qinfer.formats.atomic_file import atomic_output, check_output_file
    from qinfer.prep.synth.corpus import SPLITS, synth_corpus

    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    check_output_file(out)  # before the text, which takes a while to make when it is long
    text = synth_corpus(seed, chars, split)
    with atomic_output(out) as tmp:
        tmp.write_text(text)
    err.print(f"wrote {out} ({len(text)} characters, {split} split)")


@prep.command("quantize")
@stops_cleanly
def quantize_cmd(
    infile: Annotated[Path, typer.Argument(help="F32 or F16 model file (GGUF or PowerInfer GGUF).")],
    outfile: Annotated[Path, typer.Argument(help="Output file, by convention NAME.q4.powerinfer.gguf.")],
    qtype: Annotated[str, typer.Argument(help="Q4_0 or Q8_0.")] = "Q4_0",
) -> None:
    """Quantize 2-D weights to Q4_0 or Q8_0 (output.weight to Q8_0, norms stay F32), keeping the file's magic."""
    from qinfer.formats.atomic_file import check_output_file
    from qinfer.prep.convert.quantize import quantize_gguf

    check_output_file(outfile)  # before the progress bar starts, so that the error is the only output
    with tensor_progress("quantize") as (planned, done):
        result = quantize_gguf(infile, outfile, qtype, on_plan=planned, on_tensor=done)
    if result.kept_f16:
        err.print(f"kept F16 (rows not a multiple of 32): {', '.join(result.kept_f16)}")
    err.print(
        f"wrote {result.outfile} ({result.target}, {result.tensor_count} tensors, "
        f"{result.in_bytes / 2**20:.1f} -> {result.out_bytes / 2**20:.1f} MiB)"
    )
