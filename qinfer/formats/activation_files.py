"""Read and write activation statistics: `activation_{i}.pt` per layer and `summary.json`
(docs/formats.md#activation-directories). A directory counts either neurons (how often each FFN neuron fired) or,
for a model with experts, experts (how many tokens the router sent to each); summary.json says which."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from qinfer.core.errors import UserError
from qinfer.core.json_object import read_json_object
from qinfer.core.model_spec import Experts
from qinfer.formats.atomic_file import atomic_output
from qinfer.formats.torch_files import load_torch_file, save_torch_file

LAYER_FILE = re.compile(r"activation_(\d+)\.pt")
SUMMARY_FILE = "summary.json"
TOP_SHARES = (0.1, 0.2, 0.5)
# What a directory counts: FFN neurons that fired, or a mixture's experts that tokens chose.
Unit = Literal["neuron", "expert"]
UNITS: tuple[Unit, ...] = ("neuron", "expert")
UNIT_KEY = "unit"  # in summary.json; absent for neurons, so that a dense profile's bytes stay as they always were


@dataclass(frozen=True)
class LayerSummary:
    layer: int
    sparsity: float  # share of (token, neuron) pairs on which the neuron stayed silent; of (token, expert) unrouted
    top_share: dict[str, float]  # "10%" -> share of all firings (routings) held by the hottest 10% of units, ...


def summarise(counts: torch.Tensor, tokens: int) -> list[LayerSummary]:
    """Per layer of counts [L, F] over `tokens` tokens."""
    out = []
    for i, row in enumerate(counts.to(torch.float64)):
        total = float(row.sum())
        hottest = row.sort(descending=True).values.cumsum(0)
        shares = {
            f"{round(q * 100)}%": (float(hottest[math.ceil(q * len(row)) - 1]) / total if total else 0.0)
            for q in TOP_SHARES
        }
        sparsity = 1.0 - total / (tokens * len(row)) if tokens else 0.0
        out.append(LayerSummary(i, sparsity, shares))
    return out


def write_activations(
    out: Path, counts: torch.Tensor, tokens: int, meta: dict[str, object], experts: Experts | None = None
) -> list[LayerSummary]:
    """`activation_{i}.pt` (1-D int64 counts, length F, or N with `experts`: the counts are routings) for each layer
    and `summary.json`, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(counts):
        # Equal counts give equal bytes (save_torch_file): a re-profiled model keeps its activation digest, and
        # processes agree.
        with atomic_output(out / f"activation_{i}.pt") as tmp:
            save_torch_file(row.detach().to("cpu", torch.int64).clone(), tmp)
    layers = summarise(counts, tokens)
    summary: dict[str, object] = {"tokens": tokens, **meta}
    if experts is not None:
        summary |= {UNIT_KEY: "expert", "expert_count": experts.count, "expert_used_count": experts.used}
    summary["layers"] = [asdict(layer) for layer in layers]
    with atomic_output(out / SUMMARY_FILE) as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return layers


def is_activation_output(path: Path, others: re.Pattern[str]) -> bool:
    """Whether the directory `path` holds what a writer of activation directories leaves there and nothing else:
    layer files, summary.json and files whose names `others` matches (a checkpoint, thresholds), one `.pt` at least.
    Such a directory is replaced whole, so a model's directory, say, must never pass for one."""
    entries = list(path.iterdir())
    return any(e.name.endswith(".pt") for e in entries) and all(
        e.is_file() and bool(LAYER_FILE.fullmatch(e.name) or e.name == SUMMARY_FILE or others.fullmatch(e.name))
        for e in entries
    )


# The commands that write a model's counts: a ReLU model's (and a mixture's) profile, a SwiGLU model's calibration.
MAKE_COUNTS = "profile the model with `qinfer prep profile` (a SwiGLU model: `qinfer prep calibrate`)"


def activation_paths(directory: Path, n_layers: int | None = None) -> list[Path]:
    """The layer files sorted by integer index (2 before 10); with `n_layers`, exactly those of layers 0 to
    n_layers - 1, else a contiguous run from 0. A missing or extra layer is a user error."""
    if not directory.is_dir():
        raise UserError(f"activation directory {directory} not found; {MAKE_COUNTS}")
    found = {int(m.group(1)): p for p in directory.iterdir() if (m := LAYER_FILE.fullmatch(p.name))}
    if not found:
        raise UserError(f"{directory} holds no activation_{{i}}.pt files; {MAKE_COUNTS}")
    layers = n_layers if n_layers is not None else max(found) + 1
    missing = sorted(set(range(layers)) - set(found))
    extra = sorted(set(found) - set(range(layers)))
    if missing or extra:
        detail = f"missing layers {missing[:5]}" if missing else f"extra layers {extra[:5]}"
        raise UserError(
            f"{directory} must hold activation_0.pt..activation_{layers - 1}.pt for this {layers}-layer model "
            f"({detail}); re-profile the model or point --activation at its own directory"
        )
    return [found[i] for i in range(layers)]


def load_counts(path: Path, neurons: int | None = None) -> torch.Tensor:
    """One layer's counts: a 1-D tensor (of `neurons` entries, when given) of finite, non-negative values."""
    tensor = load_torch_file(path, "activation counts", "re-profile the model")
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or (neurons is not None and tensor.numel() != neurons):
        shape = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        want = "a 1-D tensor of counts" if neurons is None else f"a 1-D tensor of {neurons} counts"
        raise UserError(f"{path} holds {shape}, expected {want}; re-profile the model")
    if tensor.is_complex() or not bool(torch.isfinite(tensor).all()) or bool((tensor < 0).any()):
        raise UserError(f"{path} has negative or non-finite counts; re-profile the model")
    return tensor


@dataclass(frozen=True)
class CountBasis:
    """What a directory's counts are of, from its summary.json: the unit (neurons where the summary or its "unit"
    is absent, as before experts were counted), the tokens profiled and the profiled model's architecture (each
    None where not recorded)."""

    unit: Unit
    tokens: int | None
    arch: str | None = None


def count_basis(directory: Path) -> CountBasis:
    path = directory / SUMMARY_FILE
    if not path.is_file():
        return CountBasis("neuron", None)
    summary = read_json_object(path, "re-profile the model")
    unit, tokens = summary.get(UNIT_KEY, "neuron"), summary.get("tokens")
    if unit not in UNITS:
        raise UserError(f"{path}: unit {unit!r} is not one of {', '.join(UNITS)}; re-profile the model")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
        raise UserError(f"{path}: tokens {tokens!r} is not a count; re-profile the model")
    arch = summary.get("arch")
    return CountBasis(unit, tokens, arch if isinstance(arch, str) else None)


def read_activations(path: Path) -> list[torch.Tensor]:
    """The per-layer count vectors of an activation directory, ordered by integer layer index."""
    return [load_counts(p) for p in activation_paths(path)]
