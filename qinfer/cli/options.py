"""What the commands' number options may hold, so that a meaningless value is refused before any work starts.

Integers use typer's `min` and `max`. Floats parse through `Real`: typer's bounds are inclusive only, and a float
without an upper bound would let inf through, where every float option here needs a finite number.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Annotated

import typer

from qinfer.core.kv_policy import CACHE_TYPES, KV_POLICIES, KVPolicy, KVTypes, parse_kv_budget

SEED_MAX = 2**32 - 1  # llama.cpp's seeds are 32-bit; past 64 bits torch's generator overflows
# Far above any single GPU's memory, yet a byte count the planner's arithmetic still holds exactly.
VRAM_BUDGET_MAX_GIB = 1024.0


@dataclass(frozen=True)
class Real:
    """A typer `parser` for a finite float in an interval; either end may be open or absent."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __call__(self, value: str | float) -> float:
        try:
            number = float(value)
        except ValueError:
            raise typer.BadParameter(f"{value!r} is not a number") from None
        if not math.isfinite(number):
            raise typer.BadParameter(f"{value} is not a finite number")
        if not self._holds(number):
            raise typer.BadParameter(f"{value} is outside {self}")
        return number

    def _holds(self, number: float) -> bool:
        above = self.low is None or (number > self.low if self.low_open else number >= self.low)
        below = self.high is None or (number < self.high if self.high_open else number <= self.high)
        return above and below

    def __str__(self) -> str:
        # The notation of typer's own ranges ("x>=0", "0<=x<=10"), which --help shows for the integer options.
        if self.high is None:
            return f"x{'>' if self.low_open else '>='}{self.low:g}"
        low = "" if self.low is None else f"{self.low:g}{'<' if self.low_open else '<='}"
        return f"{low}x{'<' if self.high_open else '<='}{self.high:g}"


VRAM_BUDGET = Real(0.0, VRAM_BUDGET_MAX_GIB, low_open=True)


KvPolicyOption = Annotated[
    str,
    typer.Option(
        "--kv-policy",
        help="KV cache: full keeps every row of the context; window keeps --kv-budget rows per sequence "
        "(attention sinks, a recent window and the heaviest hitters by attention mass).",
    ),
]
KvBudgetOption = Annotated[
    float | None,
    typer.Option(
        "--kv-budget",
        metavar="TOKENS|FRACTION",
        parser=parse_kv_budget,  # its UserError names the option
        help="Rows --kv-policy window keeps: tokens (1024) or a fraction of the context (0.25 or 25%).",
    ),
]


def kv_policy(kind: str, budget: float | None) -> KVPolicy:
    """The policy --kv-policy and --kv-budget ask for; a budget without a window, or a window without a budget, is
    refused rather than ignored or guessed."""
    if kind not in KV_POLICIES:
        raise typer.BadParameter(f"use {' or '.join(KV_POLICIES)}", param_hint="--kv-policy")
    if kind == "full":
        if budget is not None:
            raise typer.BadParameter("only --kv-policy window keeps a budget of rows", param_hint="--kv-budget")
        return KVPolicy()
    if budget is None:
        raise typer.BadParameter("--kv-policy window needs --kv-budget TOKENS or a FRACTION", param_hint="--kv-budget")
    return KVPolicy("window", budget)


CacheTypeK = Annotated[
    str,
    typer.Option(
        "-ctk",
        "--cache-type-k",
        help="Element type of the KV cache's keys on the CPU: f16, f32 or q8_0 (34 bytes per 32; head_dim a multiple "
        "of 32). A GPU's cache is f16.",
    ),
]
CacheTypeV = Annotated[
    str,
    typer.Option(
        "-ctv",
        "--cache-type-v",
        help="Element type of the KV cache's values on the CPU: f16, f32 or q8_0 (34 bytes per 32; head_dim a "
        "multiple of 32). A GPU's cache is f16.",
    ),
]


def kv_types(k: str, v: str) -> KVTypes:
    """The cache types --cache-type-k and --cache-type-v name."""
    for name, hint in ((k, "--cache-type-k"), (v, "--cache-type-v")):
        if name not in CACHE_TYPES:
            raise typer.BadParameter(f"use {', '.join(CACHE_TYPES)}", param_hint=hint)
    return KVTypes(k, v)


ResetGpuIndex = Annotated[
    bool,
    typer.Option(
        "--reset-gpu-index",
        help="Plan the .gpuidx anew even if one exists (run and serve refuse one made with other settings without it).",
    ),
]

Threads = Annotated[
    int, typer.Option("-t", "--threads", min=0, help="CPU threads (default: all cores; capped at the core count).")
]


def use_threads(threads: int) -> None:
    """Apply --threads: 0 keeps torch's default, and more threads than cores are capped with a note, since they
    only contend for the cores (--threads 1000 once ran 160x slower)."""
    import torch

    if threads == 0:
        return
    cores = os.cpu_count() or 1
    if threads > cores:
        # Plain print: rich would wrap the note onto a second line in a narrow terminal.
        print(f"note: --threads {threads} is more than the {cores} cores here; using {cores}", file=sys.stderr)
        threads = cores
    torch.set_num_threads(threads)


CTX_HELP = "Context length: 512 by default, or the model's if shorter; 0 takes the model's; a longer one is clamped."
