"""Build a tiny ReLU-sparse LLaMA ("synth") with a real tokenizer and PowerInfer-style predictors, offline.

No checkpoint or data set can be downloaded here, so tests and benchmarks need a model made on the spot that
still behaves like ReluLLaMA where it matters: most FFN neurons stay silent on each token, a few hot neurons do
most of the firing, and a small predictor can tell from the residual stream which neurons will fire.

The recipe lives in three modules beside this one: tokenizer.py (the tokenizer and text), model.py (weights, training
under exact sparsity) and predictors.py (exact predictors, measured and saved); this one runs it and writes the build.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import sentencepiece as spm
import torch
from transformers import LlamaForCausalLM

from qinfer.core.errors import UserError
from qinfer.formats.atomic_file import OutputKind, atomic_directory, check_replaceable
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.prep.synth.model import (
    BATCH,
    Progress,
    SynthShape,
    firing_rates,
    init_model,
    observe,
    save_model,
    shrink_bias_columns,
    train,
)
from qinfer.prep.synth.predictors import build_predictors, choose_threshold, measure, save_predictors
from qinfer.prep.synth.tokenizer import SEQ_LEN, TOKENIZER_CHARS, text_batch, token_stream, train_tokenizer

DEFAULT_TRAIN_STEPS = 100  # about 40 s on 2 cores for the default shape, to a held-out loss near 0.85
TRAIN_CHARS_MAX = 4_000_000  # about a million tokens: windows drawn from it repeat rarely even in long runs
# Calibration and held-out text get up to 32 sequences each, fewer for big models (down to 2 for 7B-sized
# layers) so that each pass stays within this many FLOPs, i.e. seconds on 2 cores and little memory.
SAMPLE_ROWS = (2, 32)
SAMPLE_FLOPS = 2e11
DEFAULT_SHAPE = SynthShape()
# The whole directory is swapped, so only an earlier build (known by its manifest) is replaced without --force.
SYNTH_BUILD = OutputKind("synth build", lambda path: (path / "synth.json").is_file())


@dataclass(frozen=True)
class SynthReport:
    model_dir: Path
    predictor_dir: Path
    sparsity: float  # mean fraction of FFN neurons not firing (gate <= 0) over held-out tokens, all layers
    top20_share: float  # share of firings held by each layer's hottest 20% of neurons, averaged over layers
    per_layer_sparsity: list[float]
    train_seconds: float
    heldout_loss: float  # next-token cross-entropy on held-out text; log(vocab) is a uniform guess
    predictor_recall: float  # share of held-out firings that the predictors flag, all layers
    predictor_sparsity: float  # share of neurons the predictors leave out on held-out tokens, all layers
    sparse_threshold: float


def build_synth(
    out: Path,
    shape: SynthShape = DEFAULT_SHAPE,
    seed: int = 0,
    train_steps: int | None = None,
    target_sparsity: float = 0.9,
    progress: Progress | None = None,
    force: bool = False,
    train_seq_len: int = SEQ_LEN,
) -> SynthReport:
    """Write `out/model` (a Hugging Face LLaMA checkpoint with tokenizer), `out/predictor` and `out/synth.json`.

    Everything is built in a sibling directory that replaces `out` only when complete; `out` must be new, empty
    or an earlier build unless `force`. `train_seq_len` is the length of the training windows: the context a
    model is trained to use (for long-context studies, up to `shape.context`).
    """
    check_synth_args(shape, train_steps, target_sparsity, train_seq_len)
    check_replaceable(out, SYNTH_BUILD, force)
    steps = DEFAULT_TRAIN_STEPS if train_steps is None else train_steps
    tell = progress or _no_progress
    gen = torch.Generator().manual_seed(seed)

    tell("tokenizer", 0, 1)
    tokenizer_model = train_tokenizer(synth_corpus(seed, TOKENIZER_CHARS, "train"), shape.vocab)
    sp = spm.SentencePieceProcessor(model_proto=tokenizer_model)
    tell("tokenizer", 1, 1)

    rates = firing_rates(shape.layers, shape.ffn, 1.0 - target_sparsity, gen)
    model, bases = init_model(shape, gen)
    started = time.monotonic()
    if steps:
        stream = token_stream(sp, synth_corpus(seed, min(steps * BATCH * SEQ_LEN * 5, TRAIN_CHARS_MAX), "train"))
        train(model, bases, stream, rates, steps, gen, tell, train_seq_len)
    train_seconds = time.monotonic() - started

    rows = sample_rows(model)
    tell("calibrate", 0, 1)
    calib = observe(model, text_batch(sp, seed, "calibrate", rows), rates)
    shrink_bias_columns(model)
    predictors = build_predictors(model, bases, shape.predictor_width)
    threshold = choose_threshold(predictors, calib)
    tell("calibrate", 1, 1)
    tell("measure", 0, 1)
    stats = measure(predictors, threshold, observe(model, text_batch(sp, seed, "heldout", rows)))
    tell("measure", 1, 1)

    result = SynthReport(
        model_dir=out / "model",
        predictor_dir=out / "predictor",
        sparsity=stats.sparsity,
        top20_share=stats.top20_share,
        per_layer_sparsity=stats.per_layer_sparsity,
        train_seconds=train_seconds,
        heldout_loss=stats.loss,
        predictor_recall=stats.recall,
        predictor_sparsity=stats.predicted_sparsity,
        sparse_threshold=threshold,
    )
    tell("save", 0, 1)
    with atomic_directory(out, SYNTH_BUILD, force) as tmp:
        tmp.chmod(0o755)  # a private temporary directory becomes an ordinary output one
        save_model(model, tokenizer_model, tmp / "model")
        save_predictors(predictors, threshold, tmp / "predictor")
        _write_json(tmp / "synth.json", _manifest(shape, seed, steps, target_sparsity, train_seq_len, result))
    tell("save", 1, 1)
    return result


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


def check_synth_args(
    shape: SynthShape,
    train_steps: int | None = None,
    target_sparsity: float | None = None,
    train_seq_len: int | None = None,
) -> None:
    """Refuse a shape or setting a build cannot take, every reason in one line, before any work; a setting left
    None is not checked (a build without predictors has none)."""
    problems = []
    if min(shape.layers, shape.heads, shape.kv_heads) < 1 or shape.hidden < 2 or shape.ffn < 5:
        problems.append("layers, heads and kv_heads must be positive, hidden at least 2 and ffn at least 5")
    elif shape.hidden % shape.heads or (shape.hidden // shape.heads) % 2:
        problems.append(f"hidden={shape.hidden} must split into {shape.heads} heads of an even size")
    elif shape.heads % shape.kv_heads:
        problems.append(f"heads={shape.heads} must be a multiple of kv_heads={shape.kv_heads}")
    if shape.vocab < 384:
        problems.append(f"vocab={shape.vocab} is too small: 259 ids go to byte fallback and special tokens")
    if shape.context < SEQ_LEN:
        problems.append(f"context={shape.context} must be at least {SEQ_LEN}, the length of the text sequences")
    if train_seq_len is not None and not SEQ_LEN <= train_seq_len <= shape.context:
        problems.append(f"train_seq_len={train_seq_len} must lie between {SEQ_LEN} and the context {shape.context}")
    if shape.predictor_rank < 32 or shape.predictor_rank % 32:
        problems.append(f"predictor_rank={shape.predictor_rank} must be a positive multiple of 32")
    if train_steps is not None and train_steps < 0:
        problems.append(f"train_steps={train_steps} must be >= 0")
    if target_sparsity is not None and not 0.5 <= target_sparsity < 1.0:
        problems.append(f"target_sparsity={target_sparsity} must be in [0.5, 1)")
    if problems:
        raise UserError("cannot build a synth model: " + "; ".join(problems))


def sample_rows(model: LlamaForCausalLM) -> int:
    flops_per_row = 2 * model.num_parameters() * SEQ_LEN
    return max(SAMPLE_ROWS[0], min(SAMPLE_ROWS[1], int(SAMPLE_FLOPS // flops_per_row)))


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _manifest(
    shape: SynthShape, seed: int, steps: int, target: float, seq_len: int, result: SynthReport
) -> dict[str, object]:
    """What synth.json records: the recipe, so the build can be repeated, and what was measured."""
    measured = {k: v for k, v in asdict(result).items() if k not in ("model_dir", "predictor_dir", "train_seconds")}
    recipe = {"shape": asdict(shape), "seed": seed, "train_steps": steps, "train_seq_len": seq_len}
    return {**recipe, "target_sparsity": target, **measured}
