"""Train per-layer activation predictors fc2(relu(fc1(h))) for a ReLU model and write a predictor directory."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from qinfer.core.errors import UserError
from qinfer.core.spec_readers import spec_from_hf_dir
from qinfer.formats.atomic_file import OutputKind, atomic_directory, check_apart, check_replaceable
from qinfer.formats.calibration_dir import read_calibration
from qinfer.formats.predictor_dir import FC1, FC2
from qinfer.formats.torch_files import save_torch_file
from qinfer.prep.predictor.quality import LayerQuality, Predictor, layer_quality, predictor_logits
from qinfer.prep.predictor.rank import RANK_STEP, RankPlan, auto_ranks, fixed_ranks
from qinfer.prep.predictor.residual_sample import ResidualSample, collect_residuals
from qinfer.prep.profile.corpus_reader import corpus_files, token_windows
from qinfer.prep.profile.relu_model import load_relu_model
from qinfer.prep.profile.window_length import PREDICTOR_WINDOW, window_length

Progress = Callable[[str, int, int], None]  # (stage, done, total)

HELDOUT_EVERY = 5  # every 5th corpus window is held out for choosing the threshold and measuring recall
# A missed firing neuron changes the model's output, a false alarm only costs its compute: weigh misses more.
POS_WEIGHT = 4.0
LEARNING_RATE = 1e-2
MINIBATCH = 256
_OUTPUT_FILE = re.compile(r"model_\d+\.pt|config\.json")


def _is_earlier_output(path: Path) -> bool:
    """Exactly what write_predictor_dir writes: model_{i}.pt files and config.json, and nothing else."""
    entries = list(path.iterdir())
    return any(e.name.endswith(".pt") for e in entries) and all(
        e.is_file() and _OUTPUT_FILE.fullmatch(e.name) for e in entries
    )


# The whole directory is swapped, so a model's directory, say, must never pass for an earlier output.
PREDICTOR_OUTPUT = OutputKind("predictor directory", _is_earlier_output)


@dataclass(frozen=True)
class TrainSettings:
    rank: int | None = None  # one rank for every layer; None: sized per layer (auto)
    recall: float = 0.95
    train_tokens: int = 20_000
    heldout_tokens: int = 4_000
    seq_len: int | None = None  # tokens per window; None: PREDICTOR_WINDOW, or the model's context if shorter
    batch_size: int = 4
    epochs: int = 12
    seed: int = 0
    dtype: str | None = None
    device: str = "auto"
    calibration: Path | None = None  # a calibrated model's thresholds: the predictors learn the mask they make


@dataclass(frozen=True)
class TrainingReport:
    out: Path
    sparse_threshold: float
    layers: list[LayerQuality]  # measured on held-out tokens at sparse_threshold
    train_tokens: int
    heldout_tokens: int
    params: int
    budget: int  # 10% of the FFN parameters
    device: str
    fell_back_to_cpu: bool

    @property
    def within_budget(self) -> bool:
        return self.params <= self.budget


def train_predictors(
    model_dir: Path,
    data: Path,
    out: Path,
    settings: TrainSettings = TrainSettings(),
    on_progress: Progress | None = None,
    force: bool = False,
) -> TrainingReport:
    """Train on `data` and write the predictors to `out`, which must be new, empty or an earlier predictor
    directory unless `force` (checked before the training, which can take long)."""
    _check(settings)
    check_apart(out, {"model directory": model_dir, "corpus": data, "calibration": settings.calibration})
    check_replaceable(out, PREDICTOR_OUTPUT, force)
    context = spec_from_hf_dir(model_dir).context_length
    settings = replace(settings, seq_len=window_length(settings.seq_len, PREDICTOR_WINDOW, context))
    tell = on_progress or (lambda _s, _d, _t: None)
    files = corpus_files(data)
    loaded = load_relu_model(model_dir, settings.dtype, settings.device)
    hidden, ffn = loaded.spec.hidden, loaded.spec.ffn
    if settings.calibration is not None:
        loaded.gate_thresholds = read_calibration(settings.calibration, loaded.spec).thresholds
    elif loaded.form.act != "relu":
        raise UserError(
            f"{model_dir} is a {loaded.form.act} model, whose neurons fire only over a calibrated threshold; pass "
            "--calibration DIR (from `qinfer prep calibrate`)"
        )

    train_windows, heldout_windows = _split_windows(token_windows(loaded.tokenizer, files, settings.seq_len), settings)
    if not heldout_windows:
        raise UserError(f"the corpus {data} is too short: no window is left to hold out; use more text")
    wanted = sum(map(len, train_windows)) + sum(map(len, heldout_windows))
    seen = 0

    def counted(n: int) -> None:
        nonlocal seen
        seen += n
        tell("collect", seen, wanted)

    train = collect_residuals(loaded, train_windows, settings.batch_size, counted)
    heldout = collect_residuals(loaded, heldout_windows, settings.batch_size, counted)

    plan = _plan_ranks(train, settings.rank, hidden, ffn)
    gen = torch.Generator().manual_seed(settings.seed)
    predictors: list[Predictor] = []
    for i, rank in enumerate(plan.ranks):
        tell("train", i, len(plan.ranks))
        predictors.append(train_layer(train, i, rank, settings.epochs, gen, loaded.device))
    tell("train", len(plan.ranks), len(plan.ranks))

    thresholds = [layer_threshold(predictors[i], heldout, i, settings.recall) for i in range(len(predictors))]
    threshold, predictors = share_threshold(predictors, thresholds)
    quality = [
        layer_quality(i, p, predictor_logits(p, heldout.residuals[i].float()) >= threshold, heldout.fired(i))
        for i, p in enumerate(predictors)
    ]
    report = TrainingReport(
        out=out,
        sparse_threshold=threshold,
        layers=quality,
        train_tokens=train.tokens,
        heldout_tokens=heldout.tokens,
        params=plan.params,
        budget=plan.budget,
        device=loaded.device.type,
        fell_back_to_cpu=loaded.fell_back,
    )
    write_predictor_dir(out, predictors, report, settings, force)
    return report


def _check(settings: TrainSettings) -> None:
    if not 0.0 < settings.recall < 1.0:
        raise UserError(f"recall must be in (0, 1), not {settings.recall}")
    if settings.rank is not None and (settings.rank < RANK_STEP or settings.rank % RANK_STEP):
        raise UserError(f"rank must be a positive multiple of {RANK_STEP}, not {settings.rank}")
    if min(settings.train_tokens, settings.heldout_tokens, settings.epochs, settings.batch_size) < 1:
        raise UserError("train-tokens, heldout-tokens, epochs and batch-size must be positive")


def _split_windows(
    windows: Iterator[torch.Tensor], settings: TrainSettings
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Interleave, so that both parts see the whole corpus rather than its start and its end; stop at both caps."""
    train: list[torch.Tensor] = []
    heldout: list[torch.Tensor] = []
    train_left, heldout_left = settings.train_tokens, settings.heldout_tokens
    for index, window in enumerate(windows):
        part, left = (heldout, heldout_left) if index % HELDOUT_EVERY == HELDOUT_EVERY - 1 else (train, train_left)
        if left > 0:
            part.append(window[:left])
            if part is heldout:
                heldout_left -= len(part[-1])
            else:
                train_left -= len(part[-1])
        if train_left <= 0 and heldout_left <= 0:
            break
    return train, heldout


def _plan_ranks(sample: ResidualSample, rank: int | None, hidden: int, ffn: int) -> RankPlan:
    layers = len(sample.residuals)
    if rank is not None:
        return fixed_ranks(rank, layers, hidden, ffn)
    density, top20 = [], []
    for i in range(layers):
        counts = sample.fired(i).sum(0).double()
        total = float(counts.sum())
        density.append(total / (sample.tokens * ffn))
        top = counts.sort(descending=True).values[: math.ceil(0.2 * ffn)].sum()
        top20.append(float(top) / total if total else 1.0)
    return auto_ranks(density, top20, hidden, ffn)


def train_layer(
    sample: ResidualSample, layer: int, rank: int, epochs: int, gen: torch.Generator, device: torch.device
) -> Predictor:
    """Adam on recall-weighted BCE-with-logits. Inputs are scaled to unit RMS while training (residual streams of
    real models are far from it) and the scale is folded into fc1 afterwards, since the engine feeds raw h."""
    h = sample.residuals[layer]
    fired = sample.fired(layer)
    scale = float(h.float().pow(2).mean().sqrt()) or 1.0
    hidden, ffn = h.shape[1], fired.shape[1]
    fc1 = (torch.randn(rank, hidden, generator=gen) / math.sqrt(hidden)).to(device).requires_grad_()
    fc2 = (torch.randn(ffn, rank, generator=gen) / math.sqrt(rank)).to(device).requires_grad_()
    optimizer = torch.optim.Adam([fc1, fc2], lr=LEARNING_RATE)
    steps = epochs * math.ceil(len(h) / MINIBATCH)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    pos_weight = torch.tensor(POS_WEIGHT, device=device)
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(len(h), generator=gen)
            for start in range(0, len(h), MINIBATCH):
                idx = order[start : start + MINIBATCH]
                x = h[idx].to(device, torch.float32) / scale
                logits = torch.relu(x @ fc1.T) @ fc2.T
                target = fired[idx].to(device, torch.float32)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, pos_weight=pos_weight)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
    return (fc1.detach() / scale).cpu().contiguous(), fc2.detach().cpu().contiguous()


def layer_threshold(predictor: Predictor, heldout: ResidualSample, layer: int, recall: float) -> float:
    """The largest logit threshold that still flags `recall` of the firing neurons of held-out tokens."""
    logits = predictor_logits(predictor, heldout.residuals[layer].float())
    positives = logits[heldout.fired(layer)]
    if positives.numel() == 0:
        return math.inf  # a layer that never fired: every threshold keeps its (empty) recall
    keep = math.ceil(recall * positives.numel())
    return float(positives.kthvalue(positives.numel() - keep + 1).values)


def share_threshold(predictors: list[Predictor], thresholds: list[float]) -> tuple[float, list[Predictor]]:
    """One sparse_threshold for all layers, as the format has. When the per-layer thresholds share a sign, each
    layer's fc2 is scaled by shared / own so that every layer keeps its own cut (a >= t iff a*c >= t*c, c > 0);
    otherwise the lowest threshold serves all, which keeps every layer's recall at the cost of some sparsity."""
    finite = [t for t in thresholds if math.isfinite(t)]
    if not finite:
        return 0.0, predictors
    same_sign = all(t > 0 for t in finite) or all(t < 0 for t in finite)
    if not same_sign:
        return min(finite), predictors
    shared = sorted(finite)[len(finite) // 2]
    scaled = [
        (fc1, (fc2 * (shared / t)).contiguous()) if math.isfinite(t) else (fc1, fc2)
        for (fc1, fc2), t in zip(predictors, thresholds, strict=True)
    ]
    return shared, scaled


def write_predictor_dir(
    out: Path, predictors: list[Predictor], report: TrainingReport, settings: TrainSettings, force: bool = False
) -> None:
    config = {
        "sparse_threshold": report.sparse_threshold,
        "ranks": [fc1.shape[0] for fc1, _ in predictors],
        "recall_target": settings.recall,
        "heldout_recall": [q.recall for q in report.layers],
        "heldout": [asdict(q) for q in report.layers],
        "train_tokens": report.train_tokens,
        "heldout_tokens": report.heldout_tokens,
        "predictor_params": report.params,
        "ffn_params_10pct": report.budget,
        "seq_len": settings.seq_len,
        "epochs": settings.epochs,
        "seed": settings.seed,
    }
    with atomic_directory(out, PREDICTOR_OUTPUT, force) as tmp:
        tmp.chmod(0o755)
        for i, (fc1, fc2) in enumerate(predictors):
            save_torch_file({FC1: fc1.float().contiguous(), FC2: fc2.float().contiguous()}, tmp / f"model_{i}.pt")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
