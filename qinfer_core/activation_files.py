"""Read and write activation statistics: `activation_{i}.pt` per layer and `summary.json`
(docs/formats.md#activation-directories)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qinfer_core.atomic_file import atomic_output
from qinfer_core.errors import UserError

LAYER_FILE = re.compile(r"activation_(\d+)\.pt")
TOP_SHARES = (0.1, 0.2, 0.5)


@dataclass(frozen=True)
class LayerSummary:
    layer: int
    sparsity: float  # share of (token, neuron) pairs on which the neuron stayed silent
    top_share: dict[str, float]  # "10%" -> share of all firings held by the hottest 10% of neurons, ...


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


def write_activations(out: Path, counts: torch.Tensor, tokens: int, meta: dict[str, object]) -> list[LayerSummary]:
    """`activation_{i}.pt` (1-D int64 counts, length F) for each layer and `summary.json`, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(counts):
        with atomic_output(out / f"activation_{i}.pt") as tmp:
            torch.save(row.detach().to("cpu", torch.int64).clone(), tmp)
    layers = summarise(counts, tokens)
    summary = {"tokens": tokens, **meta, "layers": [asdict(layer) for layer in layers]}
    with atomic_output(out / "summary.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return layers


def read_activations(path: Path) -> list[torch.Tensor]:
    """The per-layer count vectors of an activation directory, ordered by integer layer index (2 before 10)."""
    if not path.is_dir():
        raise UserError(f"activation directory not found: {path}")
    found = {int(m.group(1)): p for p in path.iterdir() if (m := LAYER_FILE.fullmatch(p.name))}
    if not found:
        raise UserError(f"{path} holds no activation_{{i}}.pt files")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise UserError(f"{path} lacks activation files for layers {missing[:5]}")
    tensors = []
    for i in sorted(found):
        try:
            tensor = torch.load(found[i], map_location="cpu", weights_only=True)
        except Exception as exc:
            raise UserError(f"cannot read {found[i]} ({exc})") from exc
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
            raise UserError(f"{found[i]} must hold a 1-D tensor of per-neuron activation counts")
        tensors.append(tensor)
    return tensors
