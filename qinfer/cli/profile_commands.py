"""`qinfer prep profile`, `calibrate` and `train-predictor`: activation statistics, gate thresholds and predictors."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from qinfer.cli.app import err, prep, progress_when_started
from qinfer.cli.options import SEED_MAX, Real
from qinfer.cli.stop_signals import stops_cleanly
from qinfer.prep.profile.window_length import CALIBRATE_WINDOW, PREDICTOR_WINDOW, PROFILE_WINDOW

ModelDir = Annotated[Path, typer.Argument(help="Hugging Face model directory (config.json, weights, tokenizer).")]
Data = Annotated[Path, typer.Option(help="Corpus: a .txt or .jsonl file (field 'text'), or a directory of them.")]
DType = Annotated[str | None, typer.Option(help="bf16, f16 or f32; default f32 on the CPU, bf16 on CUDA.")]
Device = Annotated[str, typer.Option(help="cpu, cuda or auto (CUDA when available, else the CPU).")]
RECALL = Real(0.0, 1.0, low_open=True, high_open=True)


def seq_len_option(default: int) -> typer.models.OptionInfo:
    return typer.Option(
        min=1, help=f"Tokens per window the model sees at once; default {default}, or the model's context if shorter."
    )


class TokensPerSecond(ProgressColumn):
    """Tokens/s of this run since its first report: rich's own speed needs several updates within a short window,
    which a large model's slow batches do not give, and a resumed run starts with tokens it did not count."""

    def render(self, task: Task) -> Text:
        rate = task.fields.get("rate")
        return Text(f"{rate:,.0f} tok/s" if rate else "- tok/s")


@prep.command("profile")
@stops_cleanly
def profile_cmd(
    model_dir: ModelDir,
    data: Data,
    out: Annotated[Path | None, typer.Option(help="Output directory; default MODEL_DIR/activation.")] = None,
    tokens: Annotated[
        int | None, typer.Option(min=1, help="Stop after this many tokens; default the whole corpus.")
    ] = None,
    seq_len: Annotated[int | None, seq_len_option(PROFILE_WINDOW)] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Windows per forward pass.")] = 4,
    dtype: DType = None,
    device: Device = "auto",
    checkpoint_every: Annotated[int, typer.Option(min=1, help="Save resumable state every this many windows.")] = 32,
    restart: Annotated[
        bool, typer.Option("--restart", help="Discard the state of an interrupted run and start over.")
    ] = False,
    distributed: Annotated[
        bool,
        typer.Option(
            "--distributed", help="Run as one of torchrun's processes: each profiles its share, rank 0 writes the sum."
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Replace --out even if it is neither empty nor an earlier activation directory."),
    ] = False,
) -> None:
    """Count how often each FFN neuron fires over a corpus (in a model with experts: how often the router picks each
    expert): writes activation_{i}.pt per layer and summary.json.

    An interrupted run continues from its last checkpoint when started again with the same arguments (under
    torchrun: with the same number of processes, each from its own checkpoint).
    """
    from qinfer.prep.profile.activation_profile import profile_activations, torchrun_shard

    shard = torchrun_shard(os.environ) if distributed else None
    lead = shard is None or shard.rank == 0  # the one process that reports; the others stay silent
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f} tokens"),
        TokensPerSecond(),
        TimeElapsedColumn(),
        console=err,
    )
    task = bar.add_task("profile", total=tokens, rate=None)
    first: list[tuple[int, float]] = []

    def progress(done: int, total: int | None, _windows: int) -> None:
        # Started on the first report, once model and corpus have loaded, so an input error is the only output.
        bar.start()
        if not first:
            first.append((done, time.monotonic()))
        start_tokens, started = first[0]
        elapsed = time.monotonic() - started
        rate = (done - start_tokens) / elapsed if elapsed > 0 else None
        bar.update(task, completed=done, total=total, rate=rate)

    try:
        result = profile_activations(
            model_dir,
            data,
            out,
            tokens=tokens,
            seq_len=seq_len,
            batch_size=batch_size,
            dtype=dtype,
            device=device,
            checkpoint_every=checkpoint_every,
            restart=restart,
            on_progress=progress if lead else None,
            shard=shard,
            force=force,
        )
    finally:
        if bar.live.is_started:  # a bar never started would still end its line: a blank one, on every other rank
            bar.stop()
    if not lead:
        return
    if result.fell_back_to_cpu:
        err.print("CUDA is not available: profiled on the CPU")
    if result.resumed_from:
        err.print(f"resumed after {result.resumed_from} windows")
    err.print(f"wrote {result.out} ({result.tokens} tokens, {result.dtype} on {result.device})")
    for layer in result.layers:
        shares = "/".join(f"{share:.0%}" for share in layer.top_share.values())
        if result.unit == "expert":  # a router's sparsity is fixed (1 - used / count); only its skew is news
            err.print(f"layer {layer.layer}: the most-routed 10/20/50% of experts take {shares} of the routings")
        else:
            err.print(f"layer {layer.layer}: sparsity {layer.sparsity:.1%}, hottest 10/20/50% hold {shares}")


@prep.command("train-predictor")
@stops_cleanly
def train_predictor_cmd(
    model_dir: ModelDir,
    data: Data,
    out: Annotated[Path, typer.Option(help="Predictor directory to write (model_{i}.pt, config.json).")],
    rank: Annotated[
        int | None, typer.Option(min=32, help="Predictor width P for every layer (a multiple of 32).")
    ] = None,
    auto_rank: Annotated[
        bool,
        typer.Option(
            "--auto-rank", help="Size each layer by its sparsity and skew within 10% of FFN parameters (default)."
        ),
    ] = False,
    recall: Annotated[
        float, typer.Option(parser=RECALL, help=f"Share of firing neurons to catch on held-out tokens ({RECALL}).")
    ] = 0.95,
    train_tokens: Annotated[int, typer.Option(min=1, help="Tokens whose residuals the predictors train on.")] = 20_000,
    heldout_tokens: Annotated[int, typer.Option(min=1, help="Held-out tokens for the threshold and recall.")] = 4_000,
    seq_len: Annotated[int | None, seq_len_option(PREDICTOR_WINDOW)] = None,
    epochs: Annotated[int, typer.Option(min=1, help="Passes over the training tokens per layer.")] = 12,
    seed: Annotated[int, typer.Option(min=0, max=SEED_MAX, help="Seed for initialisation and shuffling.")] = 0,
    dtype: DType = None,
    device: Device = "auto",
    force: Annotated[
        bool,
        typer.Option("--force", help="Replace --out even if it is neither empty nor an earlier predictor directory."),
    ] = False,
    calibration: Annotated[
        Path | None,
        typer.Option(help="A SwiGLU model's calibration directory: predict the neurons over its gate thresholds."),
    ] = None,
) -> None:
    """Train the low-rank predictor fc2(relu(fc1(h))) per layer and pick sparse_threshold for the recall target."""
    from qinfer.core.errors import UserError
    from qinfer.prep.predictor.training import TrainSettings, train_predictors

    if rank is not None and auto_rank:
        raise UserError("pass either --rank or --auto-rank, not both")
    settings = TrainSettings(
        rank=rank,
        recall=recall,
        train_tokens=train_tokens,
        heldout_tokens=heldout_tokens,
        seq_len=seq_len,
        epochs=epochs,
        seed=seed,
        dtype=dtype,
        device=device,
        calibration=calibration,
    )
    with progress_when_started() as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            bar.start()
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        report = train_predictors(model_dir, data, out, settings, progress, force=force)
    if report.fell_back_to_cpu:
        err.print("CUDA is not available: trained on the CPU")
    err.print(
        f"wrote {report.out}: sparse_threshold {report.sparse_threshold:.4f} "
        f"({report.train_tokens} training, {report.heldout_tokens} held-out tokens)"
    )
    for q in report.layers:
        err.print(
            f"layer {q.layer}: rank {q.rank}, recall {q.recall:.3f}, precision {q.precision:.3f}, "
            f"predicted sparsity {q.predicted_sparsity:.1%} (true {q.true_sparsity:.1%})"
        )
    share = report.params / (report.budget / 0.1)
    note = "" if report.within_budget else " - over the 10% budget: rank 32 per layer is the minimum"
    err.print(f"predictors: {report.params} parameters, {share:.1%} of the FFN's{note}")


SPARSITY = Real(0.0, 1.0, high_open=True)


@prep.command("calibrate")
@stops_cleanly
def calibrate_cmd(
    model_dir: ModelDir,
    data: Data,
    sparsity: Annotated[
        float,
        typer.Option(parser=SPARSITY, help=f"Share of (token, neuron) pairs to skip in every layer ({SPARSITY})."),
    ] = 0.5,
    out: Annotated[Path | None, typer.Option(help="Output directory; default MODEL_DIR/calibration.")] = None,
    tokens: Annotated[
        int | None, typer.Option(min=1, help="Calibrate on this many tokens; default the whole corpus.")
    ] = None,
    seq_len: Annotated[int | None, seq_len_option(CALIBRATE_WINDOW)] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Windows per forward pass.")] = 4,
    dtype: DType = None,
    device: Device = "auto",
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Replace --out even if it is neither empty nor an earlier calibration or activation."
        ),
    ] = False,
) -> None:
    """Make a SwiGLU model sparse without training (CATS): per layer, the threshold on |silu(gate)| under which
    --sparsity of the corpus's activations fall. Writes gate_thresholds.json and, as `prep profile` does,
    activation_{i}.pt per layer and summary.json; `prep convert --calibration DIR` puts the thresholds in the file.
    """
    from qinfer.prep.profile.gate_calibration import calibrate_gate

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,.0f} tokens"),
        TimeElapsedColumn(), console=err,
    )  # fmt: skip
    tasks: dict[str, TaskID] = {}

    def progress(stage: str, done: int, total: int) -> None:
        bar.start()
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done)

    try:
        result = calibrate_gate(
            model_dir, data, sparsity, out, tokens=tokens, seq_len=seq_len, batch_size=batch_size, dtype=dtype,
            device=device, on_progress=progress, force=force,
        )  # fmt: skip
    finally:
        if bar.live.is_started:
            bar.stop()
    calibration = result.calibration
    err.print(f"wrote {result.out} ({calibration.tokens} tokens, {result.dtype} on {result.device})")
    for i, (threshold, achieved) in enumerate(zip(calibration.thresholds, result.achieved, strict=True)):
        err.print(f"layer {i}: threshold {threshold:.4g}, sparsity {achieved:.1%}")
